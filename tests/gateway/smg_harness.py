"""The real SMG gateway (PyPI `smg`, a Rust binary) in front of real `mmserve serve` replicas, all on
127.0.0.1 with free ports, for tests and benchmarks.

Nothing may leave the machine: SMG looks an unknown tokenizer up on the Hugging Face Hub, so
`HF_ENDPOINT` points at a loopback port that refuses connections and the replicas serve the
tokenizer themselves (VllmEngine GetTokenizer). `Fleet` starts the replicas first (their engines
load in parallel), then SMG, and waits until SMG reports ready (a tokenizer registered) and every
worker is healthy.

    with Fleet(replicas=2, policy="cache_aware") as fleet:
        client = fleet.openai()            # the official `openai` client, at SMG
        channel = fleet.replicas[0].address   # mmserve.v1 and VllmEngine on the same port
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from mmserve.config import DEMO_MODEL_DIR

SMG = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
# Small, CPU-friendly replica options (the same as tests/loopback_server.py's engine_config).
REPLICA_ARGS = ("--device", "cpu", "--dtype", "float32", "--max-num-batched-tokens", "256", "--max-num-seqs", "8",
                "--prefill-batched-tokens", "0", "--kv-cache-bytes", str(16 * 2**20), "--default-num-frames", "4",
                "--engine-threads", "1", "--worker-threads", "2", "--drain-grace-s", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DeadPort:
    """A loopback port bound but never listening: connections to it are refused at once."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._sock.close()


class _Process:
    """A child process whose combined output is collected on a thread (the pipe never fills)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace")
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM (a replica drains, SMG shuts down); `stop` waits for it."""
        if self.proc.poll() is None:
            self.proc.terminate()

    def stop(self, timeout_s: float = 10.0) -> None:
        self.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def serve_args(model: str | Path, port: int, extra: tuple[str, ...], host: str = "127.0.0.1") -> list[str]:
    """A replica's `mmserve serve` arguments."""
    return ["serve", "--model", str(model), "--host", host, "--port", str(port), *REPLICA_ARGS, *extra]


class Replica(_Process):
    """`mmserve serve` on a free port (mmserve.v1 and VllmEngine on that one port), bound to `host` alone."""

    def __init__(self, *extra: str, model: str | Path = DEMO_MODEL_DIR, env: dict[str, str] | None = None,
                 host: str = "127.0.0.1") -> None:
        self.host, self.port = host, free_port()
        argv = [sys.executable, "-m", "mmserve.cli", *serve_args(model, self.port, extra, host)]
        super().__init__(argv, dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {})))

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"grpc://{self.address}"

    def wait_ready(self, deadline: float) -> None:
        while "ready: serving" not in self.log:
            if not self.alive() or time.monotonic() > deadline:
                raise AssertionError("replica did not become ready:\n" + self.log[-4000:])
            time.sleep(0.1)


class _FrontEndLog(logging.Handler):
    """mmserve's records from one thread (an in-process replica's event loop, where its servicers log
    each request), as lines; mmserve's INFO records are on while any such log listens (the suite runs
    at WARNING; `serve` logs at INFO)."""

    _mmserve = logging.getLogger("mmserve")
    _listening = 0
    _level_before = logging.NOTSET

    def __init__(self, thread: int) -> None:
        super().__init__()
        self.thread, self.lines = thread, []
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        if _FrontEndLog._listening == 0:
            _FrontEndLog._level_before = self._mmserve.level
            self._mmserve.setLevel(logging.INFO)
        _FrontEndLog._listening += 1
        self._mmserve.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread:
            self.lines.append(self.format(record) + "\n")

    def close(self) -> None:
        if self in self._mmserve.handlers:   # once: a Fleet's stop terminates, then stops
            self._mmserve.removeHandler(self)
            _FrontEndLog._listening -= 1
            if _FrontEndLog._listening == 0:
                self._mmserve.setLevel(_FrontEndLog._level_before)
        super().close()


async def _thread_ident() -> int:
    return threading.get_ident()


class InProcessReplica:
    """A replica's `serve` options, parsed by serve's own parser, served by this process (a
    tests/loopback_server.py server: the front end on a thread, the engine forked from the tests'
    forkserver). A `serve` process costs ~5.5 s of CPU to start (a fresh interpreter importing torch,
    transformers and xgrammar, then its spawned engine again); this ~0.2 s. For tests that need a
    replica's server but not its process (a signal, its exit, its engine's log): `lines` and `log` hold
    what its front end logged once ready (each request's end, aborts, the tokenizer sent)."""

    def __init__(self, *extra: str, model: str | Path = DEMO_MODEL_DIR) -> None:
        # Here, not at the top: tests/ is on pytest's path, not on bench/gateway.py's (it imports Replica).
        from loopback_server import LoopbackServer

        from mmserve.cli import build_parser
        from mmserve.config import EngineConfig, ServerConfig, from_args

        args = build_parser(["serve"]).parse_args(serve_args(model, 0, extra))
        self.server = LoopbackServer(from_args(EngineConfig, args), from_args(ServerConfig, args))
        self._log: _FrontEndLog | None = None

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def url(self) -> str:
        return f"grpc://{self.address}"

    @property
    def lines(self) -> list[str]:
        return self._log.lines

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, deadline: float) -> None:
        self.server.start(timeout_s=max(deadline - time.monotonic(), 1.0))
        self._log = _FrontEndLog(self.server.call(_thread_ident()))

    def stop(self) -> None:
        self.server.stop()
        if self._log is not None:
            self._log.close()

    terminate = stop   # a Fleet's stop: nothing to wait for apart


