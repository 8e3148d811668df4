"""`mmserve serve --openai-port N`: the real SMG gateway (the `smg` wheel's binary) started beside this
server, so one command gives both doors: gRPC on --port, OpenAI HTTP (/v1/chat/completions,
/v1/completions, /v1/models) on N.

SMG speaks our VllmEngine door (docs/gateway.md). It is started once this server is ready, pointed at
this replica alone, with HF_ENDPOINT at a loopback port that refuses connections (SMG would otherwise
look the tokenizer up on the Hugging Face Hub before asking us for it), and stopped with the server.
Its output goes to our log. It shares the server's process group, so Ctrl-C stops both; a server
killed with SIGKILL leaves it running. Not with API keys or TLS: SMG's HTTP side would serve without them, so
such a server runs SMG by hand (docs/gateway.md).
"""

from __future__ import annotations

import asyncio
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

from mmserve.config import ServerConfig

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def smg_binary() -> str | None:
    """The `smg` executable: on PATH, or beside this interpreter (a virtual environment's bin/)."""
    found = shutil.which("smg")
    beside = Path(sys.executable).with_name("smg")
    return found or (str(beside) if beside.exists() else None)


def refusal(config: ServerConfig, api_keys: bool) -> str | None:
    """Why --openai-port cannot be used with this configuration, or None."""
    if not config.openai_port:
        return None
    if api_keys or config.tls_cert:
        return ("--openai-port serves HTTP without the API keys or TLS this server requires; run SMG in front "
                "by hand instead (docs/gateway.md)")
    if config.openai_port == config.port:
        return f"--openai-port {config.openai_port} is the gRPC --port too"
    if smg_binary() is None:
        return "--openai-port needs the SMG gateway: pip install 'smg==1.13.0' (in the dev extra) into this environment"
    return None


def replica_address(host: str, port: int) -> str:
    """Where SMG reaches this replica: the host it binds (bound to one address, it listens on no
    other, loopback included), or loopback where it binds every interface."""
    return f"{'127.0.0.1' if host in WILDCARD_HOSTS else host}:{port}"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class OpenAIGateway:
    """SMG in front of the replica at `worker` (host:port), its HTTP on `host`:`port`."""

    def __init__(self, host: str, port: int, worker: str) -> None:
        self.host, self.port = host, port
        self.metrics_port = _free_port(host)
        self._dead = socket.socket()   # bound, never listening: HF_ENDPOINT connections are refused at once
        self._dead.bind(("127.0.0.1", 0))
        binary = smg_binary()
        if binary is None:
            raise OSError("the smg binary is not installed")
        argv = [binary, "launch", "--host", host, "--port", str(port), "--worker-urls", f"grpc://{worker}",
                "--policy", "round_robin", "--prometheus-host", host, "--prometheus-port", str(self.metrics_port),
                "--shutdown-grace-period-secs", "1", "--log-level", "warn"]
        env = dict(os.environ, HF_ENDPOINT=f"http://127.0.0.1:{self._dead.getsockname()[1]}", HF_HUB_OFFLINE="1",
                   NO_PROXY="*", no_proxy="*")
        self._proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, errors="replace")
        self._tail: list[str] = []
        threading.Thread(target=self._pump, name="smg-log", daemon=True).start()

    def _pump(self) -> None:
        for line in self._proc.stdout:
            line = line.rstrip()
            self._tail = (self._tail + [line])[-20:]
            logger.info("smg: %s", line)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.port}/readiness", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    async def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until SMG has registered this replica and its tokenizer; OSError if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(self._ready):
            if self._proc.poll() is not None:
                raise OSError(f"smg exited with {self._proc.returncode}: " + " | ".join(self._tail[-5:]))
            if time.monotonic() > deadline:
                raise OSError(f"smg was not ready within {timeout_s:g}s: " + " | ".join(self._tail[-5:]))
            await asyncio.sleep(0.2)
        logger.info("OpenAI endpoint (SMG) at %s", self.url)

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._dead.close()
