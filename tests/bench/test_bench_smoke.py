"""Every benchmark script runs in its seconds-long --smoke mode, so none can rot unnoticed.

The list comes from bench/run_all.py (the command docs/benchmarks.md is made with). A smoke run
must leave the committed results in bench/results/ untouched.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def _scripts() -> tuple[str, ...]:
    spec = importlib.util.spec_from_file_location("bench_run_all", BENCH_DIR / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SCRIPTS


def _results_digest() -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((BENCH_DIR / "results").glob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("script", _scripts())
def test_bench_script_smoke(script):
    path = BENCH_DIR / script
    if not path.exists():
        pytest.skip(f"bench/{script} is not written yet")
    before = _results_digest()
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, str(path), "--smoke"], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, f"{script} --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"{script} --smoke printed no table"
    assert _results_digest() == before, f"{script} --smoke changed committed files in bench/results/"
