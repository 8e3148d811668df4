"""The image's HEALTHCHECK script against the server's real health states on a loopback gRPC server."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from deploy_dockerfile import Instruction, parse
from deploy_loop import LoopThread

from mmserve.server.health import GENERATION_SERVICE, OVERALL, Health

DOCKER_DIR = Path(__file__).resolve().parents[2] / "deploy" / "docker"
SCRIPT = DOCKER_DIR / "healthcheck.py"


def load_script():
    spec = importlib.util.spec_from_file_location("mmserve_healthcheck", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class LoopbackHealthServer:
    """A grpc.aio server with mmserve's Health on a loop thread, so the blocking check can call it."""

    def __init__(self) -> None:
        self.loop = LoopThread()
        self.health = Health()
        self.server, self.port = self.loop.call(self._start())

    def call(self, coro):
        return self.loop.call(coro)

    async def _start(self) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        self.health.add_to_server(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    def close(self) -> None:
        if self.loop.thread.is_alive():
            self.call(self.server.stop(0))
            self.loop.close()


@pytest.fixture
def health_server() -> Iterator[LoopbackHealthServer]:
    server = LoopbackHealthServer()
    yield server
    server.close()


def test_check_follows_live_ready_draining(health_server):
    check = load_script().check
    target = f"127.0.0.1:{health_server.port}"
    health_server.call(health_server.health.set_live())
    assert check(target, OVERALL, 2.0)
    assert not check(target, GENERATION_SERVICE, 2.0), "live but the model is not loaded yet"
    health_server.call(health_server.health.set_ready())
    assert check(target, GENERATION_SERVICE, 2.0)
    health_server.call(health_server.health.set_draining())
    assert not check(target, GENERATION_SERVICE, 2.0)
    assert check(target, OVERALL, 2.0), "a draining server is still alive"
    assert not check(target, "no.such.Service", 2.0)


def test_check_fails_when_nothing_listens(health_server):
    port = health_server.port
    health_server.close()
    assert not load_script().check(f"127.0.0.1:{port}", OVERALL, 0.5)


def test_dockerfile_healthcheck_command_runs_against_a_ready_server(health_server):
    """Run the script the way Docker would, with the Dockerfile's own arguments (port swapped for ours)."""
    (hc,) = parse(DOCKER_DIR / "Dockerfile.cpu").stages[-1].all("HEALTHCHECK")
    argv = Instruction("CMD", hc.value[hc.value.index("CMD") + 3:].strip(), hc.line).exec_form()
    args = argv[2:]
    args[args.index("--port") + 1] = str(health_server.port)

    def run() -> int:
        return subprocess.run([sys.executable, str(SCRIPT), *args], timeout=30).returncode

    health_server.call(health_server.health.set_live())
    assert run() == 1
    health_server.call(health_server.health.set_ready())
    assert run() == 0
