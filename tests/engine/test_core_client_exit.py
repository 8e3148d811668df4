"""The front end's core client reads what a dying core sent last, however the exit and the message race.

A core that fails sends EngineDead (why) and exits. Since the engine process ends with os._exit
(mmserve/process_exit.py) the exit follows the send within milliseconds, so the message can land
after the client's poll came back empty and before it checks that the core is alive: it must still be
read, and the error must carry the core's reason, not only an exit code (a CI run saw "the engine
process exited with code 1 while starting" for a lost tensor-parallel rank that the core had named).
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq

from mmserve.config import EngineConfig
from mmserve.engine.core_client import CoreClient
from mmserve.errors import EngineDeadError
from mmserve.ipc import serial
from mmserve.ipc.protocol import EngineDead

REASON = "the engine failed to start: tensor-parallel rank 1 (node 1, pid 4242, exit code -9) died"


def test_a_reason_sent_as_the_core_exits_is_read_before_the_exit_is_reported(monkeypatch):
    """The race made certain: the core thread does nothing and ends; the liveness check itself, on
    its first call, delivers the core's EngineDead through a real zmq socket, then reports the core gone."""
    def silent_core(config, addresses, **_):
        pass   # ends at once, sending nothing: the message comes from the liveness check below

    monkeypatch.setattr("mmserve.core.process.run_core", silent_core)
    sent = threading.Event()
    really_alive = CoreClient.alive.fget

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
