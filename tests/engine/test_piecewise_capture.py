"""Piecewise capture's bookkeeping on a CPU, through CUDA's code path with a fake graph class.

On CUDA every tensor a captured piece allocates lives in the graphs' memory pool; one kept after
its bucket's capture (in `PiecewiseGraphs`' records) pins that memory, so the pool cannot reuse it
for the next bucket: each layer's q held at its output address was ~448 KB per token at 12B dims,
22.7 GiB over the buckets to 8192 tokens, where the graphs have 1 - utilization of the card. And a
capture window left open by an exception leaves the stream capturing, so not even the eager
fallback can run. Here the capture runs the real runner's forward over a tiny model with
`torch.cuda`'s graph API replaced by a recorder (the forward runs eagerly), which checks what is
held afterwards and that every window closes. The pool itself and the kernels inside the graphs
need a GPU (bench/gpu_check.py)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from mmserve.worker.cuda_graphs import CUDA
from mmserve.worker.piecewise_graphs import PiecewiseGraphs, piecewise_sizes


class RecordingGraph:
    """A torch.cuda.CUDAGraph that records its capture windows; like CUDA, one stream captures one
    graph at a time."""

    capturing: RecordingGraph | None = None
    windows: list[str] = []

    def capture_begin(self, pool=None):
        if RecordingGraph.capturing is not None:
            raise RuntimeError("the stream is already capturing")
        RecordingGraph.capturing = self
        RecordingGraph.windows.append("begin")

    def capture_end(self):
        if RecordingGraph.capturing is not self:
            raise RuntimeError("capture_end without capture_begin")
        RecordingGraph.capturing = None
        RecordingGraph.windows.append("end")

    def replay(self):
        pass


class _Stream:
    def wait_stream(self, other):
        pass


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    monkeypatch.setattr(RecordingGraph, "capturing", None)
    monkeypatch.setattr(RecordingGraph, "windows", [])
    for name, value in (("CUDAGraph", RecordingGraph), ("graph_pool_handle", object), ("Stream", _Stream),
                        ("current_stream", _Stream), ("stream", lambda s: torch.no_grad()),
                        ("synchronize", lambda *a: None)):
        monkeypatch.setattr(torch.cuda, name, value)
    return RecordingGraph


def capture_with_cuda_path(llm, max_tokens: int) -> PiecewiseGraphs:
    """The runner's piecewise capture, redone with CUDA's path for buckets up to `max_tokens`."""
    runner = llm.core.runner
    old = runner.piecewise
    runner.piecewise = PiecewiseGraphs(piecewise_sizes(max_tokens), mode=CUDA, attn_width=old._attn_out.numel()
                                       // old.sizes[-1], dtype=old.embeds.dtype, device=old.embeds.device,
                                       hidden_size=old.embeds.shape[1])
    runner._capture_piecewise()
    return runner.piecewise


def tensors_in(obj):
    """Every tensor reachable from `obj` through dicts, lists, tuples and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name))


def bytes_held_beyond(pieces: PiecewiseGraphs, kv_caches) -> int:
    """Bytes of the storages the graphs' records keep that are not the persistent buffers (tensors
    that are attributes of `pieces` themselves) or the KV cache: on CUDA, pool memory kept alive."""
    persistent = {t.untyped_storage().data_ptr() for t in itertools.chain(
        (v for v in vars(pieces).values() if isinstance(v, torch.Tensor)), kv_caches)}
    records = [v for v in vars(pieces).values() if isinstance(v, (dict, list))]
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors_in(records)}
    return sum(n for ptr, n in held.items() if ptr not in persistent)


