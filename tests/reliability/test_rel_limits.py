"""Each configured limit, hit once on a real server: the status code, and a message that names the
limit and the flag that raises it (see docs/security.md). `rel_server` runs with small limits."""

from __future__ import annotations

import asyncio
import secrets

import grpc
import pytest
from rel_engine import read_stream

from mmserve.api.mmserve.v1 import generation_pb2 as pb
from mmserve.api.mmserve.v1 import generation_pb2_grpc as pb_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _req(*parts: pb.Part, **sampling) -> pb.GenerateRequest:
    sampling.setdefault("max_tokens", 2)
    return pb.GenerateRequest(messages=[pb.Message(role="user", parts=[pb.Part(text="look"), *parts])],
                              sampling=pb.SamplingParams(**sampling))


def _video(data: bytes, num_frames: int = 0) -> pb.Part:
    return pb.Part(video=pb.Video(data=data, num_frames=num_frames))


def _cases(cfg, make_video) -> dict[str, tuple[pb.GenerateRequest, grpc.StatusCode, list[str]]]:
    clip = make_video(seed=5, num_frames=4)
    mp4_head = clip[:64]
    return {
        "message size": (_req(_video(secrets.token_bytes(4 * 2**20 + 2**19))), INVALID,
                         [f"limit of {4 * 2**20} bytes", "--max-message-bytes"]),
        "video bytes": (_req(_video(mp4_head + secrets.token_bytes(2**20))), INVALID,
                        [f"limit of {2**20}", "--max-video-bytes"]),
        "frames per video": (_req(_video(clip, num_frames=cfg.max_frames_per_video + 1)), INVALID,
                             [f"at most {cfg.max_frames_per_video}", "--max-frames-per-video"]),
        "frames per request": (_req(_video(clip, 4), _video(clip, 3)), INVALID,
                               ["7 video frames", f"at most {cfg.max_frames_per_request}", "--max-frames-per-request"]),
        "resolution": (_req(_video(make_video(seed=6, num_frames=2, size=64))), INVALID,
                       ["64x64", f"limit of {cfg.max_image_pixels}", "--max-image-pixels"]),
        "duration": (_req(_video(make_video(seed=7, num_frames=3, fps=0.25))), INVALID,
                     ["longer than the limit of 10 s", "--max-video-duration-s"]),
        "context length": (_req(max_tokens=1020), INVALID, ["context length 1024"]),
        "max_tokens": (_req(max_tokens=cfg.max_tokens_limit + 1), INVALID,
                       [f"limit {cfg.max_tokens_limit}", "--max-tokens-limit"]),
        "stop strings": (_req(stop=["x"] * (cfg.max_stop_strings + 1)), INVALID,
                         [f"at most {cfg.max_stop_strings}", "--max-stop-strings"]),
        "stop string length": (_req(stop=["y" * 257]), INVALID, ["sampling.stop[0]", "256 characters"]),
    }


@pytest.fixture(scope="module")
def outcomes(rel_server, make_video):
    cases = _cases(rel_server.engine_config, make_video)

    async def scenario():
        options = [("grpc.max_send_message_length", 16 * 2**20)]
        async with grpc.aio.insecure_channel(rel_server.address, options=options) as ch:
            stub = pb_grpc.GenerationStub(ch)
            return {name: await read_stream(stub.Generate(request, timeout=60)) for name, (request, _, _) in cases.items()}

    results = asyncio.run(scenario())
    rel_server.assert_nothing_leaked()
    return {name: (results[name], code, needles) for name, (_, code, needles) in cases.items()}


@pytest.mark.parametrize("limit", ["message size", "video bytes", "frames per video", "frames per request",
                                   "resolution", "duration", "context length", "max_tokens", "stop strings",
                                   "stop string length"])
def test_limit(outcomes, limit):
    result, code, needles = outcomes[limit]
    assert result.code == code, f"{limit}: {result.code} {result.details!r}"
    for needle in needles:
        assert needle in result.details, f"{limit}: {needle!r} not in {result.details!r}"
    assert not result.token_ids and result.final is None


def test_a_decode_time_limit_is_retryable_only_when_the_time_went_waiting_for_a_worker(monkeypatch):
    """Permanent when the decode itself ran out of time (resending would redo that work, and a gateway
    retries RESOURCE_EXHAUSTED); retryable when most of it went waiting for a worker (other requests'
    decodes). A fake clock: 10 s limits, the worker starting 1 s or 8 s after the request."""
    from mmserve.multimodal import decode_control
    from mmserve.server.status import map_error

    now = [100.0]
    monkeypatch.setattr(decode_control.time, "monotonic", lambda: now[0])

    def timed_out(start_after: float) -> Exception:
        control = decode_control.DecodeControl(10.0, label="messages[0].parts[1]")
        now[0] += start_after
        control.check()   # the worker starts
        now[0] += 10.0
        with pytest.raises(Exception) as e:
            control.check()
        return e.value

    decoding, queued = timed_out(1.0), timed_out(8.0)
    assert map_error(decoding).code == INVALID and "decoding took longer than 10s" in str(decoding)
    assert map_error(queued).code == grpc.StatusCode.RESOURCE_EXHAUSTED and queued.retryable
    assert "--video-decode-timeout-s" in str(queued) and "waited 8.0s" in str(queued)
