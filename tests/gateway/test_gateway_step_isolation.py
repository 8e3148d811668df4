"""One bad request never fails its step-mates (the hostile-client probe of #42, scaled down).

Router-preprocessed `mm_inputs` whose patch positions the vision tower cannot take (past its
position table, or not an image's grid) are refused with INVALID_ARGUMENT at the VllmEngine door,
before the engine, while `mmserve.v1` requests decode in the steps it would have joined: they all
finish. A failure inside the vision encoder itself (injected: validation leaves no real input that
fails there) ends only the request whose media it was; the request encoded in the same batched
vision call, and the text requests of the same step, finish with the tokens they get alone.

One in-process server whose engine core runs on a thread of this process, so the test can hold the
step loop (both image requests then join one step) and wrap the model's vision encoder."""

from __future__ import annotations

import asyncio
import io
import threading

import grpc
import pytest
from gateway_cases import mm_batch, turn
from loopback_server import LoopbackServer, engine_config
from PIL import Image
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from mmserve.api.mmserve.v1 import generation_pb2 as pb
from mmserve.api.mmserve.v1 import generation_pb2_grpc as pb_grpc
from mmserve.config import DEMO_MODEL_DIR, ServerConfig
from mmserve.model.spec import load_spec
from mmserve.model.tokenizer import load_tokenizer
from mmserve.multimodal.image import decode_image
from mmserve.multimodal.limits import MediaLimits
from mmserve.multimodal.preprocess import preprocess_images

BYSTANDER_TOKENS = 24
POISON_RED = 7   # the red value of the image whose encode the injected fault fails


@pytest.fixture(scope="module")
def server():
    s = LoopbackServer(engine_config(DEMO_MODEL_DIR, max_num_seqs=8, engine_process=False, enable_prefix_caching=False),
                       ServerConfig(port=0, worker_threads=2)).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model():
    return load_tokenizer(DEMO_MODEL_DIR), load_spec(DEMO_MODEL_DIR)


def _png(rgb: tuple[int, int, int], size: int = 32) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(out, format="PNG")
    return out.getvalue()


def _text(request_id: str, max_tokens: int = BYSTANDER_TOKENS) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, messages=[pb.Message(role="user", parts=[pb.Part(text="go on")])],
                              sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))


def _image(request_id: str, image: bytes) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, messages=[pb.Message(role="user", parts=[
        pb.Part(image=pb.Image(data=image)), pb.Part(text="What is this?")])],
        sampling=pb.SamplingParams(max_tokens=6, ignore_eos=True, temperature=0))


def _preprocessed(model, image: bytes, request_id: str) -> vpb.GenerateRequest:
    """An image as a gateway's own processor sends it: expanded ids and our patch layout."""
    tok, spec = model
    batch = preprocess_images([decode_image(image, MediaLimits())], patch_size=spec.patch_size,
                              pooling_kernel_size=spec.pooling_kernel_size, max_soft_tokens=spec.image_max_soft_tokens)
    n = batch.num_soft_tokens[0]
    body = [*tok.encode("user\n"), spec.boi_token_id, *[spec.image_token_id] * n, spec.eoi_token_id,
            *tok.encode("Hm?")]
    offset = 2 + len(tok.encode("user\n")) + 1
    return vpb.GenerateRequest(request_id=request_id, tokenized=vpb.TokenizedInput(input_ids=turn(tok, body)),
                               mm_inputs=mm_batch(common_pb2.IMAGE, batch, [(offset, n)]),
                               sampling_params=vpb.SamplingParams(max_tokens=4, temperature=0))


async def _tokens(call) -> tuple[list[int], grpc.StatusCode | None, str]:
    """(token ids, error code or None, details) of a mmserve.v1 stream, read to its end."""
    ids: list[int] = []
    try:
        while (response := await call.read()) is not grpc.aio.EOF:
            if response.HasField("delta"):
                ids += list(response.delta.token_ids)
    except grpc.aio.AioRpcError as e:
        return ids, e.code(), e.details() or ""
    return ids, None, ""


