"""FA4 without a GPU: our calls compile to real sm_90a and sm_100a kernels under FakeTensorMode.

Per architecture: the windowed-pieces mask_mod path (steps with frames) compiles once and then
serves every frame count, batch and window (the compile key must not move); the frame-free sliding
path is one more kernel. Gemma 4's full layers (head dim 512) are refused by FA4 b36 itself on both
architectures (test_attn_layer_choice.py checks FA4's kernel constructors), so they take flex.
Numerics need a GPU: the tests marked gpu run only where CUDA and FA4 are present.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from mmserve.attention.backend import SLIDING, CommonAttentionMetadata, LayerAttentionSpec

# CI (.ci/run) sets MMSERVE_REQUIRE_FA4_CHECK=1: there the compile check must run, so missing FA4
# packages fail the suite instead of skipping it (tests/conftest.py also fails CI if it did not pass).
if os.environ.get("MMSERVE_REQUIRE_FA4_CHECK") == "1":
    from mmserve.attention import fa4  # not flash_attn.cute itself: it fixes its GPU arch when imported

    assert fa4.fa4_installed(), "MMSERVE_REQUIRE_FA4_CHECK=1 but flash-attn-4 is not installed (the fa4-check extra)"
else:
    fa4 = pytest.importorskip("mmserve.attention.fa4")
    if not fa4.fa4_installed():
        pytest.skip("flash-attn-4 not installed (the fa4-check extra; `make test` installs it)", allow_module_level=True)

GEMMA_SLIDING = LayerAttentionSpec(SLIDING, num_heads=16, num_kv_heads=8, head_dim=256, window=1024,
                                   bidirectional=True)
FRAME_COUNTS = [1, 8, 16, 32, 46, 64]
BLOCKS_PER_REQ = 1024


def e(*shape, dtype=torch.int32):
    return torch.empty(shape, dtype=dtype, device="cuda")


def fake_step(spec: LayerAttentionSpec, num_frames: int, num_reqs: int = 3, frame_tokens: int = 70,
              frames: bool = True, num_pieces: int | None = None) -> fa4.Fa4Metadata:
    """Shapes of a step whose video request carries `num_frames` frames (values do not matter to a compile)."""
    T = num_frames * (frame_tokens + 8) + 40 * (num_reqs - 1)
    common = CommonAttentionMetadata(
        num_actual_tokens=T, num_reqs=num_reqs, max_query_len=T, max_seq_len=T + 4096,
        query_start_loc=e(num_reqs + 1), seq_lens=e(num_reqs), positions=e(T, dtype=torch.int64),
        block_table=e(num_reqs, BLOCKS_PER_REQ), slot_mapping=e(T, dtype=torch.int64), block_size=16,
        query_ranges=e(T, 2) if frames else None, query_start_loc_cpu=None, seq_lens_cpu=None, positions_cpu=None,
        block_table_cpu=None, query_ranges_cpu=None)
    out = torch.empty(T, spec.num_heads, spec.head_dim, dtype=torch.bfloat16, device="cuda")
    if not frames:
        return fa4.Fa4Metadata(common, out, None)
    P = num_pieces or -(-T // fa4.piece_len(spec)) + num_reqs
    pieces = fa4.Pieces(e(P + 1), e(P), e(P, 80), e(P, 2), fa4.piece_len(spec))
    return fa4.Fa4Metadata(common, out, pieces)


class TargetSMs:
    """cutlass.utils.HardwareInfo for the compile target: persistent schedulers size their grid from the
    SM count, which FA4 otherwise asks the CUDA driver for (there is none here)."""

    def get_device_multiprocessor_count(self) -> int:
        return 132


@pytest.fixture(params=["sm_90", "sm_100"])
def fake_arch(request, monkeypatch):
    """FA4 compiling for `arch` on this CPU: its arch lookup is cached, and its kernels check the DSL's target."""
    import cutlass.utils
    from flash_attn.cute import interface
    from flash_attn.cute.flash_fwd import BaseDSL
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setenv("FLASH_ATTENTION_ARCH", request.param)
    monkeypatch.setenv("FLASH_ATTENTION_NUM_SMS", "132")
    monkeypatch.setattr(BaseDSL._get_dsl().envar, "arch", request.param + "a")
    monkeypatch.setattr(cutlass.utils, "HardwareInfo", TargetSMs)
    interface._get_device_arch.cache_clear()
    yield FakeTensorMode
    interface._get_device_arch.cache_clear()


