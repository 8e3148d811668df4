"""bench/plot.py turns the committed benchmark JSON into PNGs (into a temp dir, not docs/img/)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_renders_the_committed_results(tmp_path):
    if not (BENCH_DIR / "results" / "serving.json").exists():
        pytest.skip("no bench/results/serving.json committed yet")
    proc = subprocess.run([sys.executable, str(BENCH_DIR / "plot.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = [Path(line) for line in proc.stdout.split()]
    assert {p.name for p in written} >= {"serving_throughput.png", "serving_ttft.png"}
    for path in written:
        assert path.parent == tmp_path and path.read_bytes()[:8] == PNG_MAGIC
