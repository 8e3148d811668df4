"""Attention accounting against the dense reference mask, window clamping, per-layer head dims,
tensor/pipeline splits and the `mmserve perf --json` contract."""

from __future__ import annotations

import json
import random

import pytest
import torch

from mmserve.attention.mask import keep
from mmserve.metrics.attention_pairs import kept_pairs, keys_touched
from mmserve.metrics.perf_model import PerfModel, RequestWork, StepContext
from mmserve.model.spec import load_spec

# A Gemma-4-31B-like text stack: sliding head_dim 256 with 16 KV heads, full head_dim 512 with 4, K=V.
G4 = dict(model_type="gemma4_text", hidden_size=5376, num_hidden_layers=60, num_attention_heads=32,
          num_key_value_heads=16, head_dim=256, global_head_dim=512, num_global_key_value_heads=4,
          attention_k_eq_v=True, sliding_window=1024, intermediate_size=21504, vocab_size=262144,
          hidden_size_per_layer_input=0, use_bidirectional_attention="vision")


def random_ranges(rng: random.Random, context: int) -> list[tuple[int, int]]:
    """Disjoint inclusive ranges inside [0, context)."""
    ranges, pos = [], rng.randint(0, 4)
    while pos < context - 1 and rng.random() < 0.8:
        end = min(context - 1, pos + rng.randint(0, 12))
        ranges.append((pos, end))
        pos = end + 1 + rng.randint(1, 6)
    return ranges


def dense_mask(n: int, c: int, window, ranges, bidirectional: bool, clamp: bool) -> torch.Tensor:
    q = torch.arange(c - n, c)[:, None]
    k = torch.arange(c)[None, :]
    r_start = torch.full_like(q, -1)
    r_end = torch.full_like(q, -1)
    for s, e in ranges:
        inside = (q >= s) & (q <= e)
        r_start[inside], r_end[inside] = s, e
    return keep(q, k, r_start, r_end, window=window, bidirectional=bidirectional, clamp=clamp)


def test_exact_pairs_equal_dense_mask_count():
    rng = random.Random()
    for _ in range(300):
        c = rng.randint(1, 90)
        n = rng.randint(1, c)
        window = rng.choice([None, rng.randint(1, 20)])
        ranges = random_ranges(rng, c)
        bidirectional, clamp = rng.random() < 0.7, rng.random() < 0.5
        mask = dense_mask(n, c, window, ranges, bidirectional, clamp)
        case = (n, c, window, ranges, bidirectional, clamp)
        assert kept_pairs(n, c, window, ranges, bidirectional=bidirectional, clamp=clamp) == int(mask.sum()), case
        assert keys_touched(n, c, window, ranges, bidirectional=bidirectional, clamp=clamp) == int(mask.any(0).sum()), case


def test_sliding_layers_clamp_to_the_window():
    shape = load_spec(G4)
    sliding = shape.attention_specs["sliding_attention"]
    exact = PerfModel(shape, accounting="exact")
    upper = PerfModel(shape, accounting="upper-bound")
    for context in (4096, 65536):
        for model in (exact, upper):
            got = model.step(StepContext((RequestWork(1, context, False),)))
            n_sliding = shape.layer_types.count("sliding_attention")
            # one decode token sees exactly `window` keys on every sliding layer, however long the context
            assert got.attn_flops_sliding == 2 * 2 * sliding.num_heads * sliding.head_dim * 1024 * n_sliding
    long_ctx = exact.step(StepContext((RequestWork(1, 65536, False),)))
    assert long_ctx.attn_flops_full == 2 * 2 * 32 * 512 * 65536 * 10  # full layers see all 65536 keys
    # prefill: exact counts the causal triangle; upper-bound bills n * min(c, W) per request
    n = 3000
    assert upper.step(StepContext((RequestWork(n, n, True),))).attn_flops_sliding == pytest.approx(
        exact.step(StepContext((RequestWork(n, n, True),))).attn_flops_sliding * n * 1024 / (n * 1024 - 1024 * 1023 / 2))


def test_per_layer_head_dims_and_k_eq_v():
    shape = load_spec(G4)
    sliding, full = shape.attention_specs["sliding_attention"], shape.attention_specs["full_attention"]
    n_s, n_f = shape.layer_types.count("sliding_attention"), shape.layer_types.count("full_attention")
    assert (sliding.head_dim, sliding.num_kv_heads, sliding.window) == (256, 16, 1024)
    assert (full.head_dim, full.num_kv_heads, full.window) == (512, 4, None)
    assert {layer.layer_type for layer in shape.layers if layer.k_eq_v} == {"full_attention"}
    assert (n_s, n_f) == (50, 10)
    assert sliding.bidirectional and not full.bidirectional
    tokens = random.randint(1, 512)
    got = PerfModel(shape).step(StepContext((RequestWork(tokens, tokens, True),)))
    hidden = 5376
    want = 2 * tokens * hidden * ((32 + 2 * 16) * 256 * n_s + (32 + 4) * 512 * n_f)  # full layers: no v_proj
    assert got.flops["attn.qkv_proj"] == want
    # the cache still holds K and V on K=V layers
    assert got.write_bytes["attn.kv_cache"] == tokens * 2 * 2 * (16 * 256 * n_s + 4 * 512 * n_f)