def compiled_kernels() -> int:
    from flash_attn.cute.interface import _flash_attn_fwd
    return len(_flash_attn_fwd.compile_cache.cache)


def call(spec: LayerAttentionSpec, md: fa4.Fa4Metadata):
    q = torch.empty(md.common.num_actual_tokens, spec.num_heads, spec.head_dim, dtype=torch.bfloat16, device="cuda")
    k_cache, v_cache = (torch.empty(4096, 16, spec.num_kv_heads, spec.head_dim, dtype=torch.bfloat16, device="cuda")
                        for _ in range(2))   # distinct tensors, as the impl's kv_cache[0] and kv_cache[1] are
    return fa4.run_fa4(q, k_cache, v_cache, md, spec)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
@pytest.mark.filterwarnings("ignore:Argument aux_data")  # FA4-internal, upstream noise
def test_pieces_kernel_compiles_once_across_frame_counts_and_windows(fake_arch):
    before = compiled_kernels()
    with fake_arch():
        for n in FRAME_COUNTS:
            md = fake_step(GEMMA_SLIDING, n, num_reqs=1 + n % 4)
            out = call(GEMMA_SLIDING, md)
            assert out.shape == (md.common.num_actual_tokens, 16, 256) and out.data_ptr() == md.out.data_ptr()
        assert compiled_kernels() - before == 1
        narrower = replace(GEMMA_SLIDING, window=512)
        call(narrower, fake_step(narrower, 8))   # the window is an aux scalar, not part of the key
        assert compiled_kernels() - before == 1
        call(GEMMA_SLIDING, fake_step(GEMMA_SLIDING, 8, frames=False))   # frame-free steps: FA4's own sliding path
        assert compiled_kernels() - before == 2
    assert fa4.mm_prefix_mask_mod(True) is fa4.mm_prefix_mask_mod(True)
    assert fa4.mm_prefix_mask_mod(True).__cute_hash__ != fa4.mm_prefix_mask_mod(False).__cute_hash__


def test_an_edit_to_the_mask_mod_or_its_helper_changes_its_compile_key(tmp_path, monkeypatch):
    """FA4 keys its compiled kernels (in memory and on disk) by the mask_mod's hash, which our
    __cute_hash__ replaces: an edited copy of fa4.py, loaded as another module, gives another key
    for an edit to the wrapper's body or to the helper, and the same key unedited."""
    import importlib.util
    import inspect
    import sys

    from flash_attn.cute.utils import hash_callable

    source = inspect.getsource(fa4)
    call = "return _keep_ssa(batch, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars, clamp)"
    rule = "in_window = (q_abs - k_abs) < window"
    assert source.count(call) == 1 and source.count(rule) == 1

    def key(text: str, name: str) -> str:
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)   # (its dataclasses look their module up)
        spec.loader.exec_module(module)
        return hash_callable(module.mm_prefix_mask_mod(True))

    base = hash_callable(fa4.mm_prefix_mask_mod(True))
    assert key(source, "fa4_copy") == base
    assert key(source.replace(call, call.replace(", clamp)", ", not clamp)")), "fa4_wrapper_edited") != base
    assert key(source.replace(rule, rule.replace("<", "<=")), "fa4_helper_edited") != base


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
@pytest.mark.filterwarnings("ignore:Argument aux_data")
def test_steps_over_256_sequences_keep_the_compile_key(fake_arch):
    """E2B/E4B cut an 8k-token step into 512 pieces of 16 rows; above 256 sequences FA4 b36 takes its
    batch-lookup scheduler, another kernel. run_fa4 caps each call at SEQS_PER_CALL, so no step
    compiles a kernel mid-serving; the uncapped call would (checked, so the cap stays needed). The
    sequence count alone picks that scheduler, so the steps here are of the sliding layer the tests
    above compiled (in a whole run its two kernels are compiled already, per arch)."""
    from flash_attn.cute import interface

    assert fa4.SEQS_PER_CALL == interface.BIN_BATCH_SEARCH_THRESH
    assert fa4.mm_prefix_mask_mod(True).__vec_size__ == 1 == fa4.mm_prefix_mask_mod(False).__vec_size__
    spec = GEMMA_SLIDING
    with fake_arch():
        call(spec, fake_step(spec, 8))
        call(spec, fake_step(spec, 8, frames=False))
        before = compiled_kernels()
        for pieces in (257, 512, 600):
            call(spec, fake_step(spec, 64, num_pieces=pieces))
        call(spec, fake_step(spec, 1, num_reqs=300, frames=False))   # --max-num-seqs above 256: frame-free
        assert compiled_kernels() == before
        assert fa4.call_slices(600) == [(0, 256), (256, 256), (512, 88)]
        monkey = fa4.SEQS_PER_CALL
        try:
            fa4.SEQS_PER_CALL = 10**6
            call(spec, fake_step(spec, 64, num_pieces=512))
        finally:
            fa4.SEQS_PER_CALL = monkey
        assert compiled_kernels() > before


