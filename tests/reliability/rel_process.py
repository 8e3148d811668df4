"""`mmserve serve` as a real process (front end + its spawned engine process), for the tests that
need what only a whole server process shows: its own pid (signals, RSS), exit codes, the engine
process's death."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mmserve.server.health import GENERATION_SERVICE

LISTENING = re.compile(r"listening on [\d.]+:(\d+)")
ENGINE_PID = re.compile(r"engine process (\d+) started")
LOG_END_S = 30.0   # once the process exited: how long its log may take to reach the pipe's end


class ServeProcess:
    """`python -m mmserve.cli serve` (or another `command`) with its log collected on a thread (so the
    pipe never fills)."""

    def __init__(self, *args: str, command: str = "serve", env: dict[str, str] | None = None,
                 own_session: bool = False) -> None:
        """`env`: more environment variables; `own_session`: the server leads a process group of its
        own (its engine and ranks in it), as a service manager starts it."""
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-m", "mmserve.cli", command, *args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=own_session)
        self.lines: list[str] = []
        self.port: int | None = None
        self.engine_pid: int | None = None
        self._port_seen = threading.Event()
        self._pumping = threading.Thread(target=self._pump, daemon=True)
        self._pumping.start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.engine_pid is None and (m := ENGINE_PID.search(line)):
                self.engine_pid = int(m.group(1))
            if self.port is None and (m := LISTENING.search(line)):
                self.port = int(m.group(1))
                self._port_seen.set()

    def wait_port(self, timeout_s: float) -> int:
        if not self._port_seen.wait(timeout_s):
            raise AssertionError("no 'listening on' line:\n" + "".join(self.lines[-30:]))
        return self.port

    def wait_ready(self, timeout_s: float = 300) -> None:
        """Block until the server listens and its engine serves (loaded and warmed up)."""
        port = self.wait_port(timeout_s)

        async def ready():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await self.wait_serving(channel, timeout_s=timeout_s)

        asyncio.run(ready())

    async def wait_serving(self, channel, timeout_s: float = 180) -> None:
        """Poll readiness until the engine has loaded and warmed up."""
        deadline = time.monotonic() + timeout_s
        while await health(channel, GENERATION_SERVICE) != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline and self.proc.poll() is None, self.log
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def log(self) -> str:
        """What the process wrote; once it has exited, all of it. Read right after `proc.wait()`, the
        last lines could still be in the pipe (5 of 200 exits at load 5): this waits for the pipe's end,
        which comes when the process and its children have exited (LOG_END_S if one holds it open)."""
        if self.proc.poll() is not None:
            self._pumping.join(LOG_END_S)
        return "".join(self.lines)


async def health(channel, service: str) -> int:
    return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))).status


def child_pids(pid: int) -> set[int]:
    """The live processes whose parent is `pid` (from /proc)."""
    children = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:   # exited while we looked
            continue
        if int(fields[1]) == pid:
            children.add(int(stat.parent.name))
    return children


def process_exists(pid: int, timeout_s: float = 10.0) -> bool:
    """True while `pid` is still running after `timeout_s` (an exited child is reaped by its parent or init)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.05)
    return True
