"""FlashAttention 4 (`flash_attn.cute`, pinned 4.0.0b36): varlen queries over the paged cache.

Which layer types run here is decided once, at load time (attention/selection.py: `fa4_runs`);
the others take the batched fallback. All FA4 inputs are views of persistent buffers (the runner's
step inputs, this builder's), and FA4 writes into the builder's preallocated output, so a decode
step can be replayed as a CUDA graph.

Frame-free steps take FA4's builtin causal / sliding path over the runner's block tables (FA4
narrows each query tile's key range itself there).

Steps with frames attach the mm_prefix mask_mod. FA4 b36 turns causal/local off whenever a
mask_mod is given and refuses block sparsity with a paged cache, so it visits every key tile of
each sequence it is given. The builder therefore cuts each request's rows into pieces of one query
tile (`QUERY_TILE` packed rows: 128 / g queries with g query heads per KV head) and gives each piece
a windowed page table of just the keys its rows may keep (page_tables.windowed_pieces). The
mask_mod adds the piece's offsets (absolute position of its first query and of its key 0: aux
tensor 1) to FA4's local indices and applies mask.keep with each row's range from the step's range
table (aux tensor 0).

No Python wrapper per layer: FA4's `_flash_attn_fwd` validates its inputs, plans tiles and builds
the compile key on every call (0.27-0.36 ms of host time, measured on an H200: more than a decode
kernel). All layers of a type in one step make the same call but for q and the layer's cache, so
the step's first layer goes through the wrapper, which records the compiled kernel it launches
and its arguments (`PreparedCall`), and every later layer launches that kernel directly with its
own q, K and V in their places (`Fa4Metadata.calls`, refilled each step with the step's tensors).

Compile key: FA4 hashes a mask_mod's source and closure cells, so the factory is cached, its
closure holds only a bool, the factory's source and the helper's are named in __cute_hash__, per-step data arrives
through aux tensors and the window through a CuTe-typed aux scalar: one kernel serves every window,
frame count and batch. With a mask_mod, `causal=False` and no window: the builtin path would
otherwise skip the mask_mod (SM90) or clip the frames' future keys (SM100).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from mmserve.attention.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    LayerAttentionSpec,
    PoolConfig,
)
from mmserve.attention.buffers import StagedBuffer
from mmserve.attention.mask import NO_WINDOW
from mmserve.attention.page_tables import windowed_pieces
from mmserve.attention.paged import write_kv
from mmserve.attention.selection import device_arch, fa4_runs
from mmserve.attention.split_kv import SplitKvMetadata, decode_shaped, planner_for, split_kv_attention

QUERY_TILE = 128   # packed query rows of FA4's query tile at head dim 256 on SM90 and SM100
SEQS_PER_CALL = 256   # b36's BIN_BATCH_SEARCH_THRESH: more sequences in one call take another kernel


def fa4_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None and importlib.util.find_spec("flash_attn.cute") is not None


def piece_len(spec: LayerAttentionSpec) -> int:
    """Query rows per piece: one FA4 query tile once GQA packs the heads sharing a KV head into rows."""
    return max(1, QUERY_TILE // (spec.num_heads // spec.num_kv_heads))


@functools.cache
def mm_prefix_mask_mod(clamp: bool):
    """The keep() of mask.py as a CuTe mask_mod; cached so its compile-key hash is computed once."""
    import cutlass.cute as cute

    @cute.jit
    def mm_prefix_mask(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars):
        return _keep_ssa(batch, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars, clamp)

    # __cute_hash__ replaces FA4's own hash of the callable (flash_attn.cute.utils.hash_callable), so it
    # names all the kernel is compiled from: this factory's source (the wrapper's body), the helper's
    # and the clamp. An edit to either cannot then reuse a stale kernel from FA4's disk cache.
    source = inspect.getsource(mm_prefix_mask_mod) + inspect.getsource(_keep_ssa) + f"clamp={clamp}"
    mm_prefix_mask.__cute_hash__ = hashlib.sha256(source.encode()).hexdigest()
    # One column per call: _keep_ssa reads each row's range for lane 0 only. b36 defaults to 1; pinned
    # so a newer FA4 vectorising mask_mods by default cannot hand it packed fragments (vLLM pins it too).
    mm_prefix_mask.__vec_size__ = 1
    return mm_prefix_mask


def _keep_ssa(batch, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars, clamp: bool):
    """keep(q, k) on FA4's SSA values: q_idx and kv_idx are local to piece `batch`, whose offsets
    (absolute first query, absolute key 0) are row `batch` of aux tensor 1."""
    import cutlass
    from cutlass import Int32
    from flash_attn.cute.utils import scalar_to_ssa

    ranges, offsets = aux_tensors[0], aux_tensors[1]   # [T, 2] range of each packed row; [P, 2] per piece
    piece = batch[0]
    q_abs = q_idx + scalar_to_ssa(offsets[piece, 0], Int32)
    k_abs = kv_idx + scalar_to_ssa(offsets[piece, 1], Int32)
    window = scalar_to_ssa(Int32(aux_scalars[0]), Int32)
    row = cutlass.max(seqlen_info.offset_q + cutlass.min(q_idx[0], seqlen_info.seqlen_q - 1), 0)
    r_start = scalar_to_ssa(ranges[row, 0], Int32)
    r_end = scalar_to_ssa(ranges[row, 1], Int32)
    in_window = (q_abs - k_abs) < window
    causal = (k_abs <= q_abs) & in_window
    in_range = (r_start <= k_abs) & (k_abs <= r_end)
    if clamp:
        in_range = in_range & in_window
    return causal | in_range


@dataclass
class Pieces:
    """A step with frames as FA4 sees it (device views of the builder's buffers)."""

    query_start_loc: torch.Tensor   # int32 [P + 1]
    num_keys: torch.Tensor          # int32 [P]: FA4's seqused_k
    block_table: torch.Tensor       # int32 [P, width]: windowed page tables
    offsets: torch.Tensor           # int32 [P, 2]: absolute position of each piece's first query and key 0
    max_query_len: int


@dataclass
class PreparedCall:
    """One launch of a compiled FA4 kernel as its wrapper made it: `args` are the kernel's
    arguments, q, K and V first (what differs between the layers of a step)."""

    kernel: Callable
    args: list

    def launch(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        from flash_attn.cute.cute_dsl_utils import maybe_contiguous  # the wrapper's own canonical layout

        self.kernel(*(maybe_contiguous(t).detach() for t in (q, k_cache, v_cache)), *self.args[3:])


class _Recording:
    """Stands in for `_flash_attn_fwd.compile_cache` during one wrapper call (the three ways the
    wrapper uses it): the kernels it launches still run, each with its arguments kept."""

    def __init__(self, cache):
        self.cache, self.calls = cache, []

    def __contains__(self, key) -> bool:
        return key in self.cache

    def __setitem__(self, key, kernel) -> None:
        self.cache[key] = kernel

    def __getitem__(self, key) -> Callable:
        kernel = self.cache[key]

        def launch(*args):
            self.calls.append(PreparedCall(kernel, list(args)))
            return kernel(*args)
        return launch


def recorded_calls(run: Callable[[], object]) -> list[PreparedCall]:
    """The FA4 kernel launches `run` makes through the wrapper (none under FakeTensorMode, where
    FA4 compiles and launches nothing)."""
    from flash_attn.cute.interface import _flash_attn_fwd

    cache = _flash_attn_fwd.compile_cache
    recording = _flash_attn_fwd.compile_cache = _Recording(cache)
    try:
        run()
    finally:
        _flash_attn_fwd.compile_cache = cache
    return recording.calls


@dataclass
class Fa4Metadata:
    common: CommonAttentionMetadata
    out: torch.Tensor               # [max_num_tokens, H, D] preallocated output; FA4 writes the step's rows
    pieces: Pieces | None           # set when the step has frames on this layer type (the mask_mod path)
    calls: list[PreparedCall] = field(default_factory=list)   # the step's launches, recorded by its first layer


def run_fa4(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: Fa4Metadata,
            spec: LayerAttentionSpec) -> torch.Tensor:
    """FA4 over the paged cache into md.out: the step's first layer through FA4's wrapper
    (`wrapper_calls`, its launches recorded into md.calls), the others straight to the kernels."""
    out = md.out if md.out.shape[0] == q.shape[0] else md.out[: q.shape[0]]
    if md.calls:
        for call in md.calls:
            call.launch(q, k_cache, v_cache)
    else:
        md.calls = recorded_calls(lambda: wrapper_calls(q, k_cache, v_cache, out, md, spec))
    return out


def wrapper_calls(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                  md: Fa4Metadata, spec: LayerAttentionSpec) -> None:
    """FA4 varlen calls over the paged cache into `out`; the mask_mod path iff the step has pieces.

    At most SEQS_PER_CALL sequences (requests or pieces) per call: above FA4's batch-search threshold
    it switches to another scheduler, a second compile key that a long step (E2B/E4B reach 512
    pieces at an 8k budget) would compile mid-serving. Each call reads a slice of the step's
    cumulative query offsets, which stay absolute rows of q and out.

    FA4's internal entry point takes the output buffer (the public wrapper allocates its own); the
    pinned b36 is the version this is written against."""
    import cutlass
    from flash_attn.cute.interface import _flash_attn_fwd

    if md.pieces is None:
        c = md.common
        left = spec.window - 1 if spec.window is not None else None
        for a, n in call_slices(c.seq_lens.shape[0]):
            _flash_attn_fwd(q, k_cache, v_cache, cu_seqlens_q=c.query_start_loc.narrow(0, a, n + 1),
                            seqused_k=c.seq_lens.narrow(0, a, n), max_seqlen_q=c.max_query_len,
                            page_table=c.block_table.narrow(0, a, n), softmax_scale=spec.scale,
                            causal=True, window_size_left=left, window_size_right=0 if left is not None else None,
                            out=out)
        return
    p = md.pieces
    window = spec.window if spec.window is not None else NO_WINDOW
    for a, n in call_slices(p.num_keys.shape[0]):
        _flash_attn_fwd(q, k_cache, v_cache, cu_seqlens_q=p.query_start_loc.narrow(0, a, n + 1),
                        seqused_k=p.num_keys.narrow(0, a, n), max_seqlen_q=p.max_query_len,
                        page_table=p.block_table.narrow(0, a, n), softmax_scale=spec.scale, causal=False,
                        mask_mod=mm_prefix_mask_mod(spec.clamp_bidirectional),
                        aux_tensors=[md.common.query_ranges, p.offsets.narrow(0, a, n)],
                        aux_scalars=(cutlass.Int32(window),), out=out)


def call_slices(num_seqs: int) -> list[tuple[int, int]]:
    """(first, count) of at most SEQS_PER_CALL sequences each, covering 0..num_seqs."""
    return [(a, min(SEQS_PER_CALL, num_seqs - a)) for a in range(0, num_seqs, SEQS_PER_CALL)]


class Fa4MetadataBuilder:
    """Per step: nothing for frame-free steps; the windowed pieces for steps with frames; on SM90 a
    decode or verify step's split-KV plan (attention/split_kv.py: b36 cannot split the keys there)."""

    def __init__(self, pool: PoolConfig) -> None:
        spec = pool.spec
        if not fa4_runs(device_arch(pool.device), spec.head_dim, spec.head_dim, pool.dtype):
            raise ValueError(f"FA4 cannot run {spec.layer_type} (head dim {spec.head_dim}, {pool.dtype}) on "
                             f"{pool.device}; --attention-backend auto or fa4 gives such layer types to the "
                             f"batched fallback (attention/selection.py)")
        self.spec, self.block_size = spec, pool.block_size
        self.piece_len = piece_len(spec)
        most = pool.max_num_reqs + pool.max_num_tokens // self.piece_len
        self.query_start_loc = StagedBuffer((most + 1,), torch.int32, pool.device)
        self.num_keys = StagedBuffer((most,), torch.int32, pool.device)
        self.block_table = StagedBuffer((most, pool.max_blocks_per_req), torch.int32, pool.device)
        self.offsets = StagedBuffer((most, 2), torch.int32, pool.device)
        self.out = torch.empty(pool.max_num_tokens, spec.num_heads, spec.head_dim, dtype=pool.dtype,
                               device=pool.device)
        self.split_kv = planner_for(pool, "fa4")

    def build(self, common: CommonAttentionMetadata) -> Fa4Metadata | SplitKvMetadata:
        if self.split_kv is not None and decode_shaped(common):
            return self.split_kv.plan(common)
        if common.query_ranges_cpu is None or not self.spec.bidirectional:
            return Fa4Metadata(common, self.out, None)
        T, R = common.num_actual_tokens, common.num_reqs
        pieces = windowed_pieces(self.spec, self.block_size, common.query_start_loc_cpu.numpy(),
                                 common.seq_lens_cpu.numpy()[:R], common.positions_cpu.numpy(),
                                 common.query_ranges_cpu.numpy()[:T], common.block_table_cpu.numpy(),
                                 self.piece_len, self.block_table.np)
        P, width = pieces.num_pieces, pieces.block_table.shape[1]
        self.query_start_loc.np[: P + 1] = pieces.query_start_loc
        self.num_keys.np[:P] = pieces.num_keys
        self.offsets.np[:P, 0] = pieces.first_query
        self.offsets.np[:P, 1] = pieces.key_start
        table = self.block_table.dev[:P, :width]
        if self.block_table.dev is not self.block_table.cpu:   # only this step's columns cross to the device
            table.copy_(self.block_table.cpu[:P, :width], non_blocking=True)
        return Fa4Metadata(common, self.out, Pieces(self.query_start_loc.push(P + 1), self.num_keys.push(P), table,
                                                    self.offsets.push(P), int(np.diff(pieces.query_start_loc).max())))


class Fa4Impl:
    """AttentionImpl on FA4 (writes K/V, then attends into the builder's output buffer)."""

    def __init__(self, spec: LayerAttentionSpec) -> None:
        self.spec = spec

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
                metadata: Fa4Metadata | SplitKvMetadata) -> torch.Tensor:
        write_kv(kv_cache, k, v, metadata.common)
        if isinstance(metadata, SplitKvMetadata):
            return split_kv_attention(q, kv_cache[0], kv_cache[1], metadata, self.spec)
        return run_fa4(q, kv_cache[0], kv_cache[1], metadata, self.spec)


BACKEND = AttentionBackend("fa4", Fa4Impl, Fa4MetadataBuilder, cuda_graphs=True, device_positions=True)
