"""build_engine_core starts the grammars before it builds the runner (their processes import
xgrammar while the model loads), and closes them when the runner cannot be built."""
import pytest

import engine.build as build
from engine.core.config import EngineConfig
from engine.structured.process import GrammarProcess


class _RecordedGrammarProcess(GrammarProcess):
    def __init__(self, calls: list) -> None:  # no children: only close() is observed
        self.calls = calls

    def close(self) -> None:
        self.calls.append("grammars closed")


def _record_build(monkeypatch, calls: list, runner_error: Exception | None = None):
    def grammars(config, device):
        calls.append(f"grammars on {device.type}")
        return _RecordedGrammarProcess(calls)

    def runner(config):
        calls.append("runner")
        if runner_error is not None:
            raise runner_error
        return "runner"

    monkeypatch.setattr(build, "build_grammars", grammars)
    monkeypatch.setattr(build, "build_runner", runner)
    monkeypatch.setattr(build, "measured_step_times", lambda config, runner: None)
    monkeypatch.setattr(build, "EngineCore", lambda config, runner, speculator, grammars:
                        (runner, grammars))


def test_the_grammars_start_before_the_runner_is_built(monkeypatch):
    calls = []
    _record_build(monkeypatch, calls)
    runner, grammars = build.build_engine_core(EngineConfig.from_flat(device="cpu"))
    assert calls == ["grammars on cpu", "runner"]
    assert runner == "runner" and grammars.calls is calls


def test_a_runner_that_cannot_be_built_closes_the_grammars(monkeypatch):
    calls = []
    _record_build(monkeypatch, calls, runner_error=RuntimeError("out of memory"))
    with pytest.raises(RuntimeError, match="out of memory"):
        build.build_engine_core(EngineConfig.from_flat(device="cpu"))
    assert calls == ["grammars on cpu", "runner", "grammars closed"]
