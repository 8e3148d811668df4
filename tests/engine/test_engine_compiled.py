"""Compiled code in the engine. --compile-dense: the greedy tokens do not change, and the compiled
RMSNorm / norm+RoPE / gated GELU equal the eager ones. The layer pieces (model/layer_pieces.py,
compiled on CUDA; here by inductor for the CPU): an E-model engine's tokens are the eager engine's,
each piece holds the graphs model/compiled.py says, and a piece past dynamo's recompile limit runs
eagerly. Slow: each test compiles once what it checks."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from engine_helpers import PROMPTS, build_request, greedy_agree, make_llm, record_decisions
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from mmserve.model import compiled, layer_pieces
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


def graphs_of(piece) -> int:
    """The graphs dynamo holds for a layer piece (one cache entry each)."""
    return len(_debug_get_cache_entry_list(piece.__wrapped__.__code__))


@pytest.mark.slow
def test_layer_pieces_hold_a_graph_per_row_regime_and_layer_kind_over_any_kv_cache(tmp_path, monkeypatch):
    """An E-model engine (sliding / full layers, each projecting K/V or sharing them; single and
    double-wide MLPs) with the pieces compiled, as on CUDA, and graphs emulated, so steps run as
    piecewise graphs (their inputs the runner's persistent buffers) and eagerly (the KV-sharing
    layers' sampled rows), at one row and more; then a second engine over a KV cache of another size,
    as the memory profile's pools and then the serving ones. Each piece holds one graph per row
    regime and layer kind (compiled.py), whatever the cache's size or the step's path: before, a new
    block count (attn_in) and the piecewise buffers' tensor kind (input_norm, mlp_in) each compiled
    again. The tokens are the eager engine's."""
    from gemma4_fixtures import e_model_config, make_checkpoint

    from mmserve.model import load_model
    from mmserve.model.tokenizer import load_tokenizer
    from mmserve.worker import model_runner

    make_checkpoint(tmp_path, config=e_model_config(audio=False), seed=int(np.random.randint(1000)))
    model_tok = load_model(tmp_path, dtype="float32", device="cpu"), load_tokenizer(tmp_path)
    reqs = [build_request(f"r{i}", [3 + 5 * i], int(np.random.randint(1000)), max_tokens=5) for i in range(4)]
    eager = make_llm(model_tok, max_num_batched_tokens=32)
    decisions = record_decisions(eager)
    want = {c.request_id: c.token_ids for c in eager.generate(reqs)}
    pieces = (layer_pieces.input_norm, layer_pieces.attn_in, layer_pieces.mlp_in, layer_pieces.layer_out)
    for piece in pieces:   # another test's model may have compiled them in this process
        torch._dynamo.reset_code(piece.__wrapped__.__code__)
    monkeypatch.setattr(model_runner, "set_compiled", lambda dense, layers: compiled.set_compiled(dense, layers=True))
    try:
        for num_kv_blocks in (48, 80):
            llm = make_llm(model_tok, max_num_batched_tokens=32, num_kv_blocks=num_kv_blocks, emulate_cuda_graphs=True)
            got = {c.request_id: c.token_ids for c in llm.generate(reqs)}
            for r in reqs:
                greedy_agree(want[r.request_id], got[r.request_id], decisions[r.request_id])
            assert llm.core.runner.piecewise.replays > 0
    finally:
        compiled.set_compiled(False)
    # row regimes (one row, more) x kinds: attn_in 4 (sliding / full x projecting / sharing), mlp_in 2
    assert {p.__name__: graphs_of(p) for p in pieces} == {"input_norm": 2, "attn_in": 8, "mlp_in": 4, "layer_out": 2}
    assert 2 * 8 <= compiled.PIECE_GRAPHS <= torch._dynamo.config.recompile_limit


@pytest.mark.slow
def test_a_piece_past_the_recompile_limit_runs_eagerly_and_says_so(monkeypatch, caplog):
    """fullgraph=True makes dynamo raise past its recompile limit where it would otherwise run the
    function eagerly: the step failed (FailOnRecompileLimitHit). Now the piece runs eagerly from then
    on, with one warning. (Limit 1: a graph for one row, then three rows would need another.)"""
    monkeypatch.setattr(compiled, "PIECE_GRAPHS", 1)

    @compiled.layer_piece(token_args=1)
    def scaled_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return rms_norm.eager(x, w, 1e-6)

    w = torch.randn(8)
    inputs = [torch.randn(rows, 8) for rows in (1, 3, 1, 5)]
    compiled.set_compiled(False, layers=True)
    try:
        with (torch._dynamo.config.patch(recompile_limit=1), torch.inference_mode(),
              caplog.at_level(logging.WARNING, logger=compiled.__name__)):
            got = [scaled_norm(x, w) for x in inputs]
    finally:
        compiled.set_compiled(False)
    for x, values in zip(inputs, got, strict=True):
        torch.testing.assert_close(values, rms_norm.eager(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    assert scaled_norm.over_limit and graphs_of(scaled_norm) == 1
    warned = [r.getMessage() for r in caplog.records if r.name == compiled.__name__]
    assert len(warned) == 1 and "scaled_norm" in warned[0] and "eagerly" in warned[0], warned
