"""What startup measures on the GPU (the skinny-GEMM table, the worst step's memory), kept
beside Triton's kernel cache so an unchanged restart skips it; and each startup phase's time.

An entry is `<kind>-<hash of its key>.json` holding its key (everything that changes the
answer: GPU, library versions, shapes, the measured code's source) and its value. A file that
cannot be read or holds another key is ignored with a warning and rewritten atomically (temp
file + os.replace), so a crash never leaves half a file.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parents[2]


def default_cache_dir() -> Path:
    """Triton's cache directory (TRITON_CACHE_DIR, else $TRITON_HOME or ~, then
    .triton/cache): one volume keeps the kernels and their measurements."""
    triton_dir = os.environ.get("TRITON_CACHE_DIR") or os.path.join(
        os.environ.get("TRITON_HOME") or os.path.expanduser("~"), ".triton", "cache")
    return Path(triton_dir) / "gpt2-serve"


class StartupCache:
    """Measured startup facts by key; `directory` None: every lookup misses, nothing written."""

    def __init__(self, directory: Path | None):
        self.directory = directory

    def get_or_measure(self, kind: str, key: dict[str, Any], measure: Callable[[], T],
                       encode: Callable[[T], Any] = lambda v: v,
                       decode: Callable[[Any], T] = lambda v: v) -> tuple[T, bool]:
        """The stored value for `key`, else `measure()` stored under it; and whether it was
        stored. `encode`/`decode` map the value to and from JSON."""
        stored = self._load(kind, key, decode)
        if stored is not None:
            return stored, True
        value = measure()
        self._store(kind, key, encode(value))
        return value, False

    def _path(self, kind: str, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return self.directory / f"{kind}-{digest}.json"

    def _load(self, kind: str, key: dict[str, Any], decode: Callable[[Any], T]) -> T | None:
        if self.directory is None:
            return None
        path = self._path(kind, key)
        try:
            entry = json.loads(path.read_text())
            if entry["key"] != json.loads(json.dumps(key)):  # as JSON: tuples become lists
                raise ValueError("the file holds another key")
            return decode(entry["value"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            log.warning("startup cache: ignoring %s (%s); it will be rewritten", path, exc)
            return None

    def _store(self, kind: str, key: dict[str, Any], value: Any) -> None:
        if self.directory is None:
            return
        path = self._path(kind, key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name,
                                             suffix=".tmp", delete=False) as tmp:
                json.dump({"key": key, "value": value}, tmp)
            os.replace(tmp.name, path)
        except OSError as exc:  # a read-only cache volume costs the next start, not this one
            log.warning("startup cache: could not write %s (%s)", path, exc)


def device_key(device: torch.device) -> dict[str, Any]:
    """What a measurement on `device` depends on besides its own inputs."""
    gpu = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = {"name": props.name, "sms": props.multi_processor_count,
               "memory": props.total_memory}
    return {"device": device.type, "gpu": gpu, "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": _version("triton")}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def source_hash(*packages: str) -> str:
    """Hash of the Python source under these repository folders: a code change re-measures."""
    digest = hashlib.sha256()
    for package in packages:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            digest.update(str(path.relative_to(REPO_ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class StartupPhases:
    """Seconds per startup phase, for the line logged at ready."""

    def __init__(self) -> None:
        self.phases: list[str] = []

    def add(self, name: str, seconds: float, how: str | None = None) -> None:
        self.phases.append(f"{name} {seconds:.1f} s" + (f" ({how})" if how else ""))

    def summary(self) -> str:
        return ", ".join(self.phases)
