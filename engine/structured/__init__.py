"""Structured outputs: generated text that a JSON schema, a regex, a list of choices or an
EBNF grammar accepts, whatever the model prefers (xgrammar; docs/architecture.md
says why not llguidance).

    frontend    check(spec)                  a bad spec is the client's 400, before the core
    core add    StructuredOutputs.submit     compiles off the loop; the sequence waits
    each step   .mask(step)                  one bitmask row per constrained sampled row
    runner      sampler: logits[row] = -inf where the row's bit is 0
    core apply  .advance(request)            the matchers take the step's tokens
"""
