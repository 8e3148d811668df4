"""bench/kernel_count.py: a dense decoder layer's decode step on the CUDA code path (layer pieces
compiled by inductor, here for the CPU) launches at most 12 kernels, and the count is honest: the
same layer with one piece left uncompiled (its norms, residual add and GELU unfused) counts more.
The compiled pieces also compute what the eager ones do, on fresh random inputs (one compile serves
both checks; slow)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from bench_scripts import bench_script
from transformers import Gemma4Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from gemma4_fixtures import tiny_config  # noqa: E402

from mmserve.model import compiled, decoder, layer_pieces  # noqa: E402
from mmserve.model.spec import load_spec  # noqa: E402

MAX_DENSE = 12   # #34: kernels per dense layer per decode step


@pytest.fixture(scope="module")
def kernel_count():
    with bench_script("kernel_count") as module:
        yield module


def test_a_built_layer_holds_its_constructors_buffers(kernel_count):
    """build_layer allocates on the meta device and draws only the parameters: its buffers must be
    the constructor's. An uninitialised layer_scalar (1e34, 0: whatever the memory held) scaled the
    outputs the compiled pieces are compared on, so the comparison failed or compared zeros."""
    spec = load_spec(Gemma4Config(**tiny_config(window=6)))
    for kind, layer in kernel_count.layer_kinds(spec).items():
        built = dict(kernel_count.build_layer(spec, layer, torch.float32).named_buffers())
        real = dict(decoder.DecoderLayer(spec, layer, kernel_count.StubAttention()).named_buffers())
        assert built.keys() == real.keys(), kind
        assert all(torch.equal(built[name], real[name]) for name in real), (kind, built)


@pytest.mark.slow
def test_a_dense_layer_fits_twelve_kernels_and_unfusing_counts_more(kernel_count, monkeypatch):
    spec = load_spec(Gemma4Config(**tiny_config(window=6)))
    kind, layer = next((k, v) for k, v in kernel_count.layer_kinds(spec).items() if k == "sliding_attention")
    fused = kernel_count.count_layer("tiny", spec, kind, layer, rows=1, dtype=torch.float32)
    assert fused.total <= MAX_DENSE, fused
    assert fused.line() == f"tiny sliding_attention: {fused.total} kernels per layer"
    # attn_in: qkv GEMM, one fused kernel (q/k norm + RoPE, v norm, K/V scatter); mlp_in: norms, gate/up
    # GEMM, GELU x up, down GEMM; layer_out: one kernel (post-FFN norm, residual, scalar, next input norm)
    assert [len(fused.pieces[p]) for p in ("attn_in", "mlp_in", "layer_out")] == [2, 4, 1], fused.pieces
    assert fused.eager == ["linear"], "o_proj is the only launch outside the pieces"

    # The compiled pieces (compiled just now, for one row) equal the eager ones on fresh inputs.
    module = kernel_count.build_layer(spec, layer, torch.float32)
    attn = spec.attention_specs[layer.layer_type]
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    h, o, cos, sin = (torch.randn(1, n, generator=gen)
                      for n in (spec.hidden_size, spec.hidden_size, attn.head_dim, attn.head_dim))
    a = module.self_attn
    for piece, args in [
        (layer_pieces.attn_in, lambda cache: (h, cos, sin, torch.tensor([5]), a.qkv_proj.weight, a.q_norm.weight,
                                              a.k_norm.weight, cache, 1e-6, tuple(a.split), a.head_dim)),
        (layer_pieces.mlp_in, lambda cache: (h, o, module.post_attention_layernorm.weight,
                                             module.pre_feedforward_layernorm.weight,
                                             module.mlp.gate_up_proj.weight, module.mlp.down_proj.weight, 1e-6)),
    ]:
        caches = [torch.zeros(2, 3, 4, attn.num_kv_heads, attn.head_dim) for _ in range(2)]
        with torch.inference_mode():
            got, want = piece.compiled(*args(caches[0])), piece.eager(*args(caches[1]))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(caches[0], caches[1], rtol=1e-5, atol=1e-5)   # the K/V written in place

    # Unfused: mlp_in runs eagerly (its norms, residual add and GELU each one launch): the count rises.
    monkeypatch.setattr(kernel_count, "PIECES", ("attn_in", "layer_out"))
    monkeypatch.setattr(decoder, "mlp_in", layer_pieces.mlp_in.eager)
    unfused = kernel_count.count_layer("tiny", spec, kind, layer, rows=1, dtype=torch.float32)
    assert unfused.total > fused.total + 4, (unfused.eager, fused.pieces["mlp_in"])
    assert compiled.layers_compiled() is False   # the count leaves the process as it found it


MAX_MOE = 18   # #34: kernels per MoE layer per decode step


@pytest.mark.slow
def test_a_moe_layer_fits_eighteen_kernels_and_its_piece_computes_the_eager_one(kernel_count, monkeypatch):
    """A MoE layer (experts beside the dense MLP, as 26B-A4B): its dense MLP, router and dispatch are
    one piece (`mlp_moe_in`), grouped by a counting sort (no sort, no index_add, no softmax over all
    experts, no scan: a decode step's pairs are ranked pairwise); compiled, it equals its eager self on fresh inputs, the CUDA dispatch (grouped GEMMs)
    in both (`_grouped_mm` takes bf16 only, so bf16: within its rounding), the touched count included
    (one decode row: the graph the count compiled serves the check too)."""
    from gemma4_fixtures import moe_config

    from mmserve.model import moe

    cfg = moe_config()
    cfg["text_config"]["moe_intermediate_size"] = 32   # _grouped_mm wants 16-byte row strides
    spec = load_spec(Gemma4Config(**cfg))
    kind, layer = next((k, v) for k, v in kernel_count.layer_kinds(spec).items() if k.endswith("moe"))
    fused = kernel_count.count_layer("tiny", spec, kind, layer, rows=1, dtype=torch.bfloat16)
    assert fused.total <= MAX_MOE, fused
    launched = fused.pieces["mlp_moe_in"]
    # no sort, scatter-add, softmax over all experts, or scan (decode's pairs are ranked pairwise)
    assert not any(k in name for name in launched for k in ("sort", "index_add", "_softmax__to_copy_1", "cumsum")), \
        launched

    module = kernel_count.build_layer(spec, layer, torch.bfloat16)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    h, o = (torch.randn(1, spec.hidden_size, generator=gen).bfloat16() for _ in range(2))
    r, e = module.moe.router, module.moe.experts
    touched = [torch.zeros((), dtype=torch.int64) for _ in range(2)]

    def args(count):
        return (h, o, module.post_attention_layernorm.weight, module.pre_feedforward_layernorm.weight,
                module.mlp.gate_up_proj.weight, module.mlp.down_proj.weight, r.scale, r.proj.weight,
                r.per_expert_scale, module.moe.pre_feedforward_layernorm_2.weight, e.gate_up_proj, e.down_proj, count,
                1e-6, r.top_k, 0, False)
    monkeypatch.setattr(moe, "uses_grouped_mm", lambda x: True)
    compiled.set_compiled(False, layers=True)
    try:
        with torch.inference_mode():
            got, want = moe.mlp_moe_in(*args(touched[0])), moe.mlp_moe_in.eager(*args(touched[1]))
    finally:
        compiled.set_compiled(False)
    for a, b in zip(got, want, strict=True):
        assert float((a.float() - b.float()).abs().max()) <= 2e-2 * float(b.float().abs().max())
    assert int(touched[0]) == int(touched[1]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 16])
def test_an_e_model_layer_fits_twelve_kernels_and_its_ple_fusion_counts(kernel_count, monkeypatch, rows):
    """An E-model layer (per-layer input, as E2B/E4B) at one decode row and at 16 (a batch's decode
    step): PLE's projection takes GELU x input into itself, so layer_out counts at most 4 launches
    (post-FFN norm + residual, the gate GEMM, the projection, its norm + residual + next input norm;
    at one row the C++ backend runs the last two as one loop nest: 3) and the layer at most 12. At
    one row the projection is a reduction with GELU x input in its loads; at more rows it is
    `ple.gated_projection`, one launch (on CUDA our Triton kernel, the operand in its prologue;
    tests/model/test_model_ple_kernel.py checks its numerics). The compiled piece equals the eager one
    on fresh inputs; with the projection a GEMM again (checked at one row: one compile fewer) the
    count rises by the unfused GELU x input."""
    from gemma4_fixtures import e_model_config

    spec = load_spec(Gemma4Config(**e_model_config(audio=False)))
    kind, layer = next((k, v) for k, v in kernel_count.layer_kinds(spec).items() if k == "sliding_attention")
    fused = kernel_count.count_layer("tiny", spec, kind, layer, rows=rows, dtype=torch.float32)
    assert fused.total <= MAX_DENSE, fused
    assert len(fused.pieces["layer_out"]) <= (3 if rows == 1 else 4), fused.pieces["layer_out"]
    assert not any("gelu_mul" in name for name in fused.pieces["layer_out"]), fused.pieces["layer_out"]

    # The compiled piece (compiled just now, for this row count) equals the eager one on fresh inputs.
    module = kernel_count.build_layer(spec, layer, torch.float32)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    h, ffn = (torch.randn(rows, spec.hidden_size, generator=gen) for _ in range(2))
    layer_input = torch.randn(rows, 3, spec.ple.dim, generator=gen)[:, 1]   # strided, as the decoder slices it
    p = module.ple
    args = (h, ffn, None, layer_input, module.post_feedforward_layernorm.weight, module.layer_scalar, None,
            (p.per_layer_input_gate.weight, p.per_layer_projection.weight, p.post_per_layer_input_norm.weight),
            module.input_layernorm.weight, 1e-6)
    compiled.set_compiled(False, layers=True)
    try:
        with torch.inference_mode():
            got, want = layer_pieces.layer_out(*args), layer_pieces.layer_out.eager(*args)
    finally:
        compiled.set_compiled(False)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    if rows > 1:
        return
    # Unfused: the projection a GEMM at every row count (GELU x input its own kernel): the count rises.
    monkeypatch.setattr(layer_pieces, "ple_projection",
                        lambda gate, layer_input, proj_w: torch.nn.functional.linear(
                            torch.nn.functional.gelu(gate, approximate="tanh") * layer_input, proj_w))
    unfused = kernel_count.count_layer("tiny", spec, kind, layer, rows=rows, dtype=torch.float32)
    assert unfused.total > fused.total, (unfused.pieces["layer_out"], fused.pieces["layer_out"])
    assert any("gelu_mul" in name for name in unfused.pieces["layer_out"]), unfused.pieces["layer_out"]
