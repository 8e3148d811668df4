"""The front end's RSS stays flat over repeated 720p video requests, and a refused large payload
does not stay resident (multimodal/memory.py: glibc's mmap threshold is pinned, so decoded frames
and payloads go back to the OS when freed, and no part of a finished request sits in a reference
cycle, so it is freed at once without any garbage collection on the request path). RSS is
measured on a real `mmserve serve` process: its own /proc RSS, not the test process's; the cycles
on the session's in-process server, with the collector off."""

from __future__ import annotations

import asyncio
import collections
import gc
import time
import types
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
from media_clips import encode
from rel_process import ServeProcess
from rel_server import stream_status
from test_rel_big_video import status_kib, wait_ready

import mmserve
from mmserve.api.mmserve.v1 import generation_pb2 as pb
from mmserve.api.mmserve.v1 import generation_pb2_grpc as pb_grpc
from mmserve.clients import Client, ClientError, user_message

REQUESTS = 20
# Measured when the fixes landed (2 cores, shared): with neither fix the floor of RSS rose ~120 MiB over
# 20 requests and its peaks ~200 MiB; with the mmap threshold pinned but the seeker's cycle left, peaks
# climbed ~20 MiB per request until a full collection (+240 MiB with gc off); with both, RSS stayed within
# ~45 MiB of its level after request 1, refusal included, and no collection on the request path; once,
# in a full suite run on a cold compile cache (no front-end change), 77 MiB. The floor: 0-20 MiB above
# request 1's level in runs of this test alone, 33 MiB once in a cold CI-like run (salt 15134).
# Stop 54, each fix undone on this tree (30 requests, then the refusal; figures of the first 20): neither
# fix, the floor 173 MiB up and peaks 242; the seeker's cycle alone, the floor 33 and peaks 111 (137
# after the refusal); the threshold unpinned alone, the floor 42 and peaks 68 (98 after the refusal:
# the peak budget only just fails it); both fixes, 13 and 45. So the floor tells only "neither fix"
# (173) from a correct server (33 at worst), and its budget sits between the two; the peak budget
# fails the seeker's cycle with room, the threshold alone barely (test_finished_and_refused_requests_
# leave_no_reference_cycles below is the cycles' own guard). A floor slope (requests 11-20 against
# 21-30) told nothing more: 317 -> 339 MiB with both fixes, 375 -> 373 and 348 -> 351 with one undone,
# 494 -> 553 with neither.
PEAK_BUDGET = 96 * 2**20
FLOOR_BUDGET = 80 * 2**20
ASK = dict(prompt="Describe the video.", num_frames=8, max_tokens=2, temperature=0)


@pytest.fixture(scope="module")
def clips() -> list[bytes]:
    """Two different 720p clips (1 s at 24 fps, ~11 MB each: noise does not compress)."""
    rng = np.random.default_rng(0)
    return [encode([rng.integers(0, 256, (720, 1280, 3), dtype=np.uint8) for _ in range(4)] * 6, fps=24,
                   codec="libx264", pix_fmt="yuv420p", options={"crf": "23", "preset": "ultrafast"})
            for _ in range(2)]


@pytest.mark.slow
def test_rss_is_flat_over_repeated_720p_requests(served_model, clips, tmp_path):
    server = ServeProcess("--port", "0", "--model", str(served_model), "--device", "cpu", "--worker-threads", "2",
                          "--media-dir", str(tmp_path / "media"), "--kv-cache-bytes", str(16 * 2**20),
                          "--max-video-bytes", str(16 * 2**20), "--engine-threads", "1")
    try:
        port = server.wait_port(300)
        wait_ready(port, server)
        pid = server.proc.pid
        rss = []
        with Client(f"127.0.0.1:{port}", timeout=300) as client:
            for i in range(REQUESTS):
                client.generate(video=clips[i % 2], **ASK)
                rss.append(status_kib(pid, "VmRSS"))
            payload = clips[0] + clips[1] + b"\0" * 2**20  # 24 MB inline (messages: the client would upload it)
            with pytest.raises(ClientError) as refused:  # over --max-video-bytes
                client.generate([user_message("Describe the video.", video=payload)], max_tokens=2)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            for i in range(4):
                client.generate(video=clips[i % 2], **ASK)
                rss.append(status_kib(pid, "VmRSS"))
        print("front-end RSS MiB per request:", [round(r / 2**20) for r in rss], "(the last 4 after the refusal)")
        floor = min(rss[REQUESTS - 8:REQUESTS])
        assert floor - rss[0] < FLOOR_BUDGET, f"the RSS floor rose {(floor - rss[0]) / 2**20:.0f} MiB in {REQUESTS} requests"
        peak = max(rss)
        assert peak - rss[0] < PEAK_BUDGET, f"RSS peaked {(peak - rss[0]) / 2**20:.0f} MiB above its level"
    finally:
        server.stop()


