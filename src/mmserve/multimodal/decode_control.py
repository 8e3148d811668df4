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
        self._created = time.monotonic()
        self._started: float | None = None   # the worker's first check: when the decode itself began
        self._deadline = None if timeout_s is None else self._created + timeout_s
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
        if self._started is None:
            self._started = time.monotonic()
        if self._cancelled.is_set():
            raise RequestAbortedError(f"{self.label}: decoding was cancelled")
        if self.expired():
            raise self.timeout_error()

    def timeout_error(self) -> LimitExceededError:
        """Retryable when most of the time went waiting for a free worker (other requests' decodes: it
        may pass later); permanent when the decode itself used most of it (resending redoes that work)."""
        waited = (self._started if self._started is not None else time.monotonic()) - self._created
        if 2 * waited > self.timeout_s:
            return LimitExceededError(f"{self.label}: waited {waited:.1f}s of the {self.timeout_s:g}s decode time "
                                      "limit for a free decode worker", TIMEOUT_FLAG, retryable=True)
        return LimitExceededError(f"{self.label}: decoding took longer than {self.timeout_s:g}s", TIMEOUT_FLAG)

