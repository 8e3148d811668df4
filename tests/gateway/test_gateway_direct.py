"""The VllmEngine door called directly (no gateway), on one in-process server.

Prompt logprobs and cached tokens as the proto carries them (with n, every sample the request's),
equal to mmserve.v1's; the frames each video sampled (trailing metadata), as mmserve.v1's
Final.videos reports them. Router-preprocessed
media: an image and a video sent as `mm_inputs`
(expanded ids + patchified pixels, as a gateway's own Gemma 4 processor sends them) give the same
prompt and greedy tokens as the same media sent by reference (`media_refs`); tensors that are not
our layout are refused naming the batch.

The "gateway side" here expands the prompt by the documented layout (docs/architecture.md, "Prompt
layout"), written out in this test, and patchifies with our decoder and preprocessing: SMG's own
processor cannot serve the demo checkpoint (it accepts only 70..1120 soft tokens per image)."""

from __future__ import annotations

import base64
import random
import string

import grpc
import pytest
from gateway_cases import mm_batch, png, turn
from loopback_server import LoopbackServer, engine_config
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from mmserve.clients import Client
from mmserve.clients.messages import image_part, message, text_part, video_part
from mmserve.config import DEMO_MODEL_DIR, ServerConfig
from mmserve.engine.types import RequestOutput, Usage
from mmserve.ipc.protocol import TokenLogprobs
from mmserve.model.prompt import timestamp_text
from mmserve.model.spec import load_spec
from mmserve.model.tokenizer import load_tokenizer
from mmserve.multimodal.image import decode_image
from mmserve.multimodal.limits import MediaLimits
from mmserve.multimodal.preprocess import preprocess_images
from mmserve.multimodal.video import decode_video
from mmserve.server.vllm_engine.outputs import VIDEO_FRAMES_KEY, SampleEnds

NUM_FRAMES = 4   # the test server's --default-num-frames


@pytest.fixture(scope="module")
def server():
    s = LoopbackServer(engine_config(DEMO_MODEL_DIR, default_num_frames=NUM_FRAMES),
                       ServerConfig(port=0, worker_threads=2)).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield vpb_grpc.VllmEngineStub(channel)


@pytest.fixture(scope="module")
def model():
    return load_tokenizer(DEMO_MODEL_DIR), load_spec(DEMO_MODEL_DIR)


def _preprocessed(model, image: bytes, video: bytes, question: str):
    """(expanded ids, mm_inputs image batch, extra video batch): image, then video, then the question."""
    tok, spec = model
    limits = MediaLimits()
    images = preprocess_images([decode_image(image, limits)], patch_size=spec.patch_size,
                               pooling_kernel_size=spec.pooling_kernel_size, max_soft_tokens=spec.image_max_soft_tokens)
    clip = decode_video(video, num_frames=NUM_FRAMES, limits=limits)
    frames = preprocess_images(clip.frames, patch_size=spec.patch_size, pooling_kernel_size=spec.pooling_kernel_size,
                               max_soft_tokens=spec.video_max_soft_tokens)
    body, image_runs, frame_runs = tok.encode("user\n"), [], []
    body += [spec.boi_token_id]
    image_runs.append((len(body) + 2, images.num_soft_tokens[0]))
    body += [spec.image_token_id] * images.num_soft_tokens[0] + [spec.eoi_token_id]
    for i, (n, t) in enumerate(zip(frames.num_soft_tokens, clip.timestamps_s, strict=True)):
        body += tok.encode((" " if i else "") + timestamp_text(t) + " ") + [spec.boi_token_id]
        frame_runs.append((len(body) + 2, n))
        body += [spec.video_token_id] * n + [spec.eoi_token_id]
    body += tok.encode(question)
    return (turn(tok, body), mm_batch(common_pb2.IMAGE, images, image_runs),
            mm_batch(common_pb2.VIDEO, frames, frame_runs))


def _generate(stub, request) -> vpb.GenerateComplete:
    (response,) = list(stub.Generate(request, timeout=120))
    return response.complete