def _bad_positions(request: vpb.GenerateRequest, how: str) -> vpb.GenerateRequest:
    """The probe's positions: x + 1000, every real patch at (0, 0), or every one at (63, 63)."""
    import torch

    bad = vpb.GenerateRequest()
    bad.CopyFrom(request)
    (key,) = bad.mm_inputs.model_specific_tensors
    data = bad.mm_inputs.model_specific_tensors[key]
    positions = torch.frombuffer(bytearray(data.inline), dtype=torch.int64).reshape(list(data.shape)).clone()
    real = (positions != -1).all(dim=-1)
    if how == "x+1000":
        positions[..., 0][real] += 1000
    else:
        positions[real] = {"all (0,0)": 0, "all (63,63)": 63}[how]
    data.inline = positions.numpy().tobytes()
    return bad


def test_positions_the_vision_tower_cannot_take_are_refused_and_step_mates_finish(server, model):
    good = _preprocessed(model, _png((200, 30, 90)), "door-good")
    bad = [_bad_positions(good, how) for how in ("x+1000", "all (0,0)", "all (63,63)")]
    floats = vpb.GenerateRequest()
    floats.CopyFrom(good)
    (key,) = floats.mm_inputs.model_specific_tensors
    floats.mm_inputs.model_specific_tensors[key].dtype = "float32"   # same byte count as int64 is not: see below
    floats.mm_inputs.model_specific_tensors[key].inline = b"\0" * (len(good.mm_inputs.model_specific_tensors[key].inline) // 2)
    huge = vpb.GenerateRequest()
    huge.CopyFrom(good)
    huge.mm_inputs.pixel_values.CopyFrom(vpb.TensorData(shape=[0, 2**32 - 1, 2**32 - 1], dtype="float32", inline=b""))

    async def scenario():
        async with grpc.aio.insecure_channel(server.address) as channel:
            v1, door = pb_grpc.GenerationStub(channel), vpb_grpc.VllmEngineStub(channel)
            bystanders = [v1.Generate(_text(f"door-by-{i}")) for i in range(3)]
            for call in bystanders:   # decoding: every step from here on runs them
                await call.read()
            refusals = []
            for k, request in enumerate([*bad, floats, huge]):
                request.request_id = f"door-bad-{k}"
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for _ in door.Generate(request):
                        pass
                refusals.append((refused.value.code(), refused.value.details()))
            answered = [r async for r in door.Generate(good)]
            return refusals, answered, [await _tokens(call) for call in bystanders]

    refusals, answered, bystanders = asyncio.run(scenario())
    for code, details in refusals:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert "mm_inputs" in details and len(details) < 400, details
    assert "grid" in refusals[0][1] and "grid" in refusals[1][1] and "grid" in refusals[2][1]
    assert "float32" in refusals[3][1] and "int64" in refusals[3][1]   # the dtype named, not "expected X, got X"
    assert "not our layout" in refusals[4][1]
    assert answered[-1].complete.completion_tokens == 4
    for ids, code, details in bystanders:
        assert code is None, details
        assert len(ids) == BYSTANDER_TOKENS - 1   # the first token was read before the probes


class PoisonedEncoder:
    """Wraps the model's vision encoder: any call holding the poison image raises, as a failure
    inside the tower would; records each call's batch size. `hold` parks the step loop inside the
    next step until `release`, so requests sent meanwhile all join the step after it."""

    def __init__(self, core) -> None:
        self.core, self.model = core, core.runner.model
        self.batches: list[int] = []
        self.hold, self.holding, self.release = threading.Event(), threading.Event(), threading.Event()

    def encode_vision(self, pixel_values, position_ids):
        self.batches.append(pixel_values.shape[0])
        if bool(((pixel_values[:, 0, 0] - POISON_RED / 255).abs() < 1e-6).any()):
            raise RuntimeError("injected fault inside the vision encoder")
        return type(self.model).encode_vision(self.model, pixel_values, position_ids)

    def execute(self, out, *prev):   # (async scheduling: the step in flight's tokens)
        if self.hold.is_set():
            self.hold.clear()
            self.holding.set()
            self.release.wait(30)
        return type(self.core.runner).execute(self.core.runner, out, *prev)

    def __enter__(self) -> PoisonedEncoder:
        self.model.encode_vision = self.encode_vision
        self.core.runner.execute = self.execute
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        del self.model.encode_vision
        del self.core.runner.execute


def test_a_vision_encoder_failure_ends_only_its_request(server):
    async def scenario(fault: PoisonedEncoder):
        async with grpc.aio.insecure_channel(server.address) as channel:
            v1 = pb_grpc.GenerationStub(channel)
            alone = await _tokens(v1.Generate(_image("enc-good-alone", _png((200, 30, 90)))))
            text_alone = await _tokens(v1.Generate(_text("enc-text-alone")))
            texts = [v1.Generate(_text(f"enc-text-{i}")) for i in range(2)]
            for call in texts:
                await call.read()
            fault.hold.set()
            assert await asyncio.to_thread(fault.holding.wait, 30)
            fault.batches.clear()
            good, poisoned = v1.Generate(_image("enc-good", _png((200, 30, 90)))), \
                v1.Generate(_image("enc-poisoned", _png((POISON_RED, 30, 90))))
            states = server.engine.processor.states
            while not {"enc-good", "enc-poisoned"} <= set(states):   # both sent to the held core
                await asyncio.sleep(0.01)
            fault.release.set()
            return alone, text_alone, await _tokens(good), await _tokens(poisoned), [await _tokens(c) for c in texts]

    with PoisonedEncoder(server.engine.core) as fault:
        alone, text_alone, good, poisoned, texts = asyncio.run(scenario(fault))
    assert fault.batches[0] == 2   # both images in one batched vision call, which raised
    assert good == alone and good[1] is None
    for ids, code, details in texts:
        assert code is None, details
        assert ids == text_alone[0][1:]   # greedy: the same tokens as alone (the first was read before)
    assert poisoned[1] == grpc.StatusCode.INTERNAL and "enc-poisoned" in poisoned[2], poisoned
    assert "vision encoder" in poisoned[2] and "enc-good" not in poisoned[2]
    assert _quiet(server) == {}   # the poisoned request's KV blocks went back with it


def _quiet(server, timeout_s: float = 30.0) -> dict:
    """What the engine still holds once every request has ended (requests, blocks): {} when nothing."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        held = asyncio.run_coroutine_threadsafe(server.engine.held_resources(), server._loop).result(30)
        left = {k: v for k, v in held.items() if k in ("requests", "front_end_requests", "running", "waiting") and v}
        left.update({f"blocks {pool}": n for pool, n in held["kv_blocks_held"].items() if n})
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def test_the_vision_tower_refuses_positions_past_its_table_before_indexing(server, model):
    """The engine's own guard (what a GPU would otherwise hit as a device-side assert that ends the
    engine): a ValueError naming the table, raised on the host before the tower runs."""
    tok, spec = model
    batch = preprocess_images([decode_image(_png((1, 2, 3)), MediaLimits())], patch_size=spec.patch_size,
                              pooling_kernel_size=spec.pooling_kernel_size, max_soft_tokens=spec.image_max_soft_tokens)
    vision = server.engine.core.runner.model
    (ok,) = vision.encode_vision(batch.pixel_values, batch.position_ids)
    assert ok.shape[0] == batch.num_soft_tokens[0]
    table = vision.vision.vision_tower.patch_embedder.position_embedding_size
    past = batch.position_ids.clone()
    past[0, 0] = table
    with pytest.raises(ValueError, match=f"patch positions must lie in \\[0, {table}\\)"):
        vision.encode_vision(batch.pixel_values, past)