SERVER_CODE = str(Path(mmserve.__file__).parent)


def _request(video: bytes, num_frames: int = 2, **sampling) -> pb.GenerateRequest:
    parts = [pb.Part(text="Describe the video."), pb.Part(video=pb.Video(data=video, num_frames=num_frames))]
    return pb.GenerateRequest(request_id=f"cycles-{uuid.uuid4().hex[:8]}", messages=[pb.Message(role="user", parts=parts)],
                              sampling=pb.SamplingParams(max_tokens=sampling.pop("max_tokens", 2), **sampling))


def _server_garbage(scenario) -> collections.Counter:
    """What `scenario()` left in reference cycles of the server's code: requests, their errors,
    the frames those errors passed (grpc's own handler lookup leaves a few objects per call, none
    of ours). The collector is off meanwhile, so nothing is freed but by reference counting."""
    gc.collect()
    gc.disable()
    try:
        scenario()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        garbage, gc.garbage[:] = list(gc.garbage), []
    finally:
        gc.set_debug(0)
        gc.enable()
    ours = collections.Counter()
    for obj in garbage:
        if isinstance(obj, types.FrameType):
            if obj.f_code.co_filename.startswith(SERVER_CODE) and "/clients/" not in obj.f_code.co_filename:
                ours[f"frame {obj.f_code.co_name}"] += 1
        elif isinstance(obj, (pb.GenerateRequest, BaseException)) or type(obj).__module__.split(".")[0] == "av" or (
                type(obj).__module__.startswith("mmserve.") and not type(obj).__module__.startswith("mmserve.clients")):
            ours[type(obj).__qualname__] += 1
    return ours


def test_finished_and_refused_requests_leave_no_reference_cycles(mmserve_server):
    """Served, undecodable, over the frame limit, refused by validation, and an upload refused:
    each is freed by reference counting alone (the server no longer collects per request). The session's server has
    the interceptor chain of `mmserve serve` (per-RPC metrics included)."""
    rng = np.random.default_rng(5)  # 2 s, keyframes every 0.5 s: 2 frames sampled, the decode stops mid-stream
    video = encode([rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(48)], fps=24, gop=12)

    async def calls():
        async with grpc.aio.insecure_channel(mmserve_server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            assert (await stream_status(stub.Generate(_request(video))))[0] == grpc.StatusCode.OK
            code, details = await stream_status(stub.Generate(_request(video[: len(video) // 2])))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "video" in details
            code, details = await stream_status(stub.Generate(_request(video, num_frames=999)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "--max-frames-per-video" in details
            code, details = await stream_status(stub.Generate(_request(video, temperature=-1.0)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in details
            upload = [pb.UploadMediaRequest(metadata=pb.UploadMetadata(mime_type="video/mp4", size_bytes=len(video),
                                                                       sha256="0" * 64)),
                      pb.UploadMediaRequest(chunk=video)]   # bytes that do not match the declared sha256
            try:   # not pytest.raises: its ExceptionInfo and the error's traceback would be a cycle of the test's
                await stub.UploadMedia(iter(upload))
                code, details = grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as e:
                code, details = e.code(), e.details()
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "sha256" in details

    ours = _server_garbage(lambda: asyncio.run(calls()))
    assert not ours, f"left in reference cycles: {dict(ours)}"


def test_a_cancelled_request_leaves_no_reference_cycles(mmserve_server, make_video):
    video = make_video(seed=6, num_frames=4)

    async def cancelled():
        async with grpc.aio.insecure_channel(mmserve_server.address) as channel:
            call = pb_grpc.GenerationStub(channel).Generate(_request(video, max_tokens=400, ignore_eos=True))
            while not (await call.read()).delta.token_ids:
                pass
            call.cancel()

    async def handler_ended():
        """On the server's loop: the cancelled handler's last step (it leaves the registry there) is over."""
        deadline = time.monotonic() + 30
        while len(mmserve_server.app.in_flight) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return len(mmserve_server.app.in_flight)

    def scenario():
        asyncio.run(cancelled())
        assert asyncio.run_coroutine_threadsafe(handler_ended(), mmserve_server._loop).result(60) == 0

    ours = _server_garbage(scenario)
    assert not ours, f"left in reference cycles: {dict(ours)}"
