"""The startup cache keeps what startup measures (skinny-GEMM table, worst step's memory) by
key: a hit skips measuring, a changed key or a corrupt file measures again and rewrites."""
import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from engine.core.config import EngineConfig
from engine.worker.kv_sizing import KVSizing
from engine.build import build_runner
from engine.worker.models.gpt2 import GPT2Config
from engine.worker.startup import StartupCache, default_cache_dir


class Measure:
    """A measurement that counts its runs."""

    def __init__(self, value):
        self.value, self.runs = value, 0

    def __call__(self):
        self.runs += 1
        return self.value


def test_round_trip_and_a_changed_key_misses(tmp_path: Path):
    cache, measure = StartupCache(tmp_path), Measure({"a": [1, 2]})
    assert cache.get_or_measure("thing", {"gpu": "x", "n": (1, 2)}, measure) == ({"a": [1, 2]},
                                                                                   False)
    assert cache.get_or_measure("thing", {"gpu": "x", "n": (1, 2)}, measure) == ({"a": [1, 2]},
                                                                                   True)
    assert measure.runs == 1
    assert cache.get_or_measure("thing", {"gpu": "y", "n": (1, 2)}, measure)[1] is False
    assert measure.runs == 2
    assert len(list(tmp_path.glob("thing-*.json"))) == 2
    assert not list(tmp_path.glob("*.tmp"))  # written through a temp file, then renamed


@pytest.mark.parametrize("content", ["{not json", '{"key": {"gpu": "other"}, "value": 3}',
                                     '{"value": 3}'])
def test_a_corrupt_file_is_ignored_with_a_warning_and_rewritten(tmp_path: Path, caplog,
                                                                  content: str):
    cache, key = StartupCache(tmp_path), {"gpu": "x"}
    cache.get_or_measure("thing", key, Measure(7))
    (path,) = tmp_path.glob("thing-*.json")
    path.write_text(content)
    measure = Measure(8)
    with caplog.at_level(logging.WARNING):
        assert cache.get_or_measure("thing", key, measure) == (8, False)
    assert "ignoring" in caplog.text and measure.runs == 1
    assert json.loads(path.read_text()) == {"key": key, "value": 8}
    assert cache.get_or_measure("thing", key, measure) == (8, True)


def test_a_value_that_does_not_decode_is_measured_again(tmp_path: Path):
    cache, measure = StartupCache(tmp_path), Measure([[1, 2]])
    cache.get_or_measure("thing", {}, measure)
    assert cache.get_or_measure("thing", {}, measure, decode=lambda rows: rows[0][5]) == (
        [[1, 2]], False)


def test_off_measures_every_time_and_writes_nothing(tmp_path: Path):
    cache, measure = StartupCache(None), Measure(1)
    cache.get_or_measure("thing", {}, measure)
    cache.get_or_measure("thing", {}, measure)
    assert measure.runs == 2 and not list(tmp_path.iterdir())


def test_a_cache_that_cannot_be_written_costs_nothing_but_a_warning(tmp_path: Path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING):
        assert StartupCache(blocker / "sub").get_or_measure("thing", {}, Measure(5)) == (5, False)
    assert "could not write" in caplog.text


def test_the_cache_lives_beside_tritons(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    assert default_cache_dir() == tmp_path / "triton" / "gpt2-serve"
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".triton" / "cache" / "gpt2-serve"


SHAPES = GPT2Config(50257, 1024, 64, 2, 4, 256, 1e-5).linear_shapes


def test_the_dispatcher_takes_the_cached_table_without_timing(tmp_path: Path, monkeypatch):
    import engine.worker.triton_ops as backend
    from kernels.gemv import GemvConfig
    from kernels.skinny_gemm import TileConfig

    table = {(192, 64, 1, False, True): TileConfig(32, 64, 2, 4, 1),
             (64, 256, 1, False, False): GemvConfig(8, 256, 4, 1, True, 2),
             (64, 256, 8, False, False): TileConfig(16, 256, 4, 4, 2)}
    measure = Measure(table)
    monkeypatch.setattr(backend, "measure_linear_wins", lambda *args: measure())
    cache, cpu = StartupCache(tmp_path), torch.device("cpu")
    ops, source = backend.measured_triton_ops(SHAPES, [1, 8], torch.float16, cpu, cache)
    assert (source, measure.runs, ops.linear.wins) == ("measured", 1, table)
    ops, source = backend.measured_triton_ops(SHAPES, [1, 8], torch.float16, cpu, cache)
    assert (source, measure.runs, ops.linear.wins) == ("cached", 1, table)
    assert [type(config) for config in ops.linear.wins.values()] == [
        type(config) for config in table.values()]
    for changed in ((SHAPES[:2], [1, 8], torch.float16), (SHAPES, [1, 2, 8], torch.float16),
                    (SHAPES, [1, 8], torch.float32)):
        assert backend.measured_triton_ops(*changed, cpu, cache)[1] == "measured"
    assert backend.measured_triton_ops(SHAPES, [1, 8], torch.float16, cpu, cache,
                                       "int8")[1] == "measured"
    monkeypatch.setattr(backend, "TILE_CANDIDATES", (TileConfig(),))
    assert backend.measured_triton_ops(SHAPES, [1, 8], torch.float16, cpu, cache)[1] == "measured"


class FakeCudaMemory:
    """torch.cuda's memory queries, for sizing the KV cache on a CPU machine: 10 GiB total,
    1 GiB free taken by others, 100 MiB of weights allocated."""

    def __init__(self, monkeypatch):
        for name, value in (("empty_cache", None), ("memory_allocated", 100 << 20),
                            ("memory_reserved", 100 << 20),
                            ("mem_get_info", ((9 << 30) - (100 << 20), 10 << 30))):
            monkeypatch.setattr(torch.cuda, name, lambda *args, value=value: value)


def test_kv_sizing_reuses_the_worst_steps_bytes_while_nothing_changed(tiny_checkpoint: Path,
                                                                      tmp_path: Path,
                                                                      monkeypatch):
    config = EngineConfig.from_flat(model=str(tiny_checkpoint), device="cpu", dtype="float32",
                                    num_kv_blocks=64, max_num_batched_tokens=256)
    runner = build_runner(config)
    assert runner.startup.summary().startswith("load ")
    assert "KV sizing" in runner.startup.summary() and "(given)" in runner.startup.summary()
    FakeCudaMemory(monkeypatch)
    measure = Measure(300 << 20)
    runner.startup_cache = StartupCache(tmp_path)
    expected = int((10 << 30) * 0.9) - (1 << 30) - (100 << 20) - (300 << 20)

    def sizing() -> KVSizing:
        kv_sizing = KVSizing(runner, None)
        kv_sizing.worst_step_bytes = measure
        return kv_sizing

    assert sizing().free_cuda_bytes() == (expected, "profiled")
    assert sizing().free_cuda_bytes() == (expected, "cached")
    assert measure.runs == 1
    runner.config = dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, max_num_batched_tokens=512))
    assert sizing().free_cuda_bytes() == (expected, "profiled")
    assert measure.runs == 2
    runner.config = dataclasses.replace(runner.config, model=dataclasses.replace(
        runner.config.model, quantization="int8"))  # 8-bit linears: split-K workspaces differ
    assert sizing().free_cuda_bytes() == (expected, "profiled")
    assert measure.runs == 3
