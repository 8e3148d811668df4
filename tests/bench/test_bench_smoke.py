"""Every benchmark script runs in its seconds-long --smoke mode, so none can rot unnoticed.

The list comes from bench/run_all.py (the command docs/benchmarks.md is made with). A smoke run
must leave the committed results in bench/results/ untouched. Each script runs as its own process,
forked from one that has already imported torch and transformers (preloaded_python.py): the
script itself runs exactly as `python bench/SCRIPT --smoke` would, minus ~4 s of imports.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
PRELOADED = Path(__file__).resolve().with_name("preloaded_python.py")
TIMEOUT_S = 300


def _scripts() -> tuple[str, ...]:
    spec = importlib.util.spec_from_file_location("bench_run_all", BENCH_DIR / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SCRIPTS


def _results_digest() -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((BENCH_DIR / "results").glob("*")) if p.is_file()}


class Preloaded:
    """preloaded_python.py as a child: `run` forks one script from it and waits for its exit."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(PRELOADED)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
        self.replies: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.replies.put(line) for line in self.proc.stdout], daemon=True).start()

    def _reply(self, deadline: float) -> str:
        try:
            return self.replies.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no answer from the preloaded python in {TIMEOUT_S}s (exit {self.proc.poll()})") from None

    def run(self, script: Path, stdout: Path, stderr: Path, *args: str) -> int:
        deadline = time.monotonic() + TIMEOUT_S
        self.proc.stdin.write("\t".join([str(script), str(stdout), str(stderr), *args]) + "\n")
        self.proc.stdin.flush()
        pid = int(self._reply(deadline).split()[1])
        try:
            return int(self._reply(deadline).split()[1])
        except AssertionError:
            os.kill(pid, signal.SIGKILL)   # past TIMEOUT_S: end the script, fail the test
            self._reply(time.monotonic() + 30)   # its "exit -9", so the next run reads its own answers
            raise

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def preloaded():
    python = Preloaded()
    yield python
    python.close()


@pytest.mark.slow
@pytest.mark.parametrize("script", _scripts())
def test_bench_script_smoke(script, preloaded, tmp_path):
    path = BENCH_DIR / script
    if not path.exists():
        pytest.skip(f"bench/{script} is not written yet")
    before = _results_digest()
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    code = preloaded.run(path, out, err, "--smoke")
    stdout, stderr = out.read_text(), err.read_text()
    assert code == 0, f"{script} --smoke failed:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    assert stdout.strip(), f"{script} --smoke printed no table"
    assert _results_digest() == before, f"{script} --smoke changed committed files in bench/results/"
