"""Speculative decoding's proposers: cheap guesses of a request's next k tokens, which the
target model then verifies in one pass (engine/worker/spec_verify.py). Pure Python."""
