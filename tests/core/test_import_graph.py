"""The package layout is the architecture: the pure-Python core must not pull in torch,
kernels/ stands alone, the worker knows nothing of speculation, and no two packages import
each other. Tests share helpers (tests/*.py), never each other's modules."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the packages of the import graph; a module belongs to the longest that prefixes it
PACKAGES = ("engine.core", "engine.output", "engine.worker", "engine.speculative",
            "engine.structured", "engine",
            "server.bench", "server", "kernels")
# the engine's adapters over kernels/: no other engine module imports it
KERNEL_ADAPTERS = {"engine/worker/triton_ops.py", "engine/speculative/draft_model/chain_start.py"}


def test_core_output_and_host_speculation_import_no_torch():
    code = ("import sys, engine.core.scheduler, engine.core.engine_core, engine.core.config, "
            "engine.output.detokenize, engine.speculative.ngram, engine.speculative.stats, "
            "engine.speculative.switch, engine.speculative.draft_slots, "
            "engine.speculative.speculator; "
            "sys.exit(int('torch' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def _imported_modules(path: Path) -> set[str]:
    """The modules a file imports (lazy imports inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return names


def _package_of(module: str) -> str | None:
    return next((p for p in PACKAGES if module == p or module.startswith(p + ".")), None)


def _source_files() -> dict[str, Path]:
    files = {}
    for top in ("engine", "server", "kernels"):
        for path in (ROOT / top).rglob("*.py"):
            files[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
    return files


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for module, path in _source_files().items():
        source = _package_of(module)
        for imported in _imported_modules(path):
            target = _package_of(imported)
            if target is not None and target != source:
                graph[source].add(target)
    return graph


def test_no_two_packages_import_each_other_even_through_others():
    graph = _package_graph()

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt}))
                   for nxt in graph[start])

    cycles = [p for p in PACKAGES if reaches(p, p, {p})]
    assert not cycles, {p: sorted(graph[p]) for p in cycles}


def test_the_layers_import_downwards_only():
    graph = _package_graph()
    assert graph["kernels"] == set()
    assert graph["engine.core"] == set()  # the scheduler and block manager: pure Python
    assert "engine.speculative" not in graph["engine.worker"]
    assert "server" not in graph["engine"] | graph["engine.worker"] | graph["engine.speculative"]


def test_only_the_adapters_import_kernels():
    for module, path in _source_files().items():
        if module.startswith("engine."):
            uses_kernels = any(m.split(".")[0] == "kernels" for m in _imported_modules(path))
            assert not uses_kernels or str(path.relative_to(ROOT)) in KERNEL_ADAPTERS, path


def test_no_test_module_imports_another():
    tests = ROOT / "tests"
    test_modules = {path.stem for path in tests.rglob("test_*.py")}
    for path in tests.rglob("*.py"):
        imported = {m.split(".")[-1] for m in _imported_modules(path)} & test_modules
        assert not imported, f"{path.relative_to(ROOT)} imports {sorted(imported)}"
