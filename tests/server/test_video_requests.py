"""Video as people send it, end to end on one real server (demo model, loopback): a phone's
rotated clip answers as the upright one, a clip window and the frames reported in the Final,
animations as videos, and honest latency (TTFT from arrival, decoding included; the warm-up in no
metric)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from loopback_server import LoopbackServer, engine_config
from media_clips import animation, encode, sideways

from mmserve.clients import Client, ClientError
from mmserve.config import ServerConfig
from mmserve.metrics.perf_model import PerfModel
from mmserve.metrics.prometheus import EngineMetrics
from mmserve.metrics.telemetry import TelemetryObserver
from mmserve.metrics.tracing import get_tracer
from mmserve.model.spec import load_spec
from mmserve.multimodal.synthetic import make_clip

GREEDY = dict(prompt="Describe the video.", max_tokens=12, temperature=0)
TTFT_COUNT = "mmserve_time_to_first_token_seconds_count"
TTFT_SUM = "mmserve_time_to_first_token_seconds_sum"
QUEUE_SUM = "mmserve_request_queue_time_seconds_sum"
PREPROCESS_COUNT = "mmserve_request_preprocess_time_seconds_count"
PREPROCESS_SUM = "mmserve_request_preprocess_time_seconds_sum"


@pytest.fixture(scope="module")
def served(served_model):
    metrics = EngineMetrics(prometheus=True)
    observer = TelemetryObserver(PerfModel(load_spec(served_model), dtype="float32"), tracer=get_tracer(),
                                 metrics=metrics)
    server = LoopbackServer(engine_config(served_model), ServerConfig(port=0, worker_threads=2, drain_grace_s=5.0),
                            observer=observer, metrics=metrics).start()
    # Ready means warmed up: the warm-up request ran, and must not be in the histogram.
    at_start = metrics.registry.get_sample_value(TTFT_COUNT) or 0.0
    try:
        yield server, metrics, at_start
    finally:
        server.stop()
        metrics.shutdown()


@pytest.fixture(scope="module")
def client(served):
    with Client(served[0].address, timeout=120) as c:
        yield c


@pytest.mark.parametrize("seed", [5, 11])
def test_rotated_clip_answers_as_the_upright_one(client, seed):
    """The demo model captions motion, so a sideways clip reads as another motion: the phone's
    rotated recording (display matrix) must give the upright clip's answer, token for token."""
    upright = make_clip(seed, num_frames=4).frames
    want = client.generate(video=encode(upright, fps=2), num_frames=4, **GREEDY)
    for rotation in (90, 270):
        stored = sideways(upright, rotation)
        got = client.generate(video=encode(stored, fps=2, rotation=rotation), num_frames=4, **GREEDY)
        assert got.token_ids == want.token_ids, rotation
    unturned = client.generate(video=encode(sideways(upright, 90), fps=2), num_frames=4, **GREEDY)
    assert unturned.token_ids != want.token_ids  # the control: orientation does change the answer


def test_final_reports_the_frames_of_a_window(client):
    """A window samples inside itself only; the Final says which frames, at absolute times."""
    data = encode(make_clip(3, num_frames=8).frames * 3, fps=2)  # 24 frames, 12 s
    result = client.generate(video=data, num_frames=4, start_s=6, end_s=10, **GREEDY)
    (video,) = result.videos
    assert video.part == "messages[0].parts[0]" and video.duration_s == pytest.approx(12.0)
    assert video.num_frames == result.usage.num_frames == 4
    assert video.timestamps_s == pytest.approx((6.0, 7.0, 8.0, 9.0))
    whole = client.generate(video=data, fps=0.5, **GREEDY)  # 12 s at 0.5 fps: 6 frames, 2 s apart
    assert whole.videos[0].timestamps_s == pytest.approx((0.0, 2.0, 4.0, 6.0, 8.0, 10.0))
    one = client.generate(video=encode(make_clip(3).frames[:1]), num_frames=20, **GREEDY)
    assert one.videos[0].timestamps_s == (0.0,) and one.usage.num_frames == 1


