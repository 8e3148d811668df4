"""The Triton kernel of the top-p filter on CUDA (sample/nucleus.py launches it).

`nucleus_filter`: one program per top-p row. A row's nucleus threshold t is the largest float32
bit pattern with mass(probs >= t) >= top_p (non-negative floats order as their bits). The program
searches for it four ways at a time: each pass over the row sums the mass at three thresholds
splitting [lo, hi) in quarters (the invariant: mass(lo) reaches top_p, mass(hi) does not), so 16
passes narrow 2^31 patterns to one; a last pass zeroes the row's tokens below t in place. The row
(1 MiB at a 262k vocabulary) is read 18 times by one program, from L2 after the first; the torch
bisection it replaces on CUDA is 31 rounds of three full-batch ops each (~240 launches a step and
~30 reads and writes of every nucleus row's probabilities). Reductions go through tl.reduce with
the combine functions of mmserve/triton_combine.py, not tl.max / tl.sum, so
tests/engine/test_sampler_nucleus.py runs it in Triton's interpreter in any process; it also
compiles it for sm_90a.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mmserve.triton_combine import add, maximum


@triton.jit
def nucleus_filter(probs_ptr, rows_ptr, top_p_ptr, vocab, stride, BLOCK: tl.constexpr, PASSES: tl.constexpr):
    i = tl.program_id(0)
    base = probs_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride
    target = tl.load(top_p_ptr + i)
    offsets = tl.arange(0, BLOCK)
    top = tl.full((BLOCK,), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        p = tl.load(base + start + offsets, mask=start + offsets < vocab, other=0.0)
        top = tl.maximum(top, p.to(tl.int32, bitcast=True))
    hi = tl.reduce(top, 0, maximum) + 1   # mass(>= hi) = 0 < top_p
    lo = hi * 0                    # mass(>= 0) = the row's mass >= top_p
    quarter = tl.arange(0, 4)
    for _ in range(PASSES):
        step = (hi - lo + 3) // 4
        thresholds = lo + quarter * step   # [4]; the first is lo itself, known to reach
        mass = tl.full((4,), 0.0, tl.float32)
        for start in range(0, vocab, BLOCK):
            p = tl.load(base + start + offsets, mask=start + offsets < vocab, other=0.0)
            bits = p.to(tl.int32, bitcast=True)
            mass += tl.reduce(tl.where(bits[None, :] >= thresholds[:, None], p[None, :], 0.0), 1, add)
        reached = (quarter > 0) & (thresholds < hi) & (mass >= target)
        lo = lo + tl.reduce(reached.to(tl.int32), 0, add) * step
        hi = tl.minimum(lo + step, hi)
    for start in range(0, vocab, BLOCK):
        mask = start + offsets < vocab
        p = tl.load(base + start + offsets, mask=mask, other=0.0)
        tl.store(base + start + offsets, tl.where(p.to(tl.int32, bitcast=True) >= lo, p, 0.0), mask=mask)
