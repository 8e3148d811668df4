"""One real server (tiny random Gemma 4, real engine) shared by this directory's end-to-end tests."""

from __future__ import annotations

import pytest
from rel_engine import ServerThread, engine_config


@pytest.fixture(scope="session")
def rel_server(tiny_checkpoint) -> ServerThread:
    server = ServerThread(engine_config(tiny_checkpoint, max_waiting_requests=512)).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def small_server(tiny_checkpoint) -> ServerThread:
    """Two running requests at most and three waiting: queues and step membership are easy to steer."""
    server = ServerThread(engine_config(tiny_checkpoint, max_num_seqs=2, max_waiting_requests=3)).start()
    yield server
    server.stop()
