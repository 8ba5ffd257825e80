"""Speculative decoding, all of it (docs/speculative.md): proposers and the switch-off on
the scheduler's side (pure Python), verification and the draft model on the runner's.
The scheduler and the runner see it through one small protocol each."""
