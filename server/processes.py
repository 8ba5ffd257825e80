"""What every process of the server does at start: collect garbage rarely, and die with its
parent."""
from __future__ import annotations

import ctypes
import gc
import signal

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # every process logs alike

# both processes allocate several objects per sequence per step: CPython's default threshold
# (700) would walk the live requests' state every few hundred tokens
GC_THRESHOLDS = (100_000, 50, 1000)


def tune_gc() -> None:
    """Collect rarely, and never walk what startup built (the model, the tokenizer)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (elsewhere: the idle loop's
    parent check is the only guard)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
