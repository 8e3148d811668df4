"""--compile-dense: the engine's greedy tokens do not change, and the compiled RMSNorm / norm+RoPE /
gated GELU equal the eager ones. One test, so the kernels compile once (slow)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import PROMPTS, build_request, greedy_agree, make_llm, record_decisions

from mmserve.model import compiled
from mmserve.model.mlp import gelu_gate
from mmserve.model.norm import rms_norm
from mmserve.model.rope import norm_rope


@pytest.mark.slow
def test_compiled_dense_kernels_keep_tokens_and_values(load_backend):
    model_tok = load_backend("sdpa")
    # Two of each prompt: the first step has > MIN_TOKENS rows, so the compiled kernels run there.
    reqs = [build_request(f"{kind}{i}", parts, 3 + i) for kind, parts in PROMPTS.items() for i in range(2)]
    assert sum(len(r.prompt_token_ids) for r in reqs) > compiled.MIN_TOKENS
    eager = make_llm(model_tok, max_num_batched_tokens=256)
    decisions = record_decisions(eager)
    want = [c.token_ids for c in eager.generate(reqs)]
    try:
        got = [c.token_ids for c in make_llm(model_tok, max_num_batched_tokens=256, compile_dense=True).generate(reqs)]
        for r, ours, theirs in zip(reqs, got, want, strict=True):   # up to a near tie of the eager run's own
            greedy_agree(theirs, ours, decisions[r.request_id])
        assert rms_norm.compiled is not None and norm_rope.compiled is not None and gelu_gate.compiled is not None
        gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
        rows = compiled.MIN_TOKENS + 37   # a new row count: the dynamic graphs serve it without recompiling
        # Inputs of the kinds the engine passed (inference tensors; q and v views of one projection's
        # rows, heads of 16; the weights parameters; gate and up the halves of one projection): the
        # graphs its steps compiled serve them, where other kinds would make dynamo compile each again.
        w, hw = (torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (16, 72))
        with torch.inference_mode():
            q, _, v = torch.randn(rows, (4 + 2 + 2) * 16, generator=gen).split((4 * 16, 2 * 16, 2 * 16), dim=-1)
            q, v = q.view(rows, 4, 16), v.view(rows, 2, 16)
            cos, sin = torch.randn(rows, 16, generator=gen), torch.randn(rows, 16, generator=gen)
            h = torch.randn(rows, 72, generator=gen)
            gate, up = torch.randn(rows, 2 * 96, generator=gen).chunk(2, dim=-1)
            pairs = [(rms_norm(h, hw, 1e-6), rms_norm.eager(h, hw, 1e-6)),
                     (rms_norm(v, None, 1e-6), rms_norm.eager(v, None, 1e-6)),
                     (norm_rope(q, w, 1e-6, cos, sin), norm_rope.eager(q, w, 1e-6, cos, sin)),
                     (gelu_gate(gate, up), gelu_gate.eager(gate, up))]
    finally:
        compiled.set_compiled(False)
    for got_values, want_values in pairs:
        torch.testing.assert_close(got_values, want_values, rtol=1e-5, atol=1e-5)