def test_captured_buckets_hold_no_pool_memory_but_the_persistent_buffers(load_backend, fake_cuda_graphs):
    """Each bucket is layers + 1 graphs (one split per attention call), each captured in a window of its own, and what the
    buckets' records keep (each layer's q, the output) sits in the persistent buffers: nothing that
    grows with the buckets. Before the fix each layer's q and each bucket's output stayed at the
    piece's own output address, and the capture ended the bucket's first graph a second time where
    it should have ended its last piece (which never closed, and was replaced by the first)."""
    from engine_helpers import make_llm

    llm = make_llm(load_backend("sdpa"), attention_backend="sdpa", emulate_cuda_graphs=True)
    held = {}
    for max_tokens in (16, 64):
        pieces = capture_with_cuda_path(llm, max_tokens)
        layers = len(llm.core.runner.model.decoder.layers)
        assert pieces.enabled and len(pieces._calls) == len(piecewise_sizes(max_tokens))
        assert all(len(calls) == layers for calls in pieces._calls.values())
        assert all(len({id(g) for g in graphs}) == len(graphs) == layers + 1 for graphs in pieces._pieces.values())
        assert fake_cuda_graphs.windows == ["begin", "end"] * (layers + 1) * len(pieces.sizes)
        fake_cuda_graphs.windows.clear()
        held[max_tokens] = bytes_held_beyond(pieces, llm.core.runner.kv_caches)
    assert held == {16: 0, 64: 0}, f"bytes kept per capture beyond the persistent buffers: {held}"


def test_an_exception_mid_capture_ends_the_capture(load_backend, fake_cuda_graphs):
    """A forward that raises in its second piece (after one attention split) leaves no capture
    open: the runner falls back to eager steps, and a stream still capturing would fail them (the
    uniform graphs' `torch.cuda.graph` ends its capture the same way)."""
    from engine_helpers import PROMPTS, build_request, make_llm

    llm = make_llm(load_backend("sdpa"), attention_backend="sdpa", emulate_cuda_graphs=True)
    runner = llm.core.runner
    second_layer = runner.model.decoder.layers[1]

    def fail_in_capture(module, args):
        if runner.piecewise._running == "capture":
            raise RuntimeError("operation not permitted when stream is capturing")
    handle = second_layer.register_forward_pre_hook(fail_in_capture)
    try:
        pieces = capture_with_cuda_path(llm, 16)
    finally:
        handle.remove()
    assert fake_cuda_graphs.capturing is None, "an exception left the stream capturing"
    assert fake_cuda_graphs.windows == ["begin", "end", "begin", "end"]   # the first piece, then the failing one
    assert not pieces.enabled
    check = {c.component: c for c in runner.backend_checks}["piecewise_graphs"]
    assert check.running == "eager" and "operation not permitted" in check.reason, check
    assert [c.request_id for c in llm.generate([build_request("r", PROMPTS["text"], seed=1, max_tokens=2)])] == ["r"]


@pytest.mark.parametrize("member", ["e2b", "e4b", "12b_unified", "26b_a4b", "31b"])
def test_every_family_members_persistent_buffers_leave_the_graph_room_for_a_bucket(member):
    """The pool keeps nothing per bucket (the test above), so what the piecewise graphs hold between
    steps is their persistent buffers, built here on the meta device at the member's dimensions with
    CUDA's default buckets (to 8192 tokens): a small part of the room the KV sizing leaves graphs on
    an H100, 1 - utilization of ~78 GiB, the rest free for one bucket's working set. What each
    layer's q held per bucket before did not fit: at 12B, 448 KiB per token over 53,211 bucket rows."""
    import json
    from pathlib import Path

    from mmserve.config import EngineConfig
    from mmserve.model.spec import load_spec

    config = json.loads((Path(__file__).parents[1] / "fixtures" / "gemma4_family" / f"{member}.json").read_text())
    spec = load_spec(config)
    attn = [spec.attention_specs[layer.layer_type] for layer in spec.layers]
    cuda = EngineConfig(device="cuda")
    sizes = piecewise_sizes(cuda.max_step_tokens)
    assert len(sizes) == 44 and sum(sizes) == 53211
    pieces = PiecewiseGraphs(sizes, mode=CUDA, attn_width=max(a.num_heads * a.head_dim for a in attn),
                             dtype=torch.bfloat16, device=torch.device("meta"), hidden_size=spec.hidden_size)
    persistent = sum(t.nbytes for t in vars(pieces).values() if isinstance(t, torch.Tensor))
    room = (1 - cuda.gpu_memory_utilization) * 78 * 2**30
    assert persistent < room / 10, f"{member}: {persistent / 2**30:.2f} GiB of {room / 2**30:.1f}"
