"""`gpt2-serve`'s command line: one-line startup errors, flag help and choices, and the preset
picked from the model's name."""
from __future__ import annotations

import socket

import pytest
import torch

from engine.core.config import flat_field_names
from server.__main__ import (ENGINE_FLAG_HELP, PRESET_DIR, build_parser,
                             engine_config_from_args, preset_for)
from server.healthcheck import DEFAULT_PORT
from server_harness import serve

STARTUP_FAILURES = [
    (["--config", "missing.yaml"], "gpt2-serve: error: --config missing.yaml: no such file"),
    (["--model", "/no/such/dir"], "gpt2-serve: error: model directory '/no/such/dir' does "
                                  "not exist"),
    (["--model", "gpt2-xxl"], "gpt2-serve: error: model 'gpt2-xxl' is not a local directory "
                              "and could not be fetched from the HF hub"),
    (["--max-model-len", "5000"], "gpt2-serve: error: invalid config: max_model_len=5000"),
    (["--speculative-config", "{k: 4}"], "gpt2-serve: error: invalid config: "
                                         "--speculative-config is not JSON"),
    (["--speculative-config", '{"num_speculative_tokens": 0}'],
     "gpt2-serve: error: invalid config: speculative_config.num_speculative_tokens=0"),
    (["--speculative-config", '{"num_speculative_tokens": 2, "prompt_lookup_min": 3, '
                              '"prompt_lookup_max": 2}'],
     "gpt2-serve: error: invalid config: speculative_config.prompt_lookup_min=3"),
    (["--speculative-config", '{"model": "/no/such/draft", "num_speculative_tokens": 2}'],
     "gpt2-serve: error: model directory '/no/such/draft' does not exist"),
]
if not torch.cuda.is_available():
    STARTUP_FAILURES.append((["--device", "cuda"], "gpt2-serve: error: device='cuda' was "
                                                   "asked for but CUDA is not available"))


@pytest.mark.parametrize("argv, line", STARTUP_FAILURES)
def test_startup_failure_is_one_line(argv, line, tiny_checkpoint):
    if "--model" not in argv:
        argv = ["--model", str(tiny_checkpoint), *argv]
    proc = serve(*argv)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(line), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("count", ["1", "2"])
def test_a_busy_port_fails_before_the_engine_starts(tiny_checkpoint, count):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = serve("--model", str(tiny_checkpoint), "--host", "127.0.0.1", "--port",
                     str(taken.getsockname()[1]), "--api-server-count", count)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("gpt2-serve: error: [Errno 98]")
    assert "Traceback" not in proc.stderr and "engine core" not in proc.stderr


def test_a_port_out_of_range_is_refused(tiny_checkpoint):
    proc = serve("--model", str(tiny_checkpoint), "--port", "99999")
    assert proc.returncode == 2 and "--port must be in [0, 65535]" in proc.stderr


def test_a_checkpoint_that_is_not_gpt2_is_one_line(tiny_checkpoint, tmp_path):
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    (other / "model.safetensors").write_bytes((tiny_checkpoint / "model.safetensors").read_bytes())
    proc = serve("--model", str(other), "--device", "cpu")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "not a GPT-2 checkpoint (model_type 'llama')" in proc.stderr.strip().splitlines()[-1]


def test_api_server_count_must_be_positive(tiny_checkpoint):
    proc = serve("--model", str(tiny_checkpoint), "--api-server-count", "0")
    assert proc.returncode == 2 and "--api-server-count must be >= 1" in proc.stderr


def test_debug_log_level_shows_the_traceback(tiny_checkpoint):
    proc = serve("--model", str(tiny_checkpoint), "--config", "missing.yaml",
                 "--log-level", "debug")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "FileNotFoundError" in proc.stderr


def test_every_engine_flag_has_help_and_choices_where_closed():
    assert set(ENGINE_FLAG_HELP) == set(flat_field_names())
    text = build_parser().format_help()
    for name, help_text in ENGINE_FLAG_HELP.items():
        assert "--" + name.replace("_", "-") in text
        assert help_text.split()[0] in text
    assert "{float32,float16,bfloat16,auto}" in text and "{cpu,cuda,auto}" in text
    assert "{torch,triton,auto}" in text and "{debug,info,warning,error,critical}" in text
    proc = serve("--dtype", "fp8")
    assert proc.returncode == 2 and "invalid choice: 'fp8'" in proc.stderr


@pytest.mark.parametrize("model, preset", [
    ("gpt2-xl", "gpt2-xl"), ("openai-community/gpt2-xl", "gpt2-xl"),
    ("/models/gpt2-medium", "gpt2-medium"), ("GPT2-Large", "gpt2-large"),
    ("checkpoints/gpt2-random", None), ("/tmp/tiny", None)])
def test_preset_follows_the_model_name(model, preset):
    assert preset_for(model) == (PRESET_DIR / f"{preset}.yaml" if preset else None)


def test_model_flag_alone_gets_its_preset_and_config_wins():
    parse = build_parser().parse_args
    xl = engine_config_from_args(parse(["--model", "/models/gpt2-xl"]))
    assert xl.model.model == "/models/gpt2-xl"
    assert xl.scheduler.max_num_seqs == 128  # configs/gpt2-xl.yaml; the default is 256
    explicit = engine_config_from_args(parse(["--model", "gpt2-xl", "--config",
                                              str(PRESET_DIR / "tiny-cpu.yaml")]))
    assert explicit.scheduler.max_num_seqs == 32 and explicit.model.device == "cpu"
    default = engine_config_from_args(parse([]))
    assert default.model.model == "gpt2" and default.cache.gpu_memory_utilization == 0.9


def test_healthcheck_default_port_is_the_servers():
    assert build_parser().get_default("port") == DEFAULT_PORT


@pytest.mark.parametrize("value", ["*", '{"a": 1}', '["ok", 3]'])
def test_cors_flags_take_a_json_list_of_strings(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--allowed-origins", value])
    assert "JSON list of strings" in capsys.readouterr().err
    assert build_parser().parse_args(["--allowed-methods", '["GET"]']).allowed_methods == ["GET"]
