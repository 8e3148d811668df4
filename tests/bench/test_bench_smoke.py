"""Every benchmark script runs in its seconds-long --smoke mode, so none can rot unnoticed.

The list comes from bench/run_all.py (the command docs/benchmarks.md is made with). A smoke run
must leave the committed results in bench/results/ untouched. Each script runs as its own process,
forked from one that has already imported torch and transformers (preloaded_python.py): the
script itself runs exactly as `python bench/SCRIPT --smoke` would, minus ~4 s of imports.
"""

from __future__ import annotations

import contextlib
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

    def __init__(self, *modules: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(PRELOADED), *modules], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
        self.replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.replies.put(line)
        self.replies.put(None)   # EOF: the process is gone, no further answer will come

    def _reply(self, word: str, deadline: float) -> int:
        """The number in the next answer, `word NUMBER` ("started PID", "exit CODE")."""
        try:
            line = self.replies.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no '{word}' from the preloaded python in time (exit {self.proc.poll()})") from None
        if line is None:
            self.replies.put(None)   # for the runs after this one
            raise AssertionError(f"the preloaded python exited ({self.proc.wait()}) before its '{word}'")
        said, number = line.split()
        assert said == word, f"the preloaded python answered {line!r}, expected '{word} ...'"
        return int(number)

    def run(self, script: Path, stdout: Path, stderr: Path, *args: str) -> int:
        deadline = time.monotonic() + TIMEOUT_S
        if self.proc.poll() is None:   # else the write would raise BrokenPipeError: the reply says why
            self.proc.stdin.write("\t".join([str(script), str(stdout), str(stderr), *args]) + "\n")
            self.proc.stdin.flush()
        pid = self._reply("started", deadline)
        try:
            return self._reply("exit", deadline)
        except AssertionError:
            if self.proc.poll() is None:   # past TIMEOUT_S: end the script (still the process's child), fail the test
                os.kill(pid, signal.SIGKILL)
                self._reply("exit", time.monotonic() + 30)   # its "exit -9", so the next run reads its own answers
            raise

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):   # a process that died already
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


def test_a_preloaded_python_that_dies_mid_run_fails_the_run_at_once(tmp_path, monkeypatch):
    """If the forking process dies while a script runs, no answer will come: the run must fail then,
    saying so, not wait out TIMEOUT_S (300 s a script); and the next run must fail the same way."""
    monkeypatch.setattr(sys.modules[__name__], "TIMEOUT_S", 20)
    script = tmp_path / "kill_parent.py"
    script.write_text("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n")
    python = Preloaded("json")   # a light preload: the protocol is the same
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with pytest.raises(AssertionError, match=r"the preloaded python exited \(-9\)"):
        python.run(script, out, err)
    with pytest.raises(AssertionError, match=r"the preloaded python exited \(-9\)"):
        python.run(script, out, err)
