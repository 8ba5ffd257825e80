"""Shared fixtures. `tiny_checkpoint` is a random GPT-2 (2 layers, 64 wide, 4 heads) in HF
format, built once per test session; tests load it the way the engine loads real weights."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` run from anywhere can import engine/ and kernels/
    sys.path.insert(0, str(ROOT))


def load_script(name: str):
    """Import scripts/<name>.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    make_checkpoint = load_script("make_checkpoint").make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("tiny-gpt2"), n_layer=2, n_embd=64,
                           n_head=4, seed=0)