def test_preprocessed_image_and_video_equal_media_refs(stub, model, make_video):
    tok, spec = model
    image, video, question = png(21), make_video(5, num_frames=8), "What happens?"
    sampling = vpb.SamplingParams(temperature=0, max_tokens=12)
    by_reference = _generate(stub, vpb.GenerateRequest(
        request_id="refs", sampling_params=sampling,
        tokenized=vpb.TokenizedInput(input_ids=turn(tok, [*tok.encode("user\n"), spec.image_token_id,
                                                            spec.video_token_id, *tok.encode(question)])),
        media_refs=vpb.MediaRefs(items=[
            vpb.MediaRef(modality=common_pb2.IMAGE, url="data:image/png;base64," + base64.b64encode(image).decode()),
            vpb.MediaRef(modality=common_pb2.VIDEO, url="data:video/mp4;base64," + base64.b64encode(video).decode())])))
    ids, image_batch, video_batch = _preprocessed(model, image, video, question)
    preprocessed = _generate(stub, vpb.GenerateRequest(
        request_id="pre", sampling_params=sampling, tokenized=vpb.TokenizedInput(input_ids=ids),
        mm_inputs=image_batch, extra_mm_inputs=[video_batch]))
    assert preprocessed.prompt_tokens == by_reference.prompt_tokens == len(ids)
    assert list(preprocessed.output_ids) == list(by_reference.output_ids)
    assert len(by_reference.output_ids) > 1


def test_tensors_not_in_our_layout_are_refused(stub, model, make_video):
    ids, image_batch, video_batch = _preprocessed(model, png(3), make_video(2, num_frames=8), "Hm?")
    cases = []
    short = vpb.MultimodalInputs()
    short.CopyFrom(image_batch)
    pixels = short.pixel_values
    pixels.shape[1] //= 2
    pixels.inline = pixels.inline[:len(pixels.inline) // 2]
    cases.append((short, video_batch, "not our layout"))
    cases.append((image_batch, video_batch, "is not between"))   # with the image's <|image> made text, below
    cases.append((image_batch, vpb.MultimodalInputs(), "pixel values are required"))
    shm = vpb.MultimodalInputs()
    shm.CopyFrom(image_batch)
    shm.pixel_values.shm.name = "/dev/shm/x"
    cases.append((shm, video_batch, "only inline tensors"))
    cases.append((image_batch, None, "soft tokens outside"))
    no_boi = list(ids)
    no_boi[image_batch.mm_placeholders[0].offset - 1] = model[0].encode("x")[0]
    for first, extra, why in cases:
        prompt = no_boi if why == "is not between" else ids
        request = vpb.GenerateRequest(request_id="bad", tokenized=vpb.TokenizedInput(input_ids=prompt), mm_inputs=first,
                                      extra_mm_inputs=[extra] if extra is not None else [],
                                      sampling_params=vpb.SamplingParams(max_tokens=2))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details(), e.value.details()


def test_prompt_logprobs_and_cached_tokens_as_mmserve_v1(server, stub, model):
    tok, _ = model
    ids = turn(tok, tok.encode("user\nName a colour"))
    with Client(server.address) as c:
        ours = c.generate(prompt="Name a colour", max_tokens=2, temperature=0, prompt_logprobs=True, top_logprobs=2)
    complete = _generate(stub, vpb.GenerateRequest(
        request_id="plp", tokenized=vpb.TokenizedInput(input_ids=ids),
        sampling_params=vpb.SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)))
    got = complete.input_logprobs
    assert list(got.token_ids) == ids and len(got.token_logprobs) == len(ids) == ours.usage.prompt_tokens
    assert not got.token_logprobs[0].HasField("value")   # the first prompt token has none
    assert [v.value for v in got.token_logprobs[1:]] == pytest.approx([p.logprob for p in ours.prompt_logprobs],
                                                                      abs=1e-5)
    assert [list(t.token_ids) for t in got.top_logprobs[1:]] == [[a.token_id for a in p.top]
                                                                 for p in ours.prompt_logprobs]
    repeat = vpb.SamplingParams(temperature=0, max_tokens=2)
    _generate(stub, vpb.GenerateRequest(request_id="c1", tokenized=vpb.TokenizedInput(input_ids=ids),
                                        sampling_params=repeat))
    again = _generate(stub, vpb.GenerateRequest(request_id="c2", tokenized=vpb.TokenizedInput(input_ids=ids),
                                                sampling_params=repeat))
    assert again.cached_tokens == (len(ids) - 1) // 16 * 16 > 0   # whole blocks, the last token recomputed


