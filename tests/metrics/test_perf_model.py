"""Attention accounting against the dense reference mask, window clamping, per-layer head dims,
tensor/pipeline splits, communication bytes and the `mmserve perf --json` contract. (The
communication bytes against the collectives a real TP=2 model calls: tests/model/test_model_tensor_parallel.py.)"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from mmserve.attention.mask import keep
from mmserve.metrics.attention_pairs import kept_pairs, keys_touched
from mmserve.metrics.perf_model import DraftWork, PerfModel, RequestWork, StepContext, VisionWork
from mmserve.model.spec import load_spec

# A Gemma-4-31B-like text stack: sliding head_dim 256 with 16 KV heads, full head_dim 512 with 4, K=V.
G4 = dict(model_type="gemma4_text", hidden_size=5376, num_hidden_layers=60, num_attention_heads=32,
          num_key_value_heads=16, head_dim=256, global_head_dim=512, num_global_key_value_heads=4,
          attention_k_eq_v=True, sliding_window=1024, intermediate_size=21504, vocab_size=262144,
          hidden_size_per_layer_input=0, use_bidirectional_attention="vision")
FAMILY = Path(__file__).parents[1] / "fixtures" / "gemma4_family"


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
    rng = random.Random(random.getrandbits(64))
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
    assert set(out) == {"flops", "read_bytes", "write_bytes", "comm_bytes"}
    assert {k for k in out["flops"] if k.startswith("attn.")} == {"attn.qkv_proj", "attn.attn_qk", "attn.attn_av", "attn.out_proj"}
    assert {k for k in out["read_bytes"] if k.startswith("attn.")} == {
        "attn.qkv_input", "attn.qkv_weight", "attn.attn_input", "attn.out_input", "attn.out_weight"}
    assert {k for k in out["write_bytes"] if k.startswith("attn.")} == {"attn.qkv_output", "attn.kv_cache", "attn.out_output"}
    assert {k.split(".")[0] for kind in out.values() for k in kind} == {"attn", "ffn", "unembed", "comm"}
    want = PerfModel(load_spec(G4), tp=2).step(
        StepContext((RequestWork(512, 2048, True), RequestWork(1, 4096, False))), per_gpu=True)
    assert out == json.loads(json.dumps(want.as_dict()))


def test_perf_cli_lists_comm_bytes_at_tp_above_1(capsys):
    from mmserve.cli import main

    args = ["perf", "--hf-config", str(FAMILY / "31b.json"), "--request", "64:64:prefill"]
    assert main(args) == 0
    assert "comm" not in capsys.readouterr().out
    assert main(args + ["--tp", "4"]) == 0
    out = capsys.readouterr().out
    want = PerfModel(load_spec(FAMILY / "31b.json"), tp=4).step(StepContext((RequestWork(64, 64, True),)), per_gpu=True)
    assert f"comm bytes sent (interconnect, not in MBU): {want.total_comm_bytes:.4g}" in out
    assert f"comm.o_proj_all_reduce       {want.comm_bytes['comm.o_proj_all_reduce']:.4g}" in out


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



@pytest.mark.parametrize("name", ["e2b", "26b_a4b", "31b"])
def test_one_gpu_communicates_nothing(name):
    """At tp=1 (and in the whole-model view at any tp) no comm item exists, drafting included; at
    tp=2 each collective site appears, and none of it is in the HBM bytes MBU divides."""
    spec = load_spec(FAMILY / f"{name}.json")
    ctx = StepContext((RequestWork(300, 900, True), RequestWork(1, 4000, False)),
                      images=(VisionWork(spec.vision.default_patches),))
    for model, per_gpu in ((PerfModel(spec), True), (PerfModel(spec, tp=4), False)):
        got = model.step(ctx, per_gpu=per_gpu)
        assert got.comm_bytes == {} and got.total_comm_bytes == 0 and got.component("comm").as_dict()["flops"] == {}
    one, two = PerfModel(spec).step(ctx, per_gpu=True), PerfModel(spec, tp=2).step(ctx, per_gpu=True)
    sites = {"comm.embed_all_reduce", "comm.o_proj_all_reduce", "comm.mlp_all_reduce", "comm.logits_all_gather"}
    sites |= {"comm.ple_all_gather"} if name == "e2b" else {"comm.moe_all_reduce"} if name == "26b_a4b" else set()
    assert set(two.comm_bytes) == sites
    assert two.total_bytes < one.total_bytes   # the comm bytes did not leak into read/write


def test_ring_bytes_per_gpu():
    """31B decode at batch 64: per layer and row the o_proj all-reduce moves hidden x 2 bytes, of which
    each GPU sends 2(tp-1)/tp; the logits' all-gather (the gathered bf16 rows) (tp-1)/tp."""
    spec = load_spec(FAMILY / "31b.json")
    ctx = StepContext(tuple(RequestWork(1, 4096, False) for _ in range(64)))
    for tp in (2, 4, 8):
        got = PerfModel(spec, tp=tp).step(ctx, per_gpu=True).comm_bytes
        assert got["comm.o_proj_all_reduce"] == 2 * (tp - 1) / tp * 64 * 5376 * 2 * 60
        assert got["comm.mlp_all_reduce"] == got["comm.o_proj_all_reduce"]
        assert got["comm.embed_all_reduce"] == 2 * (tp - 1) / tp * 64 * 5376 * 2
        assert got["comm.logits_all_gather"] == (tp - 1) / tp * 64 * 262144 * 2


