"""Structured outputs: generated text that a JSON schema, a regex, a list of choices or an
EBNF grammar accepts, whatever the model prefers (xgrammar; docs/architecture.md
says why not llguidance).

    frontend      check(spec)                   a bad spec is the client's 400, before the core
    core add      grammars.submit               compiles off the loop; the sequence waits
    core apply    .advance(seqs, tokens)        the matchers take the step's tokens
                  .request_mask(rows)           the next step's rows start filling
    before launch .take_mask()                  the mask, and the constraints now complete
    runner        sampler: only a row's allowed tokens can be drawn

`StructuredOutputs` (manager.py) does it all in the core's process; `GrammarProcess`
(process.py) in child processes, so the fill overlaps the core's thread (CUDA engines).
"""
