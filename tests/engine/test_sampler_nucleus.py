"""The top-p kernel (sample/nucleus_kernels.py, launched by sample/nucleus.filter_nucleus on CUDA)
without a GPU.

Numerics: Triton's interpreter runs the kernel on fresh random rows against the nucleus's definition
by a float64 sort (the mass strictly above a kept token is below top_p; ties at the edge stay), with
top_p placed half a token's probability from any prefix's mass, so the set is the same whatever order
float32 sums run in; with the vocabulary a partial block and several blocks, ties, rows that top-k
zeroed, and rows not asked for left bit for bit as they were. The torch bisection (the CPU path and
the kernel's fallback) is held to the same reference. Compilation: the kernel compiles for sm_90a
(Triton's GPU compiler and ptxas). The start-up check passes the kernel and turns a wrong one off.
"""

from __future__ import annotations

import random

import pytest
import torch
from triton_interpreter import interpreted_kernels, reload_kernels

from mmserve.sample import nucleus

triton = pytest.importorskip("triton", reason="triton (the fa4-check extra) runs the top-p kernel")

KERNELS = "mmserve.sample.nucleus_kernels"


@pytest.fixture
def interpreted(monkeypatch):
    yield from interpreted_kernels(monkeypatch, KERNELS)


def sorted_nucleus(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """keep [V]: the tokens the mass strictly above which is below top_p, by a float64 sort."""
    wide = row.double()
    ordered = torch.sort(wide, descending=True).values
    above = torch.cumsum(ordered, 0) - ordered   # mass strictly above each sorted position (ties: the first)
    first_of_value = torch.ones_like(ordered, dtype=torch.bool)
    first_of_value[1:] = ordered[1:] != ordered[:-1]
    threshold = ordered[(above < top_p) & first_of_value].min()
    return wide >= threshold


def unambiguous_top_p(row: torch.Tensor, rng: random.Random) -> float:
    """A top_p half a token's probability past the mass of one of the row's top prefixes (a token of
    at least 1e-3), so float32 sums in any order agree which tokens reach it."""
    ordered = torch.sort(row.double(), descending=True).values
    big = int((ordered >= 1e-3).sum())
    j = rng.randrange(max(big, 1))
    return float(ordered[:j].sum() + ordered[j] / 2)


def random_rows(rng: random.Random, n: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randn(n, vocab, generator=gen) * rng.choice([1.0, 3.0, 6.0])
    logits[::3, 5:40] = logits[::3, :1]                    # ties, some at the nucleus' edge
    logits[1::4, vocab // 2:] = float("-inf")             # rows top-k cut: zeros the search must skip
    return torch.softmax(logits, dim=-1)


@pytest.mark.parametrize("vocab,rows,asked", [(200, 4, 2), (700, 2, 1)])   # one block; a full block and a partial one
def test_the_kernel_keeps_each_rows_nucleus(interpreted, vocab, rows, asked):
    """(Few rows: the interpreter takes ~0.1 s a block and pass.)"""
    rng = random.Random(random.randrange(2**31))
    probs = random_rows(rng, rows, vocab)
    asked = sorted(rng.sample(range(rows), asked))         # the others not asked for
    top_p = torch.tensor([unambiguous_top_p(probs[r], rng) for r in asked], dtype=torch.float32)
    got = probs.clone()
    nucleus.launch_nucleus_filter(got, torch.tensor(asked), top_p)
    for i, r in enumerate(asked):
        keep = sorted_nucleus(probs[r], float(top_p[i]))
        assert torch.equal(got[r], torch.where(keep, probs[r], 0.0)), (r, float(top_p[i]))
    for r in set(range(rows)) - set(asked):
        assert torch.equal(got[r], probs[r])


def test_the_bisection_keeps_each_rows_nucleus():
    """The path off CUDA (and the kernel's fallback), against the same reference."""
    rng = random.Random(random.randrange(2**31))
    probs = random_rows(rng, 9, 700)
    top_p = torch.tensor([unambiguous_top_p(row, rng) for row in probs], dtype=torch.float32)
    got = probs.clone()
    nucleus.filter_nucleus(got, torch.arange(9), top_p)
    for r in range(9):
        assert torch.equal(got[r] > 0, sorted_nucleus(probs[r], float(top_p[r])) & (probs[r] > 0)), r


def test_a_tiny_top_p_keeps_the_largest_token_and_its_ties(interpreted):
    probs = torch.softmax(torch.randn(1, 100), dim=-1)
    largest = int(probs.argmax())
    tie = (largest + 50) % 100
    probs[0, tie] = probs[0, largest]
    got = probs.clone()
    nucleus.launch_nucleus_filter(got, torch.arange(1), torch.full((1,), 1e-6))
    assert (got[0] > 0).nonzero().flatten().tolist() == sorted([largest, tie])


@pytest.mark.slow
def test_the_kernel_compiles_for_sm90(monkeypatch):
    """Triton's GPU compiler (through ptxas to a cubin) for sm_90a with the launch's block and
    passes: a loop-carried value of the wrong type or a block past the registers fails here."""
    from triton.backends.compiler import GPUTarget

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fn = reload_kernels(KERNELS).nucleus_filter
    constexprs = dict(BLOCK=nucleus.KERNEL_BLOCK, PASSES=nucleus.KERNEL_PASSES)
    signature = dict(zip(fn.arg_names, ["*fp32", "*i64", "*fp32", "i32", "i32"] + ["constexpr"] * 2, strict=True))
    kernel = triton.compile(triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "cubin" in kernel.asm


def test_the_start_up_check_passes_the_kernel(interpreted):
    from mmserve.worker.backend_check import check_nucleus_kernel

    nucleus.use_kernel(False)
    try:
        [check] = check_nucleus_kernel(100, torch.device("cpu"), strict=True)
        assert (check.component, check.running, check.reason) == ("top_p", "triton", "")
        assert nucleus._kernel_enabled
    finally:
        nucleus.use_kernel(True)


@pytest.mark.parametrize("broken", ["one more token", "a row not asked for", "launch error"])
def test_a_kernel_that_fails_its_start_up_check_is_turned_off_or_refused(monkeypatch, broken):
    """A GPU unlike the ones tested: a kernel that keeps one token too many (the class of an
    off-by-one in the search), writes a row no one asked for, or cannot launch is turned off with the
    reason recorded, or fails the start under --strict-backends; the sampler then bisects. (The
    broken kernels are the bisection, broken: the interpreter is too slow to run them here.)"""
    from mmserve.worker.backend_check import BackendCheckError, check_nucleus_kernel

    def wrong(probs, rows, top_p):
        if broken == "launch error":
            raise RuntimeError("no kernel image is available for execution on the device")
        before = probs.clone()
        sub = probs.index_select(0, rows)
        probs.index_copy_(0, rows, sub * nucleus.nucleus(sub, top_p))
        for r in rows.tolist():   # the largest dropped token comes back
            dropped = torch.where(probs[r] == 0, before[r], 0.0)
            probs[r, dropped.argmax()] = dropped.max()
        if broken == "a row not asked for":
            probs[0] = probs[rows[0]]

    monkeypatch.setattr(nucleus, "launch_nucleus_filter", wrong)
    try:
        [check] = check_nucleus_kernel(100, torch.device("cpu"), strict=False)
        assert check.running == "torch" and check.fell_back and "1 rows" in check.reason, check
        assert not nucleus._kernel_enabled
        with pytest.raises(BackendCheckError, match="top_p"):
            check_nucleus_kernel(100, torch.device("cpu"), strict=True)
    finally:
        nucleus.use_kernel(True)
