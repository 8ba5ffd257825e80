"""The package layout is the architecture: the pure-Python core must not pull in torch."""
import subprocess
import sys


def test_core_output_and_spec_import_no_torch():
    code = ("import sys, engine.core.scheduler, engine.core.config, engine.output.detokenize, "
            "engine.spec.ngram, engine.spec.oracle, engine.spec.stats, "
            "engine.spec.switch; "
            "sys.exit(int('torch' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
