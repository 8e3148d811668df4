"""The engine side of the process boundary: EngineCore's step loop behind two zmq sockets.

`run_engine_process` is the spawned process's entry (importable, so spawn needs no `__main__`
tricks): it sets the one torch pool, loads the model, measures the device peaks, sends `EngineReady`
and runs `CoreLoop` on its main thread, the only thread that ever runs torch here. The same loop can
run on a thread of the server process instead (`run_core`; --no-engine-process, or a preloaded model).

Each iteration drains every queued message (adds, aborts, utility calls), runs one step and hands
one `EngineCoreOutputs` to the output thread (`OutputSender`), which pickles and sends it while the
next step runs; an iteration that finds the loop silent for `HEARTBEAT_S` sends a `Heartbeat`, from
the loop's own thread, so a wedged loop falls silent and the front end kills it
(--engine-stall-timeout-s). Nothing here is per-request Python beyond the core itself.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable

import zmq

from mmserve.config import EngineConfig
from mmserve.errors import EngineInternalError, EngineUnavailableError, MMServeError
from mmserve.ipc import serial
from mmserve.ipc.protocol import (
    AbortRequests,
    AddRequest,
    CoreAddresses,
    CoreOutput,
    EngineDead,
    EngineDeadRead,
    EngineReady,
    ExtendRequest,
    Heartbeat,
    Shutdown,
    UtilityCall,
    UtilityResult,
)
from mmserve.process_exit import exit_process, watch_parent

logger = logging.getLogger(__name__)

UTILITIES = frozenset({"held_resources", "flush_prefix_cache", "set_kv_events"})   # core methods the front end may call by name
IDLE_POLL_MS = 500    # how long an idle core sleeps between liveness checks of its parent
BLOCKED_POLL_MS = 1   # requests in flight but nothing schedulable: do not busy-loop
LINGER_MS = 4000      # let the last outputs (or the death message) reach the front end on exit
DEAD_READ_WAIT_S = 60.0   # a front end that has not read the core's EngineDead by then has stopped reading
HEARTBEAT_S = 1.0   # the longest the loop stays silent while it turns: the front end's stall watch hears it


def run_engine_process(config: EngineConfig, addresses: CoreAddresses, log_level: int, log_format: str = "text") -> None:
    """The spawned engine process's main. It logs to the stderr it shares with the front end, in the
    front end's format (`--log-format`), so a JSON log stream stays one JSON object per line."""
    # Ctrl-C, and a supervisor's SIGTERM to the whole process group (systemd's control-group kill,
    # supervisord's killasgroup, `kill %job`), reach the engine too: the front end decides when it
    # stops (after its drain, killing it past its shutdown timeout); orphaned, it exits by itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    watch_parent(parent)   # the loop checks its parent once a turn; this also ends one wedged in a step
    if log_format == "json":
        from mmserve.logs import configure_logging

        configure_logging(logging.getLevelName(log_level), "json")
    else:
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s engine[%(process)d] %(name)s: %(message)s")
    from mmserve.executor.ranks import rank_threads
    from mmserve.worker.cpu_threads import configure_torch_threads

    threads = configure_torch_threads(rank_threads(config))   # tensor-parallel ranks share the node's cores
    code = run_core(config, addresses, torch_threads=threads, parent_alive=lambda: os.getppid() == parent,
                    log_format=log_format)
    # run_core closed the sockets (after their linger), the tensor-parallel ranks and their shared
    # memory: skip the interpreter's second of module teardown (mmserve/process_exit.py)
    exit_process(code)


