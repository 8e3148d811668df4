"""The front end's end of the process boundary: start the engine core, talk to it, notice its death.

The core runs in a spawned process (CUDA-safe: the front end never initialises CUDA before it, and
spawn starts a fresh interpreter), or, with a preloaded model or --no-engine-process, on a thread of
this process; both speak the same zmq protocol. The sockets live in a private 0700 directory made
here (`tempfile.mkdtemp`), so no other user can connect to them.

Receiving runs on the event loop: one task reads `EngineCoreOutputs` and hands each to
`on_outputs`. When no message arrives for `LIVENESS_POLL_MS` it checks that the core is alive; once
it is gone and its last messages are read (one more poll after the exit is seen, for outputs sent
just before it), `on_exit` gets an EngineDeadError naming the exit code or signal (or the reason the
core sent), or None after a requested shutdown. A live core whose loop turns sends at least a
`Heartbeat` a second; once `watch_stalls()` was called (the server, after its warm-up, which
--engine-ready-timeout-s bounds), one silent for --engine-stall-timeout-s is wedged (a hung kernel
or collective, a deadlock, a stopped process): it is killed and ends as a dead one does. A core
that fails sends why (`EngineDead`) and exits only once this side has read it (`EngineDeadRead`):
its exit cannot be seen before its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq
import zmq.asyncio

from mmserve.config import EngineConfig
from mmserve.engine.types import EngineRequest
from mmserve.errors import EngineDeadError, EngineInternalError, EngineUnavailableError
from mmserve.ipc import serial
from mmserve.ipc.protocol import (
    AbortRequests,
    AddRequest,
    CoreAddresses,
    EngineCoreOutputs,
    EngineDead,
    EngineDeadRead,
    EngineReady,
    ExtendRequest,
    Heartbeat,
    Shutdown,
    UtilityCall,
)

logger = logging.getLogger(__name__)

LIVENESS_POLL_MS = 100
# After a core that was starting is seen gone: how long a message it sent just before may take to
# arrive. A core that fails waits until its EngineDead is read (EngineDeadRead), so its reason never
# trails its exit; this covers one that did not wait (killed just after it sent).
LAST_WORDS_MS = 1000


def _log_format() -> str:
    """This process's `--log-format` ("json" when the root logger formats JSON), for the engine process."""
    from mmserve.logs import JsonFormatter

    return "json" if any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers) else "text"