def test_pieces_are_one_query_tile_of_packed_rows():
    assert fa4.piece_len(GEMMA_SLIDING) * 2 == fa4.QUERY_TILE          # 16 query heads on 8 KV heads
    assert fa4.piece_len(replace(GEMMA_SLIDING, num_heads=8, num_kv_heads=1)) == 16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FA4 numerics need a CUDA GPU (SM90/SM100)")
@pytest.mark.parametrize("head_dim", [128, 256])
def test_fa4_matches_reference(head_dim):
    from attn_batches import SLIDING_SPEC, make_batch, rel_err, standard_batches

    from mmserve.attention.synthetic import run_backend
    spec = LayerAttentionSpec(SLIDING, 4, 2, head_dim, window=SLIDING_SPEC.window, bidirectional=True)
    for name, reqs in standard_batches().items():
        batch = make_batch(reqs, spec, dtype=torch.bfloat16, free_outside_window=True)
        md = batch.metadata
        moved = {f: getattr(md, f).cuda() for f in ("query_start_loc", "seq_lens", "positions", "block_table",
                                                   "slot_mapping", "query_ranges") if getattr(md, f) is not None}
        cuda = replace(batch, q=batch.q.cuda(), k=batch.k.cuda(), v=batch.v.cuda(), kv_cache=batch.kv_cache.cuda(),
                       metadata=replace(md, **moved))
        got, _ = run_backend("fa4", cuda, spec)
        want, _ = run_backend("reference", cuda, spec)
        assert rel_err(got, want) < 2e-2, name



def verify_step(spec: LayerAttentionSpec, num_reqs: int, query_len: int) -> fa4.Fa4Metadata:
    """Shapes of a frame-free step of `num_reqs` requests of `query_len` rows each, as a decode or
    verify CUDA graph captures it (worker/cuda_graphs.py: max_seqlen_q is the graph's query length)."""
    T = num_reqs * query_len
    common = CommonAttentionMetadata(
        num_actual_tokens=T, num_reqs=num_reqs, max_query_len=query_len, max_seq_len=4096,
        query_start_loc=e(num_reqs + 1), seq_lens=e(num_reqs), positions=e(T, dtype=torch.int64),
        block_table=e(num_reqs, BLOCKS_PER_REQ), slot_mapping=e(T, dtype=torch.int64), block_size=16,
        query_ranges=None, query_start_loc_cpu=None, seq_lens_cpu=None, positions_cpu=None,
        block_table_cpu=None, query_ranges_cpu=None)
    return fa4.Fa4Metadata(common, torch.empty(T, spec.num_heads, spec.head_dim, dtype=torch.bfloat16, device="cuda"),
                           None)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
