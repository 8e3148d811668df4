"""--compile-dense: the engine's greedy tokens do not change, and the compiled RMSNorm / norm+RoPE /
gated GELU equal the eager ones. One test, so the kernels compile once (slow)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import PROMPTS, build_request, make_llm

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
    want = [c.token_ids for c in make_llm(model_tok, max_num_batched_tokens=256).generate(reqs)]
    try:
        got = [c.token_ids for c in make_llm(model_tok, max_num_batched_tokens=256, compile_dense=True).generate(reqs)]
        assert got == want
        assert rms_norm.compiled is not None and norm_rope.compiled is not None and gelu_gate.compiled is not None
        gen = torch.Generator().manual_seed(torch.seed() % 2**31)
        rows = compiled.MIN_TOKENS + 37   # a new row count: the dynamic graphs serve it without recompiling
        x, w = torch.randn(rows, 4, 16, generator=gen), torch.randn(16, generator=gen)
        cos, sin = torch.randn(rows, 16, generator=gen), torch.randn(rows, 16, generator=gen)
        h, hw = torch.randn(rows, 72, generator=gen), torch.randn(72, generator=gen)
        gate, up = torch.randn(rows, 96, generator=gen), torch.randn(rows, 96, generator=gen)
        with torch.inference_mode():
            pairs = [(rms_norm(h, hw, 1e-6), rms_norm.eager(h, hw, 1e-6)),
                     (rms_norm(x, None, 1e-6), rms_norm.eager(x, None, 1e-6)),
                     (norm_rope(x, w, 1e-6, cos, sin), norm_rope.eager(x, w, 1e-6, cos, sin)),
                     (gelu_gate(gate, up), gelu_gate.eager(gate, up))]
    finally:
        compiled.set_compiled(False)
    for got_values, want_values in pairs:
        torch.testing.assert_close(got_values, want_values, rtol=1e-5, atol=1e-5)