def test_pipeline_stages_sum_to_the_whole_model():
    cfg = dict(G4, num_hidden_layers=7, layer_types=["sliding_attention"] * 6 + ["full_attention"])
    shape = load_spec(cfg)
    ctx = StepContext((RequestWork(300, 900, True, ((700, 760),)), RequestWork(1, 5000, False)))
    whole = PerfModel(shape).step(ctx)
    for pp in (2, 3, 4):
        stage = PerfModel(shape, pp=pp).step(ctx, per_gpu=True)
        for kind in ("flops", "read_bytes", "write_bytes"):
            for key, value in getattr(whole, kind).items():
                assert getattr(stage, kind)[key] * pp == pytest.approx(value), (pp, kind, key)
        assert stage.attn_flops_full * pp == pytest.approx(whole.attn_flops_full)  # 1 full layer: 1/pp per stage


def test_tensor_parallel_divides_heads_and_widths():
    shape = load_spec(G4)
    ctx = StepContext((RequestWork(64, 64, True),))
    whole = PerfModel(shape).step(ctx)
    for tp in (2, 4):
        gpu = PerfModel(shape, tp=tp).step(ctx, per_gpu=True)
        for key in ("attn.attn_qk", "attn.out_proj", "ffn.dense_ffn", "unembed.unembed"):
            assert gpu.flops[key] * tp == pytest.approx(whole.flops[key]), key
    # 4 full-layer KV heads on 8 GPUs: each GPU keeps (a replica of) one head, never half a head
    gpu8 = PerfModel(shape, tp=8).step(ctx, per_gpu=True)
    assert gpu8.write_bytes["attn.kv_cache"] == 64 * 2 * 2 * (2 * 256 * 50 + 1 * 512 * 10)


def test_perf_cli_json_keys(tmp_path, capsys):
    from mmserve.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(G4))
    assert main(["perf", "--hf-config", str(path), "--tp", "2", "--request", "512:2048:prefill",
                 "--request", "1:4096:decode", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"flops", "read_bytes", "write_bytes"}
    assert {k for k in out["flops"] if k.startswith("attn.")} == {"attn.qkv_proj", "attn.attn_qk", "attn.attn_av", "attn.out_proj"}
    assert {k for k in out["read_bytes"] if k.startswith("attn.")} == {
        "attn.qkv_input", "attn.qkv_weight", "attn.attn_input", "attn.out_input", "attn.out_weight"}
    assert {k for k in out["write_bytes"] if k.startswith("attn.")} == {"attn.qkv_output", "attn.kv_cache", "attn.out_output"}
    assert {k.split(".")[0] for kind in out.values() for k in kind} == {"attn", "ffn", "unembed"}
    want = PerfModel(load_spec(G4), tp=2).step(
        StepContext((RequestWork(512, 2048, True), RequestWork(1, 4096, False))), per_gpu=True)
    assert out == json.loads(json.dumps(want.as_dict()))


def test_expert_weights_are_read_once_per_distinct_expert():
    """26B-A4B at its published dimensions: a step reads the weights of the experts it touched (as the
    model reports them), else at most min(experts, tokens * top_k) of them; routing FLOPs follow top_k."""
    from pathlib import Path

    spec = load_spec(Path(__file__).parents[1] / "fixtures" / "gemma4_family" / "26b_a4b.json")
    moe, hidden, layers = spec.layers[0].moe, spec.hidden_size, spec.num_layers
    model = PerfModel(spec)
    one_expert = 3 * hidden * moe.intermediate * 2 * layers   # gate, up, down in bf16, every layer
    for tokens, reported in ((1, None), (3, None), (64, None), (64, 37.5)):
        got = model.step(StepContext((RequestWork(tokens, 4096, False),), experts_touched=reported))
        weights = got.read_bytes["ffn.routed_up_gate_weight"] + got.read_bytes["ffn.routed_down_weight"]
        expected = reported if reported is not None else min(moe.num_experts, tokens * moe.top_k)
        assert weights == pytest.approx(expected * one_expert)
        assert got.flops["ffn.routed_ffn"] == 2 * tokens * moe.top_k * hidden * moe.intermediate * 3 * layers
        assert got.flops["ffn.router"] == 2 * tokens * hidden * moe.num_experts * layers


@pytest.mark.parametrize("name", ["e2b", "26b_a4b", "12b_unified"])
def test_perf_cli_reads_every_variant(name, capsys):
    """`mmserve perf` on published-dimension configs: E2B bills its per-layer embeddings and writes K/V
    for its 15 KV-holding layers only; the MoE bills routing; the 12B's encoder-free frames cost no
    encoder layers."""
    from pathlib import Path

    from mmserve.cli import main

    path = Path(__file__).parents[1] / "fixtures" / "gemma4_family" / f"{name}.json"
    assert main(["perf", "--hf-config", str(path), "--request", "1:8192:decode", "--frames", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    components = {k.split(".")[0] for kind in out.values() for k in kind}
    assert components == {"attn", "ffn", "unembed", "vision"} | ({"ple"} if name == "e2b" else set())
    if name == "e2b":   # bf16, one token: 12 sliding layers x 1 KV head x 256 + 3 full x 1 x 512, K and V
        assert out["write_bytes"]["attn.kv_cache"] == 2 * 2 * (12 * 256 + 3 * 512)
    if name == "26b_a4b":
        assert out["flops"]["ffn.router"] > 0
    if name == "12b_unified":
        assert "vision.qkv_proj" not in out["flops"] and out["flops"]["vision.patch_embed"] > 0


def test_perf_cli_refuses_other_architectures(tmp_path, capsys):
    from mmserve.cli import main

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    assert main(["perf", "--hf-config", str(tmp_path), "--request", "1:8:decode"]) == 2
    assert "model_type='llama'" in capsys.readouterr().err
