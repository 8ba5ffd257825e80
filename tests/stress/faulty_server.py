"""`python -m tests.stress.faulty_server ARGS`: `python -m server ARGS`, whose model runner
fails on demand. A prompt that starts with FAIL_PROMPT makes the step that prefills it
raise; one that starts with HANG_PROMPT makes that step block forever. Generated tokens
never sit at position 0, so only such prompts trigger a fault.

The server code is unchanged: the engine core builds whatever
`engine.worker.model_runner.ModelRunner` names when it starts, and its process, spawned by
multiprocessing, runs this module (as `__mp_main__`) first, so the swap below happens there
too. Importing it (the tests read the prompts) swaps nothing."""
from __future__ import annotations

import threading

from engine.worker import model_runner
from server.__main__ import main

FAIL_PROMPT, HANG_PROMPT = [50001] * 3, [50002] * 3


class FaultyRunner(model_runner.ModelRunner):
    def launch(self, scheduled):
        starts = {tuple(seq.token_ids[:3]) for seq in scheduled.sequences
                  if seq.start_position == 0}
        if tuple(FAIL_PROMPT) in starts:
            raise RuntimeError("injected fault: this step fails")
        if tuple(HANG_PROMPT) in starts:
            threading.Event().wait()  # a step that never returns
        return super().launch(scheduled)


if __name__ in ("__main__", "__mp_main__"):  # the server, and the engine core it spawns
    model_runner.ModelRunner = FaultyRunner
if __name__ == "__main__":
    main()