class CoreClient:
    def __init__(self, config: EngineConfig, *, model=None,
                 on_outputs: Callable[[EngineCoreOutputs], None],
                 on_exit: Callable[[EngineDeadError | None], None]):
        self.config = config
        self.in_process = model is not None or not config.engine_process
        self._model = model
        self._on_outputs = on_outputs
        self._on_exit = on_exit
        self._dir = Path(tempfile.mkdtemp(prefix="mmserve-engine-"))   # 0700
        self.addresses = CoreAddresses(f"ipc://{self._dir}/inputs", f"ipc://{self._dir}/outputs")
        self._ctx = zmq.asyncio.Context()
        self._recv = self._ctx.socket(zmq.PULL)
        self._send_sock = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PUSH)
        for sock in (self._recv, self._send_sock):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        self._recv.bind(self.addresses.outputs)
        # Connecting (not binding) the sending side: a connecting PUSH queues from the first send,
        # even before the core has bound its end, so no request can race the handshake.
        self._send_sock.connect(self.addresses.inputs)
        self.process: multiprocessing.process.BaseProcess | None = None
        self.thread: threading.Thread | None = None
        self.core = None             # the EngineCore object, only when it runs in this process
        self.ready: EngineReady | None = None
        self._calls = itertools.count()
        self._pending_calls: dict[int, asyncio.Future] = {}
        self._receiver: asyncio.Task | None = None
        self._shutting_down = False
        self._dead_reason: str | None = None   # what the core said before it exited, if anything
        self._kill_reason: str | None = None   # why this side killed (or gave up on) the engine, if it did
        self._stall_s = 0.0                    # watch_stalls(): how long the core may be silent (0: not watched)
        self._last_heard = 0.0
        self.exited = asyncio.Event()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> EngineReady:
        """Start the core and wait for READY; raises EngineDeadError if it fails or dies first."""
        # The engine core's entry points, imported only to start it: no front-end module imports the core.
        from mmserve.core.process import run_core, run_engine_process
        from mmserve.worker.cpu_threads import passive_openmp_waits

        if self.in_process:
            def started(core) -> None:
                self.core = core

            self.thread = threading.Thread(target=run_core, args=(self.config, self.addresses),
                                           kwargs=dict(model=self._model, started=started),
                                           name="mmserve-engine", daemon=True)
            self.thread.start()
        else:
            passive_openmp_waits()   # read by the engine's OpenMP runtime as it loads
            ctx = multiprocessing.get_context("spawn")
            self.process = ctx.Process(target=run_engine_process, name="mmserve-engine",
                                       args=(self.config, self.addresses, logging.getLogger("mmserve").getEffectiveLevel(),
                                             _log_format()))
            self.process.start()
            logger.info("engine process %d started; waiting for it to load %s", self.process.pid, self.config.model)
        deadline = time.monotonic() + self.config.engine_ready_timeout_s
        while True:
            if await self._recv.poll(LIVENESS_POLL_MS):
                message = serial.decode(await self._recv.recv_multipart(copy=False))
                if isinstance(message, EngineReady):
                    self.ready = message
                    break
                if isinstance(message, EngineDead):
                    self._dead_read()
                    await self._reap()
                    raise EngineDeadError(message.reason)
                logger.error("unexpected %s before READY", type(message).__name__)
            elif not self.alive and not await self._recv.poll(LAST_WORDS_MS):   # nothing it sent is unread
                raise EngineDeadError(f"{self._describe_exit()} while starting")
            elif time.monotonic() > deadline:
                self._kill("it did not report ready in time")
                raise EngineDeadError(f"the engine did not report ready within {self.config.engine_ready_timeout_s:g}s "
                                      f"(--engine-ready-timeout-s)")
        self._receiver = asyncio.get_running_loop().create_task(self._receive(), name="mmserve-engine-outputs")
        return self.ready

    def watch_stalls(self) -> None:
        """From now on, a core that sends nothing for --engine-stall-timeout-s is killed as wedged (start-up
        and warm-up, whose steps may compile for long, are --engine-ready-timeout-s's)."""
        self._last_heard = time.monotonic()
        self._stall_s = self.config.engine_stall_timeout_s

    @property
    def stopping(self) -> bool:
        """shutdown() was called, or the core is gone."""
        return self._shutting_down or self.exited.is_set()

    @property
    def alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        return self.thread is not None and self.thread.is_alive()

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Ask the core to end what is in flight and exit; its last outputs are still delivered."""
        if self._shutting_down:
            await self.exited.wait()
            return
        self._shutting_down = True
        if self.exited.is_set():          # already gone (or given up on as wedged): nothing to ask
            return
        if self._receiver is None:        # never started (or failed to): nothing to wait for
            self._kill("shut down before it was ready")
            self._close()
            self.exited.set()             # a second shutdown() returns at once instead of waiting forever
            return
        if self.alive:
            self._post(Shutdown())
        try:
            await asyncio.wait_for(self.exited.wait(), timeout_s)
        except TimeoutError:
            logger.error("the engine did not exit within %gs; killing it", timeout_s)
            self._kill(f"it did not exit within {timeout_s:g}s of the shutdown request")
            if self.process is None:   # a thread cannot be killed: stop waiting for it, fail what it held
                self._receiver.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._receiver
                if not self.exited.is_set():
                    self._exit(EngineDeadError(f"{self._describe_exit()}; requests in flight were lost"))
            await self.exited.wait()

    # -- requests ----------------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        self._post(AddRequest(request.core_request()))

    def extend(self, message: ExtendRequest) -> None:
        self._post(message)

    def abort(self, request_ids: list[str]) -> None:
        if self.alive and not self.exited.is_set():
            self._post(AbortRequests(request_ids))

    async def utility(self, method: str, *args):
        """Call one of the core's utility methods (core_proc.UTILITIES) and return its result; once
        stalls are watched, a call the core has not answered within --engine-stall-timeout-s (it
        answers at its next iteration) raises EngineUnavailableError."""
        call_id = next(self._calls)
        future = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = future
        try:
            self._post(UtilityCall(call_id, method, args))
            return await asyncio.wait_for(future, self._stall_s or None)
        except TimeoutError:
            raise EngineUnavailableError(f"the engine did not answer {method} within {self._stall_s:g}s "
                                         f"(--engine-stall-timeout-s)") from None
        finally:
            self._pending_calls.pop(call_id, None)

    def _post(self, message) -> None:
        if self.exited.is_set():
            raise EngineDeadError("the engine is not running")
        try:
            self._send_sock.send_multipart(serial.encode(message), flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            raise EngineDeadError(f"the engine is not reachable: {exc}") from None

    # -- receiving ---------------------------------------------------------------------------------

    async def _receive(self) -> None:
        try:
            while True:
                if await self._recv.poll(LIVENESS_POLL_MS):
                    self._last_heard = time.monotonic()
                    self._dispatch(serial.decode(await self._recv.recv_multipart(copy=False)))
                elif not self.alive and not await self._recv.poll(LIVENESS_POLL_MS):
                    break   # gone, and everything it sent has been read
                elif self._stall_s and not self._shutting_down and time.monotonic() - self._last_heard > self._stall_s:
                    self._kill(f"it sent nothing for {self._stall_s:g}s (--engine-stall-timeout-s): wedged")
                    break
            await self._reap()
            error = None if self._shutting_down and self._exit_was_clean() else EngineDeadError(
                f"{self._describe_exit()}; requests in flight were lost, retry them")
        except asyncio.CancelledError:
            raise
        except Exception as exc:   # a bug here must still end every request, never hang them
            logger.exception("engine output handler failed")
            self._kill("its output handler failed")
            error = EngineDeadError(f"the engine connection failed: {exc!r}")
        self._exit(error)

    def _exit(self, error: EngineDeadError | None) -> None:
        """The core is gone (or given up on): fail what waits on it, close the sockets, tell on_exit."""
        if error is not None:
            logger.error("%s", error)
        self._fail_calls(error or EngineDeadError("the engine shut down"))
        self._close()
        self.exited.set()
        self._on_exit(error)

    def _dispatch(self, message) -> None:
        if isinstance(message, EngineCoreOutputs):
            for result in message.utility:
                future = self._pending_calls.get(result.call_id)
                if future is not None and not future.done():
                    if result.error is None:
                        future.set_result(result.result)
                    else:
                        future.set_exception(EngineInternalError(result.error))
            self._on_outputs(message)
        elif isinstance(message, EngineDead):
            self._dead_reason = message.reason
            self._dead_read()
        elif not isinstance(message, Heartbeat):
            logger.error("ignoring an unexpected %s from the engine", type(message).__name__)

    # -- helpers -----------------------------------------------------------------------------------

    def _dead_read(self) -> None:
        """A core that sent EngineDead waits for this before it exits, so its reason never trails its exit."""
        with contextlib.suppress(EngineDeadError):
            self._post(EngineDeadRead())

    def _exit_was_clean(self) -> bool:
        return self._kill_reason is None and (self.process is None or self.process.exitcode == 0)

    def _describe_exit(self) -> str:
        if self.process is None:
            what = (f"the front end gave up on the engine thread: {self._kill_reason}" if self._kill_reason
                    else "the engine thread stopped")
        else:
            code = self.process.exitcode
            if code == -signal.SIGKILL and self._kill_reason:
                what = f"the engine process {self.process.pid} was killed by the front end: {self._kill_reason}"
            elif code is not None and code < 0:
                name = signal.Signals(-code).name
                hint = " (out of memory?)" if -code == signal.SIGKILL else ""
                what = f"the engine process {self.process.pid} was killed by {name}{hint}"
            else:
                what = f"the engine process {self.process.pid} exited with code {code}"
        return f"{what}: {self._dead_reason}" if self._dead_reason else what

    async def _reap(self) -> None:
        if self.process is not None:
            await asyncio.to_thread(self.process.join, 10)
        elif self.thread is not None and self._kill_reason is None:   # an abandoned thread is not waited for
            await asyncio.to_thread(self.thread.join, 10)

    def _kill(self, why: str) -> None:
        """SIGKILL the engine process (a thread cannot be: it is abandoned); `why` is what its exit is
        described by (not the OOM killer's guess)."""
        if self.alive:
            self._kill_reason = self._kill_reason or why
            if self.process is not None:
                self.process.kill()

    def _fail_calls(self, error: BaseException) -> None:
        for future in self._pending_calls.values():
            if not future.done():
                future.set_exception(error)

    def _close(self) -> None:
        self._recv.close()
        self._send_sock.close()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