class Smg(_Process):
    """`smg launch` in front of `worker_urls`, HTTP on a free port, Prometheus on another."""

    def __init__(self, worker_urls: list[str], *, policy: str = "cache_aware", hf_endpoint: str,
                 extra: tuple[str, ...] = ()) -> None:
        if not os.path.exists(SMG):
            raise AssertionError(f"no smg binary at {SMG}: install the dev extra (pip install -e '.[dev]', "
                                 "which pins smg==1.13.0)")
        self.port, self.metrics_port = free_port(), free_port()
        argv = [SMG, "launch", "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(self.metrics_port), "--shutdown-grace-period-secs", "1",
                "--policy", policy, "--worker-urls", *worker_urls, *extra]
        env = dict(os.environ, HF_ENDPOINT=hf_endpoint, HF_HUB_OFFLINE="1", NO_PROXY="*", no_proxy="*")
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
            env.pop(name, None)
        super().__init__(argv, env)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, timeout_s: float = 5.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=timeout_s) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, ""

    def workers(self) -> list[dict]:
        status, body = self.get("/workers")
        if status != 200:
            return []
        data = json.loads(body)
        return data.get("workers", data) if isinstance(data, dict) else data

    def wait_ready(self, deadline: float, num_workers: int) -> None:
        """Ready (a tokenizer registered) with `num_workers` healthy workers."""
        while True:
            if not self.alive() or time.monotonic() > deadline:
                raise AssertionError(f"smg did not become ready; workers {self.workers()}\n" + self.log[-6000:])
            if self.get("/readiness")[0] == 200:
                healthy = [w for w in self.workers() if w.get("is_healthy", w.get("healthy", True))]
                if len(healthy) >= num_workers:
                    return
            time.sleep(0.2)


class Fleet:
    """`replicas` mmserve servers behind one SMG; a context manager that stops all of them. The last
    `in_process` of them are InProcessReplicas (for tests that need those replicas' servers, not their
    processes), the others `serve` processes."""

    def __init__(self, replicas: int = 2, *, policy: str = "cache_aware", replica_args: tuple[str, ...] = (),
                 replica_env: dict[str, str] | None = None, model: str | Path = DEMO_MODEL_DIR,
                 smg_args: tuple[str, ...] = (), timeout_s: float = 300.0, in_process: int = 0) -> None:
        self.policy, self.timeout_s = policy, timeout_s
        self._replica_args, self._model, self._smg_args = replica_args, model, smg_args
        self._replica_env, self._in_process = replica_env, in_process
        self.num_replicas = replicas
        self.replicas: list[Replica | InProcessReplica] = []
        self.smg: Smg | None = None
        self.dead = DeadPort()

    def start(self) -> Fleet:
        deadline = time.monotonic() + self.timeout_s
        try:
            processes = self.num_replicas - self._in_process
            self.replicas = [Replica(*self._replica_args, model=self._model, env=self._replica_env) if i < processes
                             else InProcessReplica(*self._replica_args, model=self._model)
                             for i in range(self.num_replicas)]
            for replica in reversed(self.replicas):   # the in-process ones start while the processes load
                replica.wait_ready(deadline)
            self.smg = Smg([r.url for r in self.replicas], policy=self.policy, hf_endpoint=self.dead.url,
                           extra=self._smg_args)
            self.smg.wait_ready(deadline, self.num_replicas)
        except BaseException:
            self.stop()
            raise
        return self

    def openai(self, api_key: str = "unused", **options):
        """The official OpenAI client at SMG (no retries: a test sees the first answer)."""
        import openai

        return openai.OpenAI(base_url=self.smg.base_url + "/v1", api_key=api_key, max_retries=0,
                             timeout=options.pop("timeout", 120.0), **options)

    def model_id(self) -> str:
        return json.loads(self.smg.get("/v1/models")[1])["data"][0]["id"]

    def stop(self) -> None:
        """All at once: each process drains and exits in parallel."""
        processes = ([self.smg] if self.smg is not None else []) + self.replicas
        for process in processes:
            process.terminate()
        for process in processes:
            process.stop()
        self.dead.close()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