def test_every_sample_reports_the_requests_cache_hit_and_prompt_logprobs(server, stub, model):
    """n=2: sample 1 forks sample 0's prompt KV, which is no cache hit of the request's (mmserve.v1 says
    so), and computes no prompt logprobs of its own: every `complete` carries sample 0's, streamed or not."""
    tok, _ = model
    # never seen: nothing cached; no space at either end, which the prompt layout strips (model/prompt.py)
    # while the ids below keep it
    text = "".join(random.choices(string.ascii_lowercase + " ", k=80)).strip() + "z"
    ids = turn(tok, tok.encode("user\n" + text))

    def completes(request_id: str, stream: bool, prompt_logprobs: int | None = None) -> list[vpb.GenerateComplete]:
        responses = stub.Generate(vpb.GenerateRequest(
            request_id=request_id, tokenized=vpb.TokenizedInput(input_ids=ids), stream=stream,
            sampling_params=vpb.SamplingParams(temperature=1, max_tokens=3, n=2, prompt_logprobs=prompt_logprobs)),
            timeout=120)
        return sorted((r.complete for r in responses if r.HasField("complete")), key=lambda c: c.index)

    fresh = completes("n2-fresh", stream=False)
    assert [c.index for c in fresh] == [0, 1] and [c.cached_tokens for c in fresh] == [0, 0]
    with Client(server.address) as c:
        ours = c.generate(prompt=text, max_tokens=3, temperature=1, n=2)
    assert ours.usage.cached_tokens == (len(ids) - 1) // 16 * 16 > 0   # whole blocks, the last token recomputed
    assert [c.cached_tokens for c in completes("n2-again", stream=True)] == [ours.usage.cached_tokens] * 2
    first, second = (c.input_logprobs for c in completes("n2-plp", stream=False, prompt_logprobs=1))
    assert len(first.token_logprobs) == len(ids) and len(first.top_logprobs[1].token_ids) == 1
    assert second == first


def test_a_sample_that_ends_before_sample_0_waits_for_its_prompt_usage():
    """Sample 0's cached tokens and prompt logprobs are known when it ends; a fork that ends first
    (its EOS, say) holds its `complete` until sample 0 ends, then sends it just before sample 0's."""
    def end(request_id: str, cached: int, prompt_logprobs) -> RequestOutput:
        return RequestOutput(request_id, [7], "", finished=True, finish_reason="length", prompt_logprobs=prompt_logprobs,
                             usage=Usage(prompt_tokens=40, multimodal_tokens=0, completion_tokens=1, num_frames=0,
                                         cached_tokens=cached))

    ended = SampleEnds(list(range(3, 43)), with_top=False)
    assert ended.finished(1, end("r#1", 39, None), [7], None) == []
    sent = [m.complete for m in ended.finished(0, end("r", 16, [TokenLogprobs(5, -1.5, 1)] * 39), [7], None)]
    assert [(c.index, c.cached_tokens) for c in sent] == [(1, 16), (0, 16)]
    assert sent[0].input_logprobs == sent[1].input_logprobs and sent[0].input_logprobs.token_logprobs[1].value == -1.5


def test_frames_sampled_per_video_come_back_as_through_mmserve_v1(server, stub, model, make_video):
    """An image between two videos, one shorter than the default frame count: the trailing metadata
    names each video by its media_refs index with the frames it sampled, as mmserve.v1 reports them."""
    tok, spec = model
    long, short, image = make_video(7, num_frames=12), make_video(8, num_frames=2), png(9)
    with Client(server.address) as c:
        ours = c.generate([message("user", video_part(long), image_part(image), video_part(short), text_part("Hm?"))],
                          max_tokens=2, temperature=0)
    assert [v.num_frames for v in ours.videos] == [NUM_FRAMES, 2]

    def ref(modality, data: bytes, mime: str) -> vpb.MediaRef:
        return vpb.MediaRef(modality=modality, url=f"data:{mime};base64," + base64.b64encode(data).decode())

    call = stub.Generate(vpb.GenerateRequest(
        request_id="frames", sampling_params=vpb.SamplingParams(temperature=0, max_tokens=2),
        tokenized=vpb.TokenizedInput(input_ids=turn(tok, [*tok.encode("user\n"), spec.video_token_id,
                                                            spec.image_token_id, spec.video_token_id,
                                                            *tok.encode("Hm?")])),
        media_refs=vpb.MediaRefs(items=[ref(common_pb2.VIDEO, long, "video/mp4"), ref(common_pb2.IMAGE, image, "image/png"),
                                        ref(common_pb2.VIDEO, short, "video/mp4")])), timeout=120)
    (response,) = list(call)
    assert response.complete.prompt_tokens == ours.usage.prompt_tokens
    assert dict(call.trailing_metadata())[VIDEO_FRAMES_KEY] == f"0={NUM_FRAMES},2=2"


