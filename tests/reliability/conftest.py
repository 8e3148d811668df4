"""Real servers (tiny random Gemma 4, real engine) shared by this directory's end-to-end tests.

`rel_server` has small media limits so each limit is cheap to hit; `small_server` has a tiny batch
and queue so admission and step membership are easy to steer."""

from __future__ import annotations

import pytest
from rel_engine import ServerThread, engine_config

from mmserve.config import ServerConfig


@pytest.fixture(scope="session")
def rel_server(tiny_checkpoint) -> ServerThread:
    engine = engine_config(tiny_checkpoint, max_waiting_requests=512, max_frames_per_video=4, max_frames_per_request=6,
                           max_image_pixels=48 * 48, max_video_duration_s=10.0, max_video_bytes=2**20)
    server = ServerThread(engine, ServerConfig(port=0, worker_threads=2, max_message_bytes=4 * 2**20)).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def small_server(tiny_checkpoint) -> ServerThread:
    """Two running requests at most and three waiting: queues and step membership are easy to steer.
    Its core runs on a thread of the test process, so a test can inject a fault into the runner."""
    server = ServerThread(engine_config(tiny_checkpoint, max_num_seqs=2, max_waiting_requests=3,
                                        engine_process=False)).start()
    yield server
    server.stop()
