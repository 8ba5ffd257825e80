"""The output side: tokenizer, incremental detokenizer with stop strings, and the output
objects handed to callers (`RequestOutput`, `CompletionOutput`)."""
