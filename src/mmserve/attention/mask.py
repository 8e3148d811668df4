"""The one definition of which keys a query attends to; every backend and test derives from it.

    keep(q, k) = (k <= q and q - k < W) or (r_start(q) <= k <= r_end(q) and (not clamp or q - k < W))

`keep` accepts Python ints or broadcastable tensors, so the naive per-pair check in tests and the
vectorised batch builder below run the very same expression.
"""

from __future__ import annotations

import torch

from mmserve.attention.backend import CommonAttentionMetadata, LayerAttentionSpec

# A window no context reaches: the kernels that take the window as a number get this for "none".
NO_WINDOW = 2**30


def keep(q, k, r_start, r_end, *, window, bidirectional: bool, clamp):
    """keep(q, k) for absolute positions q, k and q's own inclusive range [r_start, r_end] ((-1, -1) = none).

    window: int, None (infinite) or a 0-d tensor; clamp: bool or a 0-d bool tensor. Compiled
    backends pass tensors so one graph serves every window and clamp setting.
    """
    in_window = True if window is None else (q - k) < window
    causal = (k <= q) & in_window
    if not bidirectional:
        return causal
    in_range = (r_start <= k) & (k <= r_end)
    if isinstance(clamp, torch.Tensor):
        in_range = in_range & (in_window | ~clamp)
    elif clamp:
        in_range = in_range & in_window
    return causal | in_range


def keep_for_spec(q, k, r_start, r_end, spec: LayerAttentionSpec):
    return keep(q, k, r_start, r_end, window=spec.window, bidirectional=spec.bidirectional,
                clamp=spec.clamp_bidirectional)


def keep_into(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, r_start: torch.Tensor | None,
              r_end: torch.Tensor | None, spec: LayerAttentionSpec, scratch: list[torch.Tensor]) -> torch.Tensor:
    """keep_for_spec written into `out` (bool, the broadcast shape of q - k) without allocating: the
    metadata builders' form of the same rule. `scratch` is one int64 and three bool tensors of out's
    shape; r_start/r_end None means no query row lies in a range."""
    diff, in_window, in_range, tmp = scratch
    torch.sub(q, k, out=diff)                       # q - k
    torch.ge(diff, 0, out=out)                      # k <= q
    if spec.window is not None:
        torch.lt(diff, spec.window, out=in_window)  # q - k < W
        out &= in_window
    if spec.bidirectional and r_start is not None:
        torch.ge(k, r_start, out=in_range)
        in_range &= torch.le(k, r_end, out=tmp)
        if spec.window is not None and spec.clamp_bidirectional:
            in_range &= in_window
        out |= in_range
    return out


def token_request_ids(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Request index of each flattened query token, without a Python loop."""
    tokens = torch.arange(num_tokens, device=query_start_loc.device)
    return torch.searchsorted(query_start_loc[1:].to(torch.int64), tokens, right=True)


def key_valid(metadata: CommonAttentionMetadata, num_keys: int) -> torch.Tensor:
    """[num_reqs, num_keys] bool: key position exists in the request and its block is not the null block 0."""
    k = torch.arange(num_keys, device=metadata.block_table.device)
    valid = k[None, :] < metadata.seq_lens[:, None].to(torch.int64)
    block_idx = (k // metadata.block_size).clamp(max=metadata.block_table.shape[1] - 1)
    return valid & (metadata.block_table[:, block_idx] != 0)


def batch_dense_mask(metadata: CommonAttentionMetadata, spec: LayerAttentionSpec, num_keys: int | None = None) -> torch.Tensor:
    """[T, num_keys] bool: row i is query token i's mask over its own request's key positions 0..num_keys-1."""
    num_keys = metadata.max_seq_len if num_keys is None else num_keys
    T = metadata.num_actual_tokens
    q = metadata.positions[:T].to(torch.int64)[:, None]
    k = torch.arange(num_keys, device=q.device)[None, :]
    if metadata.query_ranges is not None and spec.bidirectional:
        ranges = metadata.query_ranges[:T].to(torch.int64)
        r_start, r_end = ranges[:, 0:1], ranges[:, 1:2]
    else:
        r_start = r_end = torch.full_like(q, -1)
    mask = keep_for_spec(q, k, r_start, r_end, spec)
    req = token_request_ids(metadata.query_start_loc, T)
    return mask & key_valid(metadata, num_keys)[req]


def key_bounds(md: CommonAttentionMetadata, spec: LayerAttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive [lo, hi] key positions each query row of a step may keep (int64 [T] each, on the
    metadata's device; `page_tables.key_bounds_np` is the host twin over numpy arrays)."""
    T = md.num_actual_tokens
    q = md.positions[:T].long()
    req = token_request_ids(md.query_start_loc, T)
    hi = q.clone()
    lo = (q - spec.window + 1).clamp(min=0) if spec.window is not None else torch.zeros_like(q)
    if md.query_ranges is not None and spec.bidirectional:
        rs, re = md.query_ranges[:T, 0].long(), md.query_ranges[:T, 1].long()
        inside = rs >= 0
        hi = torch.where(inside, torch.maximum(hi, re), hi)
        if not spec.clamp_bidirectional:
            lo = torch.where(inside, torch.minimum(lo, rs), lo)
    return lo, torch.minimum(hi, md.seq_lens.long()[req] - 1)
