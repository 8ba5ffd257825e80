"""The README's CPU path as a newcomer follows it: the offline Python example runs on CPU as
written (the tiny checkpoint standing in for checkpoints/gpt2-random, which is only bigger),
and its gpt2-serve and gpt2-bench command lines are ones the programs accept."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys

from server_harness import ROOT

README = (ROOT / "README.md").read_text()
CPU_CHECKPOINT = "checkpoints/gpt2-random"


def test_offline_example_runs_on_cpu_as_written(tiny_checkpoint):
    (code,) = re.findall(r"```python\n(from engine import LLM.*?)```", README, re.DOTALL)
    assert f'LLM(model="{CPU_CHECKPOINT}", device="cpu")' in code
    proc = subprocess.run([sys.executable, "-c", code.replace(CPU_CHECKPOINT,
                                                              str(tiny_checkpoint))],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith(" length")  # 8 tokens: max_tokens ended it


def readme_commands(program: str) -> list[list[str]]:
    """Each README line that runs `program`, as its arguments (comments dropped)."""
    lines = re.findall(rf"^\s*{program} (.*?)(?:\s+#.*)?$", README, re.MULTILINE)
    return [shlex.split(line) for line in lines if not line.endswith("\\")]


def test_cpu_serve_command_is_accepted():
    from server.__main__ import build_parser, engine_config_from_args

    (argv,) = [a for a in readme_commands("gpt2-serve") if CPU_CHECKPOINT in a]
    config = engine_config_from_args(build_parser().parse_args(argv))
    assert (config.model.model, config.model.device) == (CPU_CHECKPOINT, "cpu")


def test_cpu_bench_commands_are_accepted():
    from server.bench.cli import build_parser, check_args

    cpu = [argv for argv in readme_commands("gpt2-bench") if "--request-rate" in argv
           and argv[argv.index("--request-rate") + 1] == "1"]
    assert cpu, "README lost its CPU-sized gpt2-bench example"
    for argv in cpu:
        check_args(build_parser().parse_args(argv))
