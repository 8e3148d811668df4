"""FlashAttention 4 (`flash_attn.cute`, the `gpu` extra): varlen queries over the paged cache.

Steps whose scheduled tokens touch no frame take FA4's builtin causal / sliding path (tile
skipping and all). Steps with frames attach the mm_prefix mask_mod: FA4 hashes a mask_mod's source
and closure cells into its compile key, so the factory is cached, its closure holds only a bool,
helpers live at module level, per-step data arrives through aux_tensors (the [T, 2] range table)
and the window through a CuTe-typed aux scalar, so one kernel serves every window and frame count.
With a mask_mod, `causal=False` and no window argument: the builtin causal path would otherwise
skip the mask_mod (SM90) or clip the frames' future keys (SM100). Head dims or dtypes FA4 cannot
run fall back to SDPA (decided once, by the builder).

Known cost: FA4 b36 rejects block sparsity together with paged KV ("Block sparsity + paged KV not
supported on SM100"; the SM90 path has no paged loader for it), so a mask_mod step visits every key
tile of [0, seq_len) instead of the window's; tiles.py computes the lists a future FA4 could take.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import logging
import os
from dataclasses import dataclass

import torch

from mmserve.attention.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    LayerAttentionSpec,
    PoolConfig,
)
from mmserve.attention.paged import write_kv
from mmserve.attention.sdpa import SdpaImpl, SdpaMetadata, SdpaMetadataBuilder

log = logging.getLogger(__name__)

NO_WINDOW = 2**30
FA4_DTYPES = (torch.float16, torch.bfloat16)


def fa4_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None and importlib.util.find_spec("flash_attn.cute") is not None


def fa4_arch(device: torch.device | str) -> int | None:
    """SM major*10 FA4 would compile for (honours FLASH_ATTENTION_ARCH, e.g. sm_90), or None without CUDA."""
    forced = os.environ.get("FLASH_ATTENTION_ARCH")
    if forced:
        return int(forced.removeprefix("sm_").rstrip("af")) // 10 * 10
    if not torch.cuda.is_available() or torch.device(device).type != "cuda":
        return None
    major, _ = torch.cuda.get_device_capability(device)
    return major * 10


def fa4_supports(spec: LayerAttentionSpec, arch: int | None) -> bool:
    """Paged KV needs SM90 or SM100/110; head dims per FA4 b36 (SM90: <= 256; SM100: <= 128 or 256)."""
    if arch is None or not fa4_installed():
        return False
    d = spec.head_dim
    if arch == 90:
        return 8 <= d <= 256 and d % 8 == 0
    if arch in (100, 110):
        return (d <= 128 and d % 8 == 0) or d == 256
    return False


@functools.cache
def mm_prefix_mask_mod(clamp: bool):
    """The keep() of mask.py as a CuTe mask_mod; cached so its compile-key hash is computed once."""
    import cutlass.cute as cute

    @cute.jit
    def mm_prefix_mask(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars):
        return _keep_ssa(q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars, clamp)

    # The default hash reads only this wrapper's source; name the helper's source too, so an edit
    # there cannot reuse a stale kernel from FA4's disk cache.
    source = inspect.getsource(_keep_ssa) + f"clamp={clamp}"
    mm_prefix_mask.__cute_hash__ = hashlib.sha256(source.encode()).hexdigest()
    return mm_prefix_mask


def _keep_ssa(q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars, clamp: bool):
    """keep(q, k) on FA4's SSA values: q_idx is local to the request's rows, kv_idx its absolute key."""
    import cutlass
    from cutlass import Int32
    from flash_attn.cute.utils import scalar_to_ssa

    q_abs = q_idx + scalar_to_ssa(seqlen_info.seqlen_k - seqlen_info.seqlen_q, Int32)
    window = scalar_to_ssa(Int32(aux_scalars[0]), Int32)
    ranges = aux_tensors[0]  # [T, 2]: start, end of the range each packed query row lies in
    row = cutlass.max(seqlen_info.offset_q + cutlass.min(q_idx[0], seqlen_info.seqlen_q - 1), 0)
    r_start = scalar_to_ssa(ranges[row, 0], Int32)
    r_end = scalar_to_ssa(ranges[row, 1], Int32)
    in_window = (q_abs - kv_idx) < window
    causal = (kv_idx <= q_abs) & in_window
    in_range = (r_start <= kv_idx) & (kv_idx <= r_end)
    if clamp:
        in_range = in_range & in_window
    return causal | in_range


def run_fa4(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: CommonAttentionMetadata,
            spec: LayerAttentionSpec) -> torch.Tensor:
    """One FA4 varlen call over the paged cache; the mask_mod path iff the step has ranges on this layer."""
    import cutlass
    from flash_attn.cute import flash_attn_varlen_func

    common = dict(cu_seqlens_q=md.query_start_loc, seqused_k=md.seq_lens, max_seqlen_q=md.max_query_len,
                  max_seqlen_k=md.max_seq_len, page_table=md.block_table, softmax_scale=spec.scale)
    if md.query_ranges is None or not spec.bidirectional:
        window = (spec.window - 1, 0) if spec.window is not None else (None, None)
        out, _ = flash_attn_varlen_func(q, k_cache, v_cache, causal=True, window_size=window, **common)
        return out
    window = spec.window if spec.window is not None else NO_WINDOW
    out, _ = flash_attn_varlen_func(
        q, k_cache, v_cache, causal=False, mask_mod=mm_prefix_mask_mod(spec.clamp_bidirectional),
        aux_tensors=[md.query_ranges], aux_scalars=(cutlass.Int32(window),), **common)
    return out


@dataclass
class Fa4Metadata:
    common: CommonAttentionMetadata
    fallback: SdpaMetadata | None     # set when this layer type runs on SDPA instead (shape or dtype)


class Fa4MetadataBuilder:
    """FA4 takes the common metadata as is; layer types it cannot run get SDPA's plan."""

    def __init__(self, pool: PoolConfig) -> None:
        self.use_fa4 = fa4_supports(pool.spec, fa4_arch(pool.device)) and pool.dtype in FA4_DTYPES
        self.fallback = None if self.use_fa4 else SdpaMetadataBuilder(pool)
        if not self.use_fa4:
            log.info("fa4: %s (head_dim %d, %s) not supported here; this layer type uses sdpa",
                     pool.spec.layer_type, pool.spec.head_dim, pool.dtype)

    def build(self, common: CommonAttentionMetadata) -> Fa4Metadata:
        return Fa4Metadata(common, None if self.fallback is None else self.fallback.build(common))


class Fa4Impl:
    """AttentionImpl on FA4; layer types its builder sent to SDPA run there."""

    def __init__(self, spec: LayerAttentionSpec) -> None:
        self.spec = spec
        self.fallback = SdpaImpl(spec)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
                metadata: Fa4Metadata) -> torch.Tensor:
        if metadata.fallback is not None:
            return self.fallback.forward(q, k, v, kv_cache, metadata.fallback)
        md = metadata.common
        T = md.num_actual_tokens
        write_kv(kv_cache, k, v, md)
        out = run_fa4(q[:T], kv_cache[0], kv_cache[1], md, self.spec)
        result = torch.zeros_like(q)
        result[:T] = out
        return result


BACKEND = AttentionBackend("fa4", Fa4Impl, Fa4MetadataBuilder)
