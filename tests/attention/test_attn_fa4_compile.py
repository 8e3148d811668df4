"""FA4 without a GPU: the mask_mod path compiles to a real sm_90a kernel under FakeTensorMode, and
one compiled kernel serves every frame count and window (the compile key must not move).

Numerics need a GPU: test_fa4_matches_reference runs only where CUDA and FA4 are present.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from mmserve.attention.backend import FULL, SLIDING, CommonAttentionMetadata, LayerAttentionSpec

fa4 = pytest.importorskip("mmserve.attention.fa4")
if not fa4.fa4_installed():
    pytest.skip("flash-attn-4 not installed (the `gpu` extra)", allow_module_level=True)

GEMMA_SLIDING = LayerAttentionSpec(SLIDING, num_heads=8, num_kv_heads=4, head_dim=256, window=1024, bidirectional=True)
GEMMA_FULL = LayerAttentionSpec(FULL, num_heads=8, num_kv_heads=4, head_dim=512, window=None, bidirectional=False)
FRAME_COUNTS = [1, 8, 16, 32, 46, 64]


def fake_step(num_frames: int, num_reqs: int = 3, frame_tokens: int = 70) -> CommonAttentionMetadata:
    """Shapes of a step whose video request carries `num_frames` frames (values are irrelevant to compile)."""
    T = num_frames * (frame_tokens + 8) + 40 * (num_reqs - 1)

    def e(*shape, dtype=torch.int32):
        return torch.empty(shape, dtype=dtype, device="cuda")
    return CommonAttentionMetadata(
        num_actual_tokens=T, num_reqs=num_reqs, max_query_len=T, max_seq_len=T + 4096,
        query_start_loc=e(num_reqs + 1), seq_lens=e(num_reqs), positions=e(T, dtype=torch.int64),
        block_table=e(num_reqs, (T + 4096) // 16 + 1), slot_mapping=e(T, dtype=torch.int64), block_size=16,
        query_ranges=e(T, 2), query_start_loc_cpu=None, seq_lens_cpu=None, positions_cpu=None,
        block_table_cpu=None, query_ranges_cpu=None)


@pytest.fixture(scope="module")
def sm90_fake(request):
    """FA4 compiles for sm_90a on this CPU (its arch choice is cached per process, so one arch here)."""
    env = {"FLASH_ATTENTION_ARCH": "sm_90", "CUTE_DSL_ARCH": "sm_90a", "FLASH_ATTENTION_NUM_SMS": "132"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from torch._subclasses.fake_tensor import FakeTensorMode
    yield FakeTensorMode
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def compiled_kernels() -> int:
    from flash_attn.cute.interface import _flash_attn_fwd
    return len(_flash_attn_fwd.compile_cache.cache)


def call(spec: LayerAttentionSpec, md: CommonAttentionMetadata, no_ranges: bool = False):
    q = torch.empty(md.num_actual_tokens, spec.num_heads, spec.head_dim, dtype=torch.bfloat16, device="cuda")
    cache = torch.empty(4096, 16, spec.num_kv_heads, spec.head_dim, dtype=torch.bfloat16, device="cuda")
    if no_ranges:
        md.query_ranges = None
    return fa4.run_fa4(q, cache, cache, md, spec)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
@pytest.mark.filterwarnings("ignore:Argument aux_data")  # FA4-internal, upstream noise
def test_mask_mod_kernel_compiles_once_across_frame_counts_and_windows(sm90_fake):
    before = compiled_kernels()
    with sm90_fake():
        for n in FRAME_COUNTS:
            out = call(GEMMA_SLIDING, fake_step(n))
            assert out.shape == (fake_step(n).num_actual_tokens, 8, 256)
        assert compiled_kernels() - before == 1
        narrower = LayerAttentionSpec(SLIDING, 8, 4, 256, window=512, bidirectional=True)
        call(narrower, fake_step(8))  # the window is an aux scalar, not part of the key
        assert compiled_kernels() - before == 1
        call(GEMMA_SLIDING, fake_step(8), no_ranges=True)  # frame-free steps: FA4's own sliding path
        assert compiled_kernels() - before == 2
    assert fa4.mm_prefix_mask_mod(True) is fa4.mm_prefix_mask_mod(True)
    assert fa4.mm_prefix_mask_mod(True).__cute_hash__ != fa4.mm_prefix_mask_mod(False).__cute_hash__


def test_layer_support_follows_fa4_head_dims():
    assert fa4.fa4_supports(GEMMA_SLIDING, 90) and fa4.fa4_supports(GEMMA_SLIDING, 100)
    assert not fa4.fa4_supports(GEMMA_FULL, 90) and not fa4.fa4_supports(GEMMA_FULL, 100)
    assert not fa4.fa4_supports(GEMMA_SLIDING, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FA4 numerics need a CUDA GPU (SM90/SM100)")
def test_fa4_matches_reference():
    from attn_batches import SLIDING_SPEC, make_batch, rel_err, standard_batches

    from mmserve.attention.synthetic import run_backend
    spec = LayerAttentionSpec(SLIDING, 4, 2, 128, window=SLIDING_SPEC.window, bidirectional=True)
    for name, reqs in standard_batches().items():
        batch = make_batch(reqs, spec, dtype=torch.bfloat16, free_outside_window=True)
        md = batch.metadata
        for field in ("query_start_loc", "seq_lens", "positions", "block_table", "slot_mapping", "query_ranges"):
            if getattr(md, field) is not None:
                setattr(md, field, getattr(md, field).cuda())
        cuda = replace(batch, q=batch.q.cuda(), k=batch.k.cuda(), v=batch.v.cuda(), kv_cache=batch.kv_cache.cuda())
        got, _ = run_backend("fa4", cuda, spec)
        want, _ = run_backend("reference", cuda, spec)
        assert rel_err(got, want) < 2e-2, name
