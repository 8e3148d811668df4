"""`mmserve serve` as a real process, for tests that need its own pid (signals, RSS)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

LISTENING = re.compile(r"listening on [\d.]+:(\d+)")


class ServeProcess:
    """`python -m mmserve.cli serve` with its log collected on a thread (so the pipe never fills)."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "mmserve.cli", "serve", *args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.port: int | None = None
        self._port_seen = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.port is None and (m := LISTENING.search(line)):
                self.port = int(m.group(1))
                self._port_seen.set()

    def wait_port(self, timeout_s: float) -> int:
        if not self._port_seen.wait(timeout_s):
            raise AssertionError("no 'listening on' line:\n" + "".join(self.lines[-30:]))
        return self.port

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
