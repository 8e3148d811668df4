"""Stopping a media decode from another thread: a deadline and a cancel flag, checked between packets.

A worker thread cannot be interrupted, and `asyncio.wait_for` around `run_in_executor` only stops
*waiting* for it. So the decoder calls `check()` between packets: after a client cancel or once the
time limit has passed, the next check raises and the worker is free again within one packet.
"""

from __future__ import annotations

import threading
import time

from mmserve.errors import LimitExceededError, RequestAbortedError

TIMEOUT_FLAG = "--video-decode-timeout-s"


class DecodeControl:
    """One decode's deadline (`timeout_s` from now; None = none) and cancel flag. `label` prefixes
    the messages (the request field, e.g. `messages[0].parts[1]`)."""

    def __init__(self, timeout_s: float | None = None, *, label: str = "video") -> None:
        self.timeout_s = timeout_s
        self.label = label
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Ask the decode to stop at its next check (thread-safe)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def expired(self) -> bool:
        return self._deadline is not None and time.monotonic() > self._deadline

    def check(self) -> None:
        """Raise RequestAbortedError after cancel(), LimitExceededError once past the deadline."""
        if self._cancelled.is_set():
            raise RequestAbortedError(f"{self.label}: decoding was cancelled")
        if self.expired():
            raise self.timeout_error()

    def timeout_error(self) -> LimitExceededError:
        return LimitExceededError(f"{self.label}: decoding (with any wait for a free decode worker) took longer "
                                  f"than {self.timeout_s:g}s", TIMEOUT_FLAG)

