"""The front end's core client reads what a dying core sent last, however the exit and the message race.

A core that fails sends EngineDead (why) and, once the client has read it (EngineDeadRead), exits.
Exiting at once, as it did, let the exit be seen before the message arrived, by more than any fixed
wait on a loaded machine: the error then carried only an exit code (a CI run saw "the engine process
exited with code 1 while starting" for a lost tensor-parallel rank that the core had named). The
client still reads a message that lands after an empty poll and before its liveness check.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import sys
import threading

import pytest
import zmq

from mmserve.config import EngineConfig
from mmserve.core.process import run_core
from mmserve.engine.core_client import CoreClient
from mmserve.errors import EngineDeadError
from mmserve.ipc import serial
from mmserve.ipc.protocol import CoreAddresses, EngineDead, EngineDeadRead

REASON = "the engine failed to start: tensor-parallel rank 1 (node 1, pid 4242, exit code -9) died"


def test_a_reason_sent_as_the_core_exits_is_read_before_the_exit_is_reported(monkeypatch):
    """The race made certain: the core thread does nothing and ends; the liveness check itself, on
    its first call, delivers the core's EngineDead through a real zmq socket, then reports the core gone."""
    def silent_core(config, addresses, **_):
        pass   # ends at once, sending nothing: the message comes from the liveness check below

    monkeypatch.setattr("mmserve.core.process.run_core", silent_core)
    sent = threading.Event()
    really_alive = CoreClient.alive.fget
    # bound before the patch: a session server's client in this process reads `alive` on its own
    # thread at any time, and an unbound `ours` killed that server's output handler (NameError)
    ours: CoreClient | None = None

    def alive_then_sends(client: CoreClient) -> bool:
        if client is not ours:   # another test's client in this process (a session server) is left alone
            return really_alive(client)
        if not sent.is_set():
            sent.set()
            push = zmq.Context.instance().socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(client.addresses.outputs)
            push.send_multipart(serial.encode(EngineDead(REASON)))
            push.close()   # lingers until delivered, as the core's context does before it exits
        return False

    monkeypatch.setattr(CoreClient, "alive", property(alive_then_sends))
    client = ours = CoreClient(EngineConfig(engine_process=False), on_outputs=lambda out: None,
                               on_exit=lambda err: None)

    async def start():
        with pytest.raises(EngineDeadError) as error:
            await client.start()
        await client.shutdown()   # the failed start's sockets and socket directory
        return error.value

    error = asyncio.run(start())
    assert sent.is_set() and REASON in str(error), error
    assert not client._dir.exists()


def test_a_core_that_fails_to_start_exits_only_once_its_reason_is_read(tiny_checkpoint, tmp_path):
    """A real core refusing its start (the tiny checkpoint's vocabulary of 320 does not split 3
    ways), on a thread, with the client's ends as plain zmq sockets: it is still there after its
    EngineDead was read, however long the reader waits, and ends once told it was read."""
    addresses = CoreAddresses(f"ipc://{tmp_path}/inputs", f"ipc://{tmp_path}/outputs")
    ctx = zmq.Context()
    received, to_core = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    received.bind(addresses.outputs)
    to_core.connect(addresses.inputs)
    config = EngineConfig(model=str(tiny_checkpoint), device="cpu", tensor_parallel_size=3)
    core = threading.Thread(target=run_core, args=(config, addresses), daemon=True)
    core.start()
    try:
        assert received.poll(120_000), "the core sent nothing"
        said = serial.decode(received.recv_multipart())
        assert isinstance(said, EngineDead) and "vocab_size (320) is not divisible" in said.reason, said
        core.join(1.0)
        assert core.is_alive(), "the core exited before its reason was known to be read"
        to_core.send_multipart(serial.encode(EngineDeadRead()))
        core.join(30)
        assert not core.is_alive()
    finally:
        if core.is_alive():   # a failed run must not leave it waiting
            to_core.send_multipart(serial.encode(EngineDeadRead()))
            core.join(30)
        received.close(linger=0)
        to_core.close(linger=0)
        ctx.term()


def test_a_shutdown_that_timed_out_is_described_as_the_front_ends_kill(tiny_checkpoint):
    """A real engine process that does not exit when asked (stopped): the client kills it after its
    timeout, and the exit it reports says so, not "killed by SIGKILL (out of memory?)"."""
    errors = []

    async def wedge_and_shut_down():
        client = CoreClient(EngineConfig(model=str(tiny_checkpoint), device="cpu"), on_outputs=lambda out: None,
                            on_exit=errors.append)
        ready = await client.start()
        os.kill(ready.pid, signal.SIGSTOP)
        try:
            await client.shutdown(timeout_s=0.5)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(ready.pid, signal.SIGCONT)

    asyncio.run(wedge_and_shut_down())
    assert len(errors) == 1 and isinstance(errors[0], EngineDeadError), errors
    assert "killed by the front end: it did not exit within 0.5s of the shutdown request" in str(errors[0]), errors
    assert "out of memory" not in str(errors[0])


WEDGED_ENGINE = """
import sys, threading
from mmserve.config import EngineConfig
from mmserve.core import process

def wedged_core(*args, **kwargs):   # fault injection: the core loop never turns again (a hung step)
    print("wedged", flush=True)
    threading.Event().wait()

process.run_core = wedged_core
process.run_engine_process(EngineConfig(device="cpu"), None, 30)
"""

FRONT_END_THAT_DIES = """
import subprocess, sys
engine = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True)   # no pipe of the test outlives this process
assert engine.stdout.readline() == "wedged\\n"
print(engine.pid, flush=True)   # and exit, leaving the engine orphaned in its wedged step
"""


def test_an_engine_process_wedged_in_a_step_exits_once_its_front_end_is_gone():
    """The engine process ignores SIGTERM (the front end decides when it stops) and its loop checks
    its parent once a turn: one wedged in a step outlived a dead front end until SIGKILLed. Its
    parent watch ends it as the tensor-parallel ranks' does."""
    front_end = subprocess.run([sys.executable, "-c", FRONT_END_THAT_DIES, WEDGED_ENGINE], capture_output=True,
                               text=True, timeout=120, check=True)
    pid = int(front_end.stdout)
    with contextlib.suppress(ProcessLookupError):
        watch = os.pidfd_open(pid)   # readable once the process has exited (reaped by init or not)
        try:
            exited = bool(select.select([watch], [], [], 10)[0])
            if not exited:
                os.kill(pid, signal.SIGKILL)   # the process this test started: do not leave it behind
            assert exited, "the orphaned engine process is still running"
        finally:
            os.close(watch)
