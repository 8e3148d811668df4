"""`mmserve serve --openai-port N`: one command gives both doors. The real SMG binary (the pinned `smg`
wheel) starts beside the server once it is ready, answers OpenAI chat completions as `mmserve.v1`
answers the same request (greedy), and stops with the server. The server binds a loopback address other
than 127.0.0.1, as a replica given one interface's address does, so SMG must be pointed at that address
(it listens on no other). Configurations where its HTTP side would bypass the server's API keys or TLS
are refused before anything starts."""

from __future__ import annotations

import socket
import time

import pytest
from smg_harness import DeadPort, Replica, free_port

from mmserve.clients import Client
from mmserve.config import ServerConfig
from mmserve.server.openai_gateway import refusal, replica_address

pytestmark = pytest.mark.timeout(600)

# Linux routes all of 127.0.0.0/8 to the loopback interface: an address of this machine's that is not
# 127.0.0.1, so a gateway sent to 127.0.0.1 finds nothing there.
ONE_INTERFACE = "127.0.0.2"


def test_both_doors_from_one_command():
    import openai

    port, dead = free_port(), DeadPort()
    replica = Replica("--openai-port", str(port), env={"HF_ENDPOINT": dead.url}, host=ONE_INTERFACE)
    try:
        deadline = time.monotonic() + 300
        while "OpenAI endpoint (SMG) at" not in replica.log:
            assert replica.alive() and time.monotonic() < deadline, replica.log[-4000:]
            time.sleep(0.2)
        http = openai.OpenAI(base_url=f"http://{ONE_INTERFACE}:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        (model,) = [m.id for m in http.models.list().data]
        reply = http.chat.completions.create(model=model, temperature=0, max_tokens=8,
                                             messages=[{"role": "user", "content": "Say something."}])
        with Client(replica.address, timeout=120) as client:
            ours = client.generate(prompt="Say something.", max_tokens=8, temperature=0)
        assert reply.choices[0].message.content == ours.text and ours.text
        replica.stop(timeout_s=30)
        assert replica.proc.returncode == 0, replica.log[-4000:]
        with socket.socket() as s:   # SMG went with the server
            assert s.connect_ex((ONE_INTERFACE, port)) != 0
    finally:
        replica.stop()
        dead.close()


def test_refused_where_the_http_side_would_bypass_keys_or_tls():
    plain = ServerConfig(port=50051, openai_port=8000)
    assert refusal(plain, api_keys=False) is None
    assert refusal(ServerConfig(port=50051), api_keys=True) is None   # off: nothing to refuse
    assert "API keys or TLS" in refusal(plain, api_keys=True)
    assert "API keys or TLS" in refusal(ServerConfig(port=50051, openai_port=8000, tls_cert="c.pem"), api_keys=False)
    assert "--port too" in refusal(ServerConfig(port=8000, openai_port=8000), api_keys=False)


def test_the_gateway_reaches_a_replica_on_every_interface_through_loopback():
    """A wildcard --host listens on loopback too; a specific one is the only address (the test above)."""
    for wildcard in ("0.0.0.0", "[::]", "::"):
        assert replica_address(wildcard, 50051) == "127.0.0.1:50051"
    assert replica_address("10.0.0.5", 50051) == "10.0.0.5:50051"