def run_core(config: EngineConfig, addresses: CoreAddresses, *, model=None, torch_threads: int = 0,
             parent_alive: Callable[[], bool] = lambda: True, started: Callable | None = None,
             log_format: str = "text") -> int:
    """Connect, build the core, send READY (or why not), serve until Shutdown. Returns the exit code."""
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    outputs = ctx.socket(zmq.PUSH)
    for sock in (inputs, outputs):
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.SNDHWM, 0)   # never drop; back-pressure is memory
        sock.setsockopt(zmq.RCVHWM, 0)
    inputs.bind(addresses.inputs)
    outputs.connect(addresses.outputs)
    tp = None
    try:
        try:
            if config.tensor_parallel_size > 1 or config.nnodes > 1:
                if model is not None:
                    raise ValueError("a preloaded model is one device's: tensor_parallel_size must be 1")
                from mmserve.executor.tensor_parallel import TensorParallelGroup

                tp = TensorParallelGroup(config, logging.getLogger().getEffectiveLevel(), log_format,
                                         private_dir=addresses.private_dir)
            core, ready = _start(config, model, torch_threads, tp)
        except BaseException as exc:
            logger.exception("engine failed to start")
            _say_dead(inputs, outputs, f"the engine failed to start: {exc!r}", parent_alive)
            return 1
        if started is not None:
            started(core)
        outputs.send_multipart(serial.encode(ready))
        sender = OutputSender(outputs)
        try:
            CoreLoop(core, inputs, sender, parent_alive, tp.check_alive if tp is not None else None).run()
        except BaseException as exc:
            logger.exception("engine loop died")
            sender.close()
            _say_dead(inputs, outputs, f"the engine loop failed: {exc!r}", parent_alive)
            return 1
        finally:
            sender.close()
        return 0
    finally:
        if tp is not None:
            tp.close()
        inputs.close()
        outputs.close()
        ctx.term()


def _say_dead(inputs: zmq.Socket, outputs: zmq.Socket, reason: str, parent_alive: Callable[[], bool]) -> None:
    """Send why the core fails, then wait until the front end has read it (EngineDeadRead), asks it
    to stop (Shutdown: it no longer waits for the reason) or is gone. A core that exited at once
    raced its own message: on a loaded machine the front end saw the exit first and reported only an
    exit code ("exited with code 1 while starting")."""
    outputs.send_multipart(serial.encode(EngineDead(reason)))
    deadline = time.monotonic() + DEAD_READ_WAIT_S
    while parent_alive() and time.monotonic() < deadline:
        if inputs.poll(IDLE_POLL_MS) and isinstance(serial.decode(inputs.recv_multipart(copy=False)),
                                                    (EngineDeadRead, Shutdown)):
            return


def _start(config: EngineConfig, model, torch_threads: int, tp=None):
    """The core (with `tp`, a TensorParallelGroup: over rank 0's shard, its runner broadcasting each
    step) and the READY message."""
    from pathlib import Path

    import torch

    from mmserve.core.engine_core import EngineCore

    if tp is None:
        core = EngineCore(config, model=model)
    else:
        from mmserve.executor.ranks import load_rank_model
        from mmserve.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(config.model) if (Path(config.model) / "tokenizer.json").is_file() else None
        core = EngineCore(config, model=load_rank_model(config, tp.group), tokenizer=tokenizer,
                          runner_factory=tp.runner_factory)
        if core.speculator is not None:
            tp.runner.serve_drafts(core.speculator)
    spec = core.model.spec
    ready = EngineReady(
        model_name=Path(config.model).name, backend=core.model.attention_backend,
        dtype=config.dtype, max_model_len=core.max_model_len, tokens_per_frame=spec.video_max_soft_tokens,
        eos_token_ids=tuple(sorted(core.eos_token_ids)),
        kv_pool_blocks={name: pool.num_usable for name, pool in core.kv.pools.items()},
        max_num_seqs=core.config.max_num_seqs, peaks=core.peaks,
        torch_threads=torch_threads or torch.get_num_threads(), pid=os.getpid(),
        backend_checks=tuple(core.runner.backend_checks), kv_capacity=core.kv_capacity)
    return core, ready


