"""Top-p (the nucleus) without a sort: each row keeps the tokens whose probability reaches its
threshold t, the largest value with mass(probs >= t) >= top_p (the smallest set of top tokens
holding top_p; ties with t stay). Non-negative float32s order as their bit patterns, so t is found
by searching the patterns: on CUDA one Triton program per row (sample/nucleus_kernels.py, one
launch a step), elsewhere a bisection of 31 masked row sums over the batch. A start-up check turns
the kernel off on a GPU where it disagrees with the bisection (worker/backend_check.py)."""

from __future__ import annotations

import torch

_FLOAT32_BITS = 31   # a non-negative float32's bit pattern is below 2^31
KERNEL_PASSES = 16   # each pass quarters the search range: 4^16 > 2^31
KERNEL_BLOCK = 512   # tokens a program reads at a time (at most)

_kernel_enabled = True   # the process's choice: off after a failed start-up check


def use_kernel(enabled: bool) -> None:
    """Turn the Triton kernel on or off for every sampler in this process."""
    global _kernel_enabled
    _kernel_enabled = enabled


def nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [N, V] float32 (each row's distribution, summing to 1), top_p [N] -> keep [N, V]: each
    row's nucleus by bisection over the bit patterns (31 masked row sums, no sort, no host sync)."""
    bits = probs.contiguous().view(torch.int32)
    n = probs.shape[0]
    lo = torch.zeros(n, 1, dtype=torch.int32, device=probs.device)            # mass(>= 0) = 1 >= top_p
    hi = bits.max(dim=-1, keepdim=True).values + 1                          # mass(> max) = 0 < top_p
    target = top_p.to(probs.dtype).unsqueeze(1)
    for _ in range(_FLOAT32_BITS):
        mid = lo + (hi - lo) // 2
        reaches = torch.where(bits >= mid, probs, 0.0).sum(-1, keepdim=True) >= target
        lo, hi = torch.where(reaches, mid, lo), torch.where(reaches, hi, mid)
    return bits >= lo


def launch_nucleus_filter(probs: torch.Tensor, rows: torch.Tensor, top_p: torch.Tensor) -> None:
    """The Triton kernel itself (any device Triton runs on: its interpreter runs it on a CPU): zero,
    in place, the tokens outside the nucleus of probs' rows `rows` (int64 [n]; top_p float32 [n])."""
    from mmserve.sample.nucleus_kernels import nucleus_filter

    assert probs.dtype == torch.float32 and probs.stride(1) == 1
    if len(rows):
        vocab = probs.shape[1]
        block = min(KERNEL_BLOCK, 1 << max(7, (vocab - 1).bit_length()))   # a small vocabulary: one block
        nucleus_filter[(len(rows),)](probs, rows, top_p.to(torch.float32), vocab, probs.stride(0),
                                     BLOCK=block, PASSES=KERNEL_PASSES, num_warps=4)


def filter_nucleus(probs: torch.Tensor, rows: torch.Tensor, top_p: torch.Tensor) -> None:
    """Zero, in place, the tokens outside the nucleus of probs' rows `rows` (device indices; top_p
    [len(rows)]): the kernel on CUDA, else the bisection over those rows."""
    if probs.is_cuda and _kernel_enabled:
        launch_nucleus_filter(probs, rows, top_p)
        return
    sub = probs.index_select(0, rows)
    probs.index_copy_(0, rows, sub * nucleus(sub, top_p.to(probs.dtype)))