@pytest.mark.filterwarnings("ignore:Argument aux_data")
def test_verify_graph_steps_compile_for_every_capture_size(fake_arch):
    """Speculation's verify graphs: every capture size of K + 1 = 4 rows per request (1..64 requests,
    max_seqlen_q = 4 baked in) runs FA4's sliding path on the target arch with decode's own kernel
    (max_seqlen_q = 1): capturing the verify graphs compiles nothing more. Shapes and compiles only:
    a graph's capture, flex's Triton kernels (the full layers) and numerics need a GPU (bench/gpu_check.py)."""
    from mmserve.worker.cuda_graphs import capture_sizes

    with fake_arch():
        call(GEMMA_SLIDING, verify_step(GEMMA_SLIDING, 8, 1))   # decode's kernel
        before = compiled_kernels()
        for num_reqs in capture_sizes(64):
            md = verify_step(GEMMA_SLIDING, num_reqs, 4)
            out = call(GEMMA_SLIDING, md)
            assert out.shape == (num_reqs * 4, 16, 256) and out.data_ptr() == md.out.data_ptr()
        assert compiled_kernels() == before


class KernelStub:
    """A compiled FA4 kernel's stand-in: the arguments of every launch."""

    def __init__(self):
        self.launches: list[tuple] = []

    def __call__(self, *args):
        self.launches.append(args)


def as_plain(value):
    """An argument as comparable data: a tensor by its view (storage, offset, shape, strides)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.untyped_storage()._cdata, value.storage_offset(), tuple(value.shape), value.stride())
    if isinstance(value, (tuple, list)):
        return type(value).__name__, tuple(as_plain(v) for v in value)
    return repr(value)


@pytest.fixture
def launching_wrapper(fake_arch, monkeypatch):
    """FA4's wrapper as it runs on a GPU (it launches the kernels), over FakeTensorMode's tensors:
    `cute.compile` gives a KernelStub that records each launch, into an empty cache of its own (the
    real kernels other tests compiled stay out of it, and it goes with the test).
    Yields (the stub, the list of wrapper calls so far)."""
    import cutlass.cute as cute
    from flash_attn.cute import interface
    from flash_attn.cute.cache_utils import JITCache

    stub, wrapper_calls = KernelStub(), []
    monkeypatch.setattr(cute, "compile", lambda *args, **kwargs: stub)
    monkeypatch.setattr(interface, "is_fake_mode", lambda: wrapper_calls.append(1) is not None)   # False, counted
    monkeypatch.setattr(interface._flash_attn_fwd, "compile_cache", JITCache())
    return stub, wrapper_calls


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
@pytest.mark.filterwarnings("ignore:Argument aux_data")
@pytest.mark.parametrize("frames", [True, False], ids=["pieces", "frame_free"])
def test_later_layers_launch_what_the_wrapper_would_with_their_own_q_and_cache(fake_arch, launching_wrapper, frames):
    """A step's layers share its metadata: the first layer goes through FA4's wrapper (one call per
    slice of <= 256 sequences), the others launch the recorded kernels themselves. Every launch
    passes exactly the arguments the wrapper passes for that layer (its q, its K and V caches, the
    step's output, offsets, page tables, aux tensors and scalars), and the wrapper ran for the first
    layer alone."""
    stub, wrapper_calls = launching_wrapper
    e4b = replace(GEMMA_SLIDING, num_heads=8, num_kv_heads=1)
    with fake_arch():
        md = fake_step(e4b, 64, num_pieces=300) if frames else fake_step(e4b, 1, num_reqs=300, frames=False)
        layers = [(torch.empty(md.common.num_actual_tokens, 8, 256, dtype=torch.bfloat16, device="cuda"),
                   *(torch.empty(4096, 16, 1, 256, dtype=torch.bfloat16, device="cuda") for _ in range(2)))
                  for _ in range(3)]
        for q, k_cache, v_cache in layers:
            assert fa4.run_fa4(q, k_cache, v_cache, md, e4b).data_ptr() == md.out.data_ptr()
        assert len(wrapper_calls) == 2 and len(md.calls) == 2   # 300 sequences: two slices, one layer
        prepared, stub.launches = stub.launches, []
        for q, k_cache, v_cache in layers:
            fa4.wrapper_calls(q, k_cache, v_cache, md.out, md, e4b)
    assert len(prepared) == len(stub.launches) == 6
    for got, want in zip(prepared, stub.launches, strict=True):
        assert as_plain(got) == as_plain(want)
    assert as_plain(prepared[0][:3]) != as_plain(prepared[2][:3])   # each layer its own q and cache