class OutputSender:
    """Serialises and sends the core's outputs on a thread of its own, so pickling a step's outputs
    and zmq's send overlap the next step instead of delaying it. The socket is this thread's alone
    while it runs; `close()` sends what is queued, in order, and stops it (idempotent). An output
    that cannot be sent stops the thread, and the next `send` raises why: the loop then dies as it
    did when it sent on its own thread, and the front end fails every request (never a silent hang)."""

    _STOP = object()

    def __init__(self, socket: zmq.Socket):
        self.socket = socket
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="mmserve-core-output", daemon=True)
        self._thread.start()

    def send(self, message) -> None:
        if self.error is not None:
            raise EngineInternalError(f"the output thread failed: {self.error!r}") from self.error
        self._queue.put(message)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(self._STOP)
            self._thread.join()

    def _run(self) -> None:
        while (message := self._queue.get()) is not self._STOP:
            try:
                self.socket.send_multipart(serial.encode(message), copy=False)
            except BaseException as exc:
                logger.exception("could not send a %s to the front end", type(message).__name__)
                self.error = exc
                return


class CoreLoop:
    def __init__(self, core, inputs: zmq.Socket, outputs: OutputSender, parent_alive: Callable[[], bool],
                 check_ranks: Callable[[], None] | None = None):
        self.core = core
        self.check_ranks = check_ranks   # raises when a tensor-parallel worker rank is gone
        self.inputs = inputs
        self.outputs = outputs
        self.parent_alive = parent_alive
        self.poller = zmq.Poller()
        self.poller.register(inputs, zmq.POLLIN)
        self._refused: list[CoreOutput] = []
        self._utility: list[UtilityResult] = []
        self._stopping = False
        self._last_sent = time.monotonic()

    def run(self) -> None:
        core = self.core
        while True:
            if not self.parent_alive():   # one getppid() per iteration: an orphaned core stops even mid-work
                logger.error("the front end process is gone; the engine exits")
                return
            if self.check_ranks is not None:
                self.check_ranks()
            if time.monotonic() - self._last_sent >= HEARTBEAT_S:
                self._send(Heartbeat())
            if not core.has_work:
                timeout = IDLE_POLL_MS
            else:
                timeout = BLOCKED_POLL_MS if core.idle_step else 0
            if self.poller.poll(timeout):
                self._drain()
            if self._stopping:
                self._send_shutdown()
                return
            if not (core.has_work or self._refused or self._utility):
                continue
            result = core.step()
            result.outputs[:0], self._refused = self._refused, []
            result.utility, self._utility = self._utility, []
            if not result.is_empty:
                self._send(result)

    def _send(self, message) -> None:
        self.outputs.send(message)
        self._last_sent = time.monotonic()

    def _drain(self) -> None:
        """Handle every message already queued (several adds and aborts per step, in order)."""
        while True:
            try:
                frames = self.inputs.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(serial.decode(frames))

    def _handle(self, message) -> None:
        if isinstance(message, AddRequest):
            rid = message.request.request_id
            try:
                self.core.add_request(message.request)
            except MMServeError as exc:      # admission refused: it goes back as this request's error
                self._refused.append(CoreOutput(rid, error=exc))
            except Exception as exc:
                logger.exception("request %s: admission failed", rid)
                self._refused.append(CoreOutput(rid, error=EngineInternalError(f"request {rid}: admission failed: {exc!r}")))
        elif isinstance(message, ExtendRequest):
            self.core.extend_request(message, self._refused)
        elif isinstance(message, AbortRequests):
            for rid in message.request_ids:
                self.core.abort(rid)
        elif isinstance(message, UtilityCall):
            self._utility.append(self._call(message))
        elif isinstance(message, Shutdown):
            self._stopping = True
        else:
            logger.error("ignoring an unknown message %r", type(message).__name__)

    def _call(self, call: UtilityCall) -> UtilityResult:
        if call.method not in UTILITIES:
            return UtilityResult(call.call_id, error=f"{call.method!r} is not a utility of the engine core")
        try:
            return UtilityResult(call.call_id, getattr(self.core, call.method)(*call.args))
        except Exception as exc:
            return UtilityResult(call.call_id, error=repr(exc))

    def _send_shutdown(self) -> None:
        result = self.core.shutdown(EngineUnavailableError("the engine shut down"))
        result.outputs[:0], self._refused = self._refused, []
        result.utility, self._utility = self._utility, []
        self._send(result)