def test_abort_mid_stream_frees_the_request_at_once(server, stub, model):
    """Abort(request_ids) while the stream runs: the stream ends and the engine holds nothing of it."""
    tok, _ = model
    stream = stub.Generate(vpb.GenerateRequest(
        request_id="to-abort", stream=True, tokenized=vpb.TokenizedInput(input_ids=turn(tok, tok.encode("user\nGo"))),
        sampling_params=vpb.SamplingParams(temperature=0, max_tokens=900, ignore_eos=True, n=2)), timeout=120)
    next(stream)
    stub.Abort(vpb.AbortRequest(request_ids=["to-abort"]), timeout=10)
    with pytest.raises(grpc.RpcError) as e:
        for _ in stream:
            pass
    assert e.value.code() == grpc.StatusCode.CANCELLED
    held = server.call(server.engine.held_resources())
    assert not any(held.values()), held   # both samples' blocks, states and streams: nothing left


def test_the_advertised_media_limits_are_the_ones_admission_holds(stub, server, model):
    """GetServerInfo said 64 images per request (the frame limit) where the server refuses a 17th
    image: a gateway sizing requests by it got INVALID_ARGUMENT."""
    tok, spec = model
    info = stub.GetServerInfo(vpb.GetServerInfoRequest(), timeout=30)
    limits = dict(item.split("=") for item in info.mm_item_limits.split(","))
    config = server.engine_config
    assert limits == {"image": str(config.max_images_per_request), "video": str(config.max_frames_per_request)}
    image = "data:image/png;base64," + base64.b64encode(png(4, size=16)).decode()
    over = config.max_images_per_request + 1
    request = vpb.GenerateRequest(
        request_id="too-many", sampling_params=vpb.SamplingParams(max_tokens=1),
        tokenized=vpb.TokenizedInput(input_ids=turn(tok, [*tok.encode("user\n"), *[spec.image_token_id] * over])),
        media_refs=vpb.MediaRefs(items=[vpb.MediaRef(modality=common_pb2.IMAGE, url=image)] * over))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {config.max_images_per_request}" in e.value.details() and "--max-images-per-request" in e.value.details()


def test_a_large_data_url_is_decoded_off_the_event_loop(server, monkeypatch):
    """The probe: 4 data: URLs of 47 MiB, base64-decoded on the event loop, stalled every other call
    for 1.2 s. Scaled down: while a 12 MiB one decodes, the server's loop must keep running: a tick of
    it in the middle of the decode proves it (on the loop, the decode would leave no tick inside)."""
    import asyncio
    import os
    import time

    from mmserve.server.vllm_engine import servicer

    windows, real = [], servicer.media_inputs

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            windows.append((started, time.perf_counter()))

    monkeypatch.setattr(servicer, "media_inputs", timed)
    stamps, done = [], asyncio.Event()

    async def tick():
        while not done.is_set():
            stamps.append(time.perf_counter())
            await asyncio.sleep(0.0005)

    ticking = asyncio.run_coroutine_threadsafe(tick(), server._loop)
    url = "data:image/png;base64," + base64.b64encode(os.urandom(12 * 2**20)).decode()
    request = vpb.GenerateRequest(request_id="big-url", sampling_params=vpb.SamplingParams(max_tokens=1),
                                  tokenized=vpb.TokenizedInput(input_ids=[2, 4, 8, 5]),
                                  media_refs=vpb.MediaRefs(items=[vpb.MediaRef(modality=common_pb2.IMAGE, url=url)]))
    with grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 32 * 2**20)]) as channel:
        with pytest.raises(grpc.RpcError) as e:   # random bytes: decoded from base64, then not an image
            list(vpb_grpc.VllmEngineStub(channel).Generate(request, timeout=60))
    server._loop.call_soon_threadsafe(done.set)
    ticking.result(timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    (started, ended), = windows
    took = ended - started
    middle = [t for t in stamps if started + 0.25 * took < t < ended - 0.05 * took]
    assert middle, f"the event loop never ran in the middle of a {took:.3f}s data: URL decode"
