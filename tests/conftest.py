"""Shared fixtures. `tiny_checkpoint` is a random GPT-2 (2 layers, 64 wide, 4 heads) in HF
format, built once per test session; tests load it the way the engine loads real weights."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.worker.models.random_checkpoint import make_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny-gpt2"), n_layer=2, n_embd=64,
                           n_head=4, seed=0)
