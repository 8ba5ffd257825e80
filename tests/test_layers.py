"""The package layout is the architecture: the pure-Python core must not pull in torch, and
the engine and the kernels meet in one backend module."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_core_output_and_spec_import_no_torch():
    code = ("import sys, engine.core.scheduler, engine.core.config, engine.output.detokenize, "
            "engine.speculative.ngram, engine.speculative.stats, "
            "engine.speculative.switch, engine.speculative.draft_slots, "
            "engine.speculative.speculator; "
            "sys.exit(int('torch' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def _imported_packages(path: Path) -> set[str]:
    """Top-level names of the modules a file imports (lazy imports inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return names


def test_engine_and_kernels_meet_only_in_the_backend_module():
    """engine/ reaches kernels/ only through kernels.backend, which alone imports engine/."""
    for path in (ROOT / "engine").rglob("*.py"):
        kernel_imports = {m for m in _imported_packages(path) if m.split(".")[0] == "kernels"}
        assert kernel_imports <= {"kernels.backend"}, path
    for path in (ROOT / "kernels").rglob("*.py"):
        if path.name != "backend.py":
            assert not any(m.split(".")[0] == "engine" for m in _imported_packages(path)), path