def test_two_windows_of_one_file_are_not_confused(client):
    """Windows with identical pixels at other times are other prompts (the timestamps differ), so
    the prefix cache serves the second only up to where they part."""
    frames = make_clip(7, num_frames=4).frames
    data = encode(frames * 2, fps=2)  # the same 2 s twice
    first = client.generate(video=data, num_frames=4, end_s=2, **GREEDY)
    again = client.generate(video=data, num_frames=4, end_s=2, **GREEDY)
    later = client.generate(video=data, num_frames=4, start_s=2, **GREEDY)
    assert later.videos[0].timestamps_s == pytest.approx((2.0, 2.5, 3.0, 3.5))
    assert again.usage.cached_tokens > later.usage.cached_tokens
    assert first.usage.prompt_tokens == later.usage.prompt_tokens


@pytest.mark.parametrize("window,field,words", [
    (dict(start_s=3, end_s=2), "messages[0].parts[0].video.end_s", "at or before it starts"),
    (dict(start_s=30), "messages[0].parts[0].video", "start_s 30 is at or past the end of the video"),
    (dict(start_s=1, end_s=30), "messages[0].parts[0].video", "end_s 30 is past the end of the video"),
])
def test_bad_window_is_invalid_argument(client, window, field, words):
    with pytest.raises(ClientError) as e:
        client.generate(video=make_clip(1).data, **window, **GREEDY)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.field == field and words in e.value.message


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_animation_sent_as_a_video(client, fmt):
    frames = make_clip(9, num_frames=4).frames
    result = client.generate(video=animation(frames, [500] * 4, fmt), num_frames=4, **GREEDY)
    assert result.videos[0].timestamps_s == pytest.approx((0.0, 0.5, 1.0, 1.5))
    assert result.token_ids == client.generate(video=encode(frames, fps=2), num_frames=4, **GREEDY).token_ids


def test_ttft_counts_from_arrival_with_decoding(served, client):
    """Timings start when the request arrives, before its video is decoded: TTFT and queue time
    include preprocess_s, and the Prometheus histograms record the same TTFT, queue time and
    preprocess time (one more sample each; a text-only request adds no preprocess sample)."""
    _, metrics, _ = served
    big = encode([np.random.default_rng(0).integers(0, 256, (360, 640, 3), dtype=np.uint8)] * 16, fps=8)

    def value(name: str) -> float:
        return metrics.registry.get_sample_value(name) or 0.0

    preprocessed, preprocess_total = value(PREPROCESS_COUNT), value(PREPROCESS_SUM)
    client.generate(prompt="no media here", max_tokens=1)
    count, total, queued = value(TTFT_COUNT), value(TTFT_SUM), value(QUEUE_SUM)
    result = client.generate(video=big, num_frames=8, **GREEDY)
    timings = result.timings
    assert timings.preprocess_s > 0
    assert timings.time_to_first_token_s >= timings.queue_s >= timings.preprocess_s
    assert timings.end_to_end_s >= timings.time_to_first_token_s
    assert metrics.registry.get_sample_value(TTFT_COUNT) == count + 1
    recorded = metrics.registry.get_sample_value(TTFT_SUM) - total
    assert recorded >= timings.preprocess_s
    assert recorded == pytest.approx(timings.time_to_first_token_s, abs=0.05)
    assert value(QUEUE_SUM) - queued == pytest.approx(timings.queue_s, abs=0.05)
    assert value(PREPROCESS_COUNT) == preprocessed + 1
    assert value(PREPROCESS_SUM) - preprocess_total == pytest.approx(timings.preprocess_s, rel=1e-6)


def test_the_warm_up_request_is_in_no_metric(served):
    """The server is ready only after its warm-up request ran; no TTFT was recorded for it."""
    assert served[2] == 0
