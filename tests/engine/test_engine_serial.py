"""What crosses the engine-process boundary survives it: any dataclass (a field added tomorrow
included), mmserve errors with their attributes, tensors of every dtype (large ones out of band,
sharing the received frame's memory), and fields marked local stay behind."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import zmq

from mmserve.engine.types import EngineRequest, RequestOutput, Usage
from mmserve.errors import InvalidInputError, LimitExceededError
from mmserve.ipc import serial
from mmserve.ipc.protocol import AddRequest, CoreOutput, EngineCoreOutputs, LoadInfo
from mmserve.request import MultiModalInput
from mmserve.sampling_params import SamplingParams


def through_zmq(obj):
    """obj -> frames -> a real zmq socket pair -> obj."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://serial-test")
        b.connect("inproc://serial-test")
        a.send_multipart(serial.encode(obj), copy=False)
        return serial.decode(b.recv_multipart(copy=False))
    finally:
        a.close()
        b.close()
        ctx.term()


def test_requests_cross_with_pixels_and_without_the_front_ends_fields():
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.rand(int(torch.randint(50, 400, (), generator=gen)), 48, generator=gen)
    positions = torch.randint(0, 9, (pixels.shape[0], 2), generator=gen)
    req = EngineRequest("r", [1, 2, 3, 4], [(1, 2)], [MultiModalInput(pixels, positions)],
                        SamplingParams(max_tokens=7, stop=("x",), seed=seed), priority=3,
                        trace_context=object(), num_frames=1, num_mm_tokens=2)
    got = through_zmq(AddRequest(req.core_request())).request
    assert not hasattr(got, "trace_context")      # front end only: a live OTel context never crosses
    assert torch.equal(got.mm_inputs[0].pixel_values, pixels) and torch.equal(got.mm_inputs[0].position_ids, positions)
    assert dataclasses.replace(got, mm_inputs=[]) == dataclasses.replace(req.core_request(), mm_inputs=[])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool])
def test_tensors_of_any_dtype_and_shape(dtype):
    for shape in [(), (0, 3), (5,), (3, 700, 2)]:
        t = (torch.rand(shape) * 100).to(dtype)
        got = through_zmq(t)
        assert got.dtype == dtype and got.shape == t.shape and torch.equal(got, t)
    view = torch.arange(4000, dtype=torch.float32).reshape(40, 100)[:, ::3]   # a non-contiguous view
    assert torch.equal(through_zmq(view), view)


def test_large_tensors_travel_out_of_band():
    frames = serial.encode([torch.zeros(10_000), torch.zeros(8)])
    assert len(frames) == 2 and len(memoryview(frames[1])) == 40_000 and len(memoryview(frames[0])) < 1000


def test_errors_keep_what_the_status_mapping_reads():
    refused = LimitExceededError("queue full", "--max-waiting-requests", retryable=True)
    never = LimitExceededError("too big", "--kv-cache-bytes")
    bad = InvalidInputError("messages", "no such frame")
    out = through_zmq(EngineCoreOutputs(LoadInfo(1, 2, 0.5, 8), admitted=["a"], outputs=[
        CoreOutput("a", error=refused), CoreOutput("b", error=never), CoreOutput("c", error=bad),
        CoreOutput("d", [5], "eos")]))
    a, b, c, d = out.outputs
    assert type(a.error) is LimitExceededError and a.error.retryable
    assert str(a.error) == str(refused) and a.error.flag == "--max-waiting-requests"
    assert b.error.flag == "--kv-cache-bytes" and not b.error.retryable
    assert type(c.error) is InvalidInputError and c.error.field == "messages" and str(c.error) == str(bad)
    assert d == CoreOutput("d", [5], "eos") and out.load == LoadInfo(1, 2, 0.5, 8) and out.admitted == ["a"]


@dataclasses.dataclass
class Tomorrow(RequestOutput):
    """RequestOutput as another engineer extends it (fields with defaults, as the contract asks)."""

    logprobs: list[float] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0


def test_a_field_added_to_a_crossing_dataclass_needs_no_ipc_change():
    out = Tomorrow("r", [1], "a", True, "length", usage=Usage(3, 0, 1, 0), logprobs=[-0.5], cached_tokens=16)
    assert through_zmq(out) == out