def test_a_verify_chunk_runs_kv_sharing_layers_on_every_row():
    """E2B: beside a prefill chunk, KV-sharing layers run its last row only; a verify chunk in the
    step (a decode request of 1 + K tokens) makes the runner take the full path, so they run every
    row of the step, the prefill chunk's included (worker/model_runner.py)."""
    spec = load_spec(FAMILY / "e2b.json")
    model = PerfModel(spec, tp=2)
    prefill, decode, verify = RequestWork(100, 100, True), RequestWork(1, 50, False), RequestWork(4, 50, False)
    consumers = sum(layer.shares_kv for layer in spec.layers)
    per_row = 2 * (2 - 1) / 2 * spec.hidden_size * 2   # one row's o_proj all-reduce, bytes a GPU sends, per layer
    plain = model.step(StepContext((prefill, decode)), per_gpu=True).comm_bytes["comm.o_proj_all_reduce"]
    assert plain == per_row * (101 * (spec.num_layers - consumers) + 2 * consumers)
    mixed = model.step(StepContext((prefill, verify)), per_gpu=True).comm_bytes["comm.o_proj_all_reduce"]
    assert mixed == per_row * 104 * spec.num_layers


def test_constrained_drafting_broadcasts_the_drafts():
    """A drafting round with a constrained request broadcasts each draft step's R int64 ids."""
    from mmserve.model.assistant_spec import AssistantSpec, DraftAttention

    spec = load_spec(FAMILY / "31b.json")
    drafter = AssistantSpec("gemma4_assistant", ("sliding_attention",), {"sliding_attention": DraftAttention(8, 16, 256, 512)},
                            {}, 1024, 5376, 4096, 262144, 1e-6, True, False, 0, 0)
    model = PerfModel(spec, tp=4, drafter=drafter)
    free = [DraftWork(3, 1000), DraftWork(3, 2000)]
    plain = model.step(StepContext(drafts=tuple(free)), per_gpu=True).comm_bytes
    assert "comm.drafter_token_broadcast" not in plain
    constrained = model.step(StepContext(drafts=(free[0], DraftWork(3, 2000, constrained=True))), per_gpu=True).comm_bytes
    assert constrained.pop("comm.drafter_token_broadcast") == 3 * 2 * 8 * 3 / 4
    assert constrained == plain


def test_perf_cli_mfu_mbu_in_json_and_unknown_devices_listed(tmp_path, capsys):
    """--json dropped MFU/MBU; an unknown --device said only that it was unknown."""
    from mmserve.cli import main
    from mmserve.metrics.peaks import lookup

    path = tmp_path / "config.json"
    path.write_text(json.dumps(G4))
    args = ["perf", "--hf-config", str(path), "--request", "512:2048:prefill", "--device", "H100", "--step-time-ms", "4"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    peaks = lookup("H100")
    want = PerfModel(load_spec(G4)).step(StepContext((RequestWork(512, 2048, True),)), per_gpu=True)
    assert out["mfu"] == pytest.approx(want.total_flops / 4e-3 / peaks.flops)
    assert out["mbu"] == pytest.approx(want.total_bytes / 4e-3 / peaks.bandwidth)
    assert main(args) == 0
    assert f"MFU {100 * out['mfu']:.1f}%  MBU {100 * out['mbu']:.1f}%" in capsys.readouterr().out
    assert main(args[:-4] + ["--device", "TPU v5", "--step-time-ms", "4"]) == 2
    assert "'TPU v5'" in (err := capsys.readouterr().err) and "H100" in err and "A100 80GB" in err
    assert main(args[:-2]) == 2 and "--step-time-ms" in capsys.readouterr().err
