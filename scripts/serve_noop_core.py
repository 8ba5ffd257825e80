"""`python scripts/serve_noop_core.py SERVER_ARGS`: the server, with bench_host's NoOpRunner in
its engine core, so a load test measures the API process alone (no GPU needed):

    python scripts/serve_noop_core.py --model checkpoints/gpt2-random --device cpu \\
        --num-kv-blocks 40000 --max-queued-requests 100000 --port 8555 &
    gpt2-bench --base-url http://127.0.0.1:8555 --num-prompts 600 --input-len 128 \\
        --output-len 128 --num-workers 2

The engine core process is spawned, so it runs this file first too (as __mp_main__): the swap
of engine.build's runner below happens there as well. NOOP_STEP_MS=3 makes each step take at
least 3 ms, as a GPU's would: streams then get a token per step, as on a GPU node, instead of
the many-step batches an instant core sends.
"""
from __future__ import annotations

import os
import time

from bench_host import NoOpRunner

from engine import build
from server.__main__ import main


STEP_SECONDS = float(os.environ.get("NOOP_STEP_MS", "0")) / 1e3


class _NamedNoOpRunner(NoOpRunner):
    """What the engine process reports at startup, beside NoOpRunner's work; each step at
    least STEP_SECONDS long."""
    device, dtype, attention_backend = "none", "none", "none"

    def launch(self, out):
        start = time.perf_counter()
        launched = super().launch(out)
        time.sleep(max(0.0, STEP_SECONDS - (time.perf_counter() - start)))
        return launched


if __name__ in ("__main__", "__mp_main__"):
    build.build_runner = _NamedNoOpRunner  # the engine core builds its runner through it
if __name__ == "__main__":
    main()
