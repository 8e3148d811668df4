"""Start-up as a real `mmserve serve` process: bad flags are usage errors (exit 2 listing what is
valid), an engine that fails to load ends the server with exit 1 and its error in one line, and
SIGTERM during the load stops the server within seconds, before it ever says it is serving."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from rel_process import ServeProcess

from mmserve.config import DEMO_MODEL_DIR


def serve_usage(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmserve.cli", "serve", *args], env=dict(os.environ, **(env or {})),
                          capture_output=True, text=True, timeout=60)


class LatePump(ServeProcess):
    """Its pump starts reading late, as a thread descheduled on a loaded machine does."""

    def _pump(self) -> None:
        time.sleep(0.5)
        super()._pump()


def test_a_log_read_once_the_process_exited_holds_all_it_wrote():
    """The start-refusal tests read a server's last lines right after its exit: however late the
    thread pumping its pipe runs, ServeProcess.log then holds everything (`serve --help` as printed)."""
    late = LatePump("--help")
    assert late.proc.wait(60) == 0
    assert late.log == serve_usage("--help").stdout


@pytest.mark.parametrize(("args", "env", "named"), [
    (("--dtype", "fp8x"), None, "auto, float32, bfloat16, float16"),
    (("--device", "tpu"), None, "cuda:N"),
    (("--attention-backend", "fa5"), None, "auto, reference, sdpa, flex, fa4"),
    (("--scheduling-policy", "lifo"), None, "fcfs, priority"),
    ((), {"MMSERVE_SCHEDULING_POLICY": "lifo"}, "fcfs, priority (from MMSERVE_SCHEDULING_POLICY)"),
    (("--drain-grace-s", "nan"), None, "not a number"),
    (("--max-num-seqs", "-1"), None, "minimum 0"),   # 0 is the device's default
    (("--port", "70000"), None, "maximum 65535"),
    (("--max-num-batched-tokens", "many"), None, "not a valid int"),
    (("--max-step-slowdown", "0.5"), None, "must be above 1, or 0 (off)"),
    ((), {"MMSERVE_MAX_STEP_SLOWDOWN": "1"}, "must be above 1, or 0 (off), or -1 (the device's default) (from MMSERVE_MAX_STEP_SLOWDOWN)"),
    ((), {"MMSERVE_AUTH_HEALTH": "enabled"}, "is not one of 1/true/yes/on, 0/false/no/off (from MMSERVE_AUTH_HEALTH)"),
])
def test_bad_flag_is_a_usage_error_naming_the_valid_values(args, env, named):
    """Each of these used to pass parsing and leave a server that never became ready (or a traceback)."""
    done = serve_usage(*args, env=env)
    assert done.returncode == 2, done.stderr
    flag = args[0] if args else "--" + next(iter(env)).removeprefix("MMSERVE_").lower().replace("_", "-")
    assert f"argument {flag}" in done.stderr and named in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_engine_that_fails_to_load_exits_one_with_its_error(tmp_path):
    broken = tmp_path / "truncated"
    shutil.copytree(DEMO_MODEL_DIR, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    server = ServeProcess("--port", "0", "--model", str(broken), "--device", "cpu", "--worker-threads", "1")
    try:
        assert server.proc.wait(120) == 1, server.log
        last = [line for line in server.lines if "ERROR mmserve.server.cli" in line]
        assert len(last) == 1 and "the engine failed to start: WeightLoadError" in last[0], server.log
        assert "truncated/model.safetensors: not a readable safetensors file" in last[0], server.log
    finally:
        server.stop()


def test_sigterm_during_model_load_stops_within_seconds(tmp_path):
    server = ServeProcess("--port", "0", "--device", "cpu", "--worker-threads", "1")
    try:
        server.wait_port(60)
        deadline = time.monotonic() + 60
        while server.engine_pid is None:   # the engine process is loading the model now
            assert time.monotonic() < deadline and server.proc.poll() is None, server.log
            time.sleep(0.02)
        server.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert server.proc.wait(30) == 0, server.log
        assert time.monotonic() - sent < 10, server.log
        assert "ready: serving" not in server.log and "stopped during start-up" in server.log, server.log
    finally:
        server.stop()


def test_start_up_past_its_deadline_fails_loudly():
    """A start-up that cannot finish in --engine-ready-timeout-s exits 1 naming the flag, not a wait forever."""
    server = ServeProcess("--port", "0", "--device", "cpu", "--worker-threads", "1", "--engine-ready-timeout-s", "0.2")
    try:
        assert server.proc.wait(60) == 1, server.log
        assert "--engine-ready-timeout-s" in server.log and "ready: serving" not in server.log, server.log
    finally:
        server.stop()


def test_the_front_end_leaves_the_model_code_to_the_engine_process():
    """The front end needs only the model package's light parts (messages, prompt, spec); importing
    the package once pulled in transformers' Gemma 4 modelling and our vision tower: ~2.5 s of CPU
    on every server start, for code only the engine process runs."""
    heavy = ("mmserve.model.vision", "mmserve.model.loader", "mmserve.model.decoder",
             "transformers.models.gemma4.modeling_gemma4")
    probe = f"import sys, mmserve.server.app; print([m for m in {heavy!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"the front end imported {done.stdout.strip()}"
