"""bench/gpu_check.py survives its first lease: caches sized from the step, a report written after
each section (a run killed at its limit still returns what it finished), graph runs that replayed
no graph fail, and any section runs alone. The GPU numbers themselves need a GPU."""

from __future__ import annotations

import json

import pytest
from bench_scripts import bench_script

from mmserve.attention.synthetic import Req, make_batch


@pytest.fixture(scope="module")
def gpu_check():
    with bench_script("gpu_check") as module:
        yield module


def test_the_compiles_decode_step_at_64_frames_fits_its_cache(gpu_check):
    """5 requests of ~19.2k tokens need 6,007 blocks; the old fixed 4,096 raised 'cache too small'."""
    reqs = [Req(300 * 64 + 7 * i, 1) for i in range(1 + 64 % 5)]
    needed = sum(-(-r.seq_len // 16) for r in reqs)
    assert needed > 4096 and gpu_check.blocks_for(reqs) > needed
    small = gpu_check.replace(gpu_check.SMOKE.sliding, num_heads=1, num_kv_heads=1, head_dim=8)
    batch = make_batch(reqs, small, num_blocks=gpu_check.blocks_for(reqs), table_width=2048)
    assert batch.kv_cache.shape[1] == gpu_check.blocks_for(reqs)


def test_each_section_is_on_disk_before_the_next_starts(gpu_check, tmp_path, monkeypatch):
    out = tmp_path / "report.json"
    seen = {}

    def first(sizes, device):
        return {"ok": True, "value": 1}

    def second(sizes, device):
        seen.update(json.loads(out.read_text())["sections"])
        raise RuntimeError("killed here")

    monkeypatch.setattr(gpu_check, "SECTIONS", {"first": first, "second": second, "third": first})
    assert gpu_check.main(["--smoke", "--out", str(out)]) == 1
    assert seen["first"]["value"] == 1 and "second" not in seen
    report = json.loads(out.read_text())
    assert "killed here" in report["sections"]["second"]["error"] and report["sections"]["third"]["ok"]
    assert not list(tmp_path.glob("*.partial"))


def test_only_runs_one_section(gpu_check, tmp_path):
    out = tmp_path / "fallback.json"
    assert gpu_check.main(["--smoke", "--only", "fallback", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["sections"]) == ["fallback"] and "--only fallback" in report["command"]
    rows = {r["step"]: r for r in report["sections"]["fallback"]["rows"]}
    for row in rows.values():
        assert row["flex_kv_bytes"] >= row["needed_kv_bytes"] and row["sdpa_kv_bytes"] >= row["needed_kv_bytes"]
    # one request's keys: flex runs one program on them, split-KV spreads them over its splits
    assert rows["decode_1"]["flex_programs"] == 1 < rows["decode_1"]["split_kv_programs"]
    # the section carries the device it ran on, as measured at the run's start (lease_device.py)
    device = report["sections"]["fallback"]["device"]
    assert device == report["machine"]["ceilings"] and device["copy_bytes_per_s"] > 0 < device["gemm_flops"]


def test_fallback_plans_split_kv_over_the_given_multiprocessors(gpu_check, monkeypatch):
    """Split-KV's grid is two programs per SM: the plans follow the SM count, not one kind's 132
    (its one-request decode alone, at 8k context, and split-KV's plan alone: all of the section's take
    ~25 s to plan on this CPU)."""
    steps = gpu_check.fallback_steps
    monkeypatch.setattr(gpu_check, "fallback_steps", lambda *_: {"decode_1": steps(1024, 64, 4)["decode_1"]})
    monkeypatch.setattr(gpu_check, "fallback_variants", lambda step: ("split_kv",))

    def decode_1_programs(sms: int) -> int:
        rows = gpu_check.fallback_plans(sms)
        return next(r["split_kv_programs"] for r in rows if r["model"] == "12b" and r["step"] == "decode_1")

    assert decode_1_programs(132) > decode_1_programs(16)


def test_a_graph_run_that_replayed_no_graph_fails(gpu_check):
    """On every device: the CPU smoke run's graph runs are emulated ones, which replay as CUDA's do."""
    assert not gpu_check.graphs_ran({"graphs_enabled": False, "graph_replays": 0})
    assert not gpu_check.graphs_ran({"graphs_enabled": True, "graph_replays": 0})
    assert gpu_check.graphs_ran({"graphs_enabled": True, "graph_replays": 3})


def test_the_collectives_section_times_an_all_reduce_per_member_and_phase(gpu_check, tmp_path):
    """On the smoke run a single-rank gloo group stands in for the GPU's NCCL one: every family
    member's width at the decode and prefill row counts, and the group torn down afterwards."""
    import torch.distributed as dist

    out = tmp_path / "collectives.json"
    assert gpu_check.main(["--smoke", "--only", "collectives", "--out", str(out)]) == 0
    assert not dist.is_initialized()
    section = json.loads(out.read_text())["sections"]["collectives"]
    rows = section["rows"]
    assert {(r["model"], r["phase"]) for r in rows} == {(m, p) for m in gpu_check.TP_MEMBERS
                                                        for p in ("decode", "prefill")}
    for r in rows:
        layout = gpu_check.tp_layout(r["model"])
        assert r["bytes"] == r["rows"] * layout["hidden"] * 4 and r["all_reduce_ms"] > 0
        assert r["per_step_ms"] > r["per_layer_us"] / 1e3
        assert r["nvlink_tp2_per_layer_us"] < r["nvlink_tp8_per_layer_us"]
    assert gpu_check.tp_layout("26b_a4b")["per_layer"] == 3 and gpu_check.tp_layout("31b")["per_layer"] == 2


def test_only_runs_the_sections_in_its_order(gpu_check, tmp_path, monkeypatch):
    """A lease call lists its slowest section last, so a call cut at its limit keeps the others."""
    ran = []

    def section(name):
        return lambda sizes, device: ran.append(name) or {"ok": True}

    monkeypatch.setattr(gpu_check, "SECTIONS", {n: section(n) for n in ("a", "b", "c")})
    assert gpu_check.main(["--smoke", "--only", "c", "a", "--out", str(tmp_path / "r.json")]) == 0
    assert ran == ["c", "a"] and list(json.loads((tmp_path / "r.json").read_text())["sections"]) == ["c", "a"]


def test_parity_on_a_gpu_fails_unless_fa4_and_flex_were_chosen(gpu_check):
    """Without FA4 `auto` gives flex to both layer types, and parity would pass without FA4."""
    sliding, full = gpu_check.SLIDING, gpu_check.FULL
    assert gpu_check.backends_as_planned({sliding: "fa4", full: "flex"}, "cuda")
    assert not gpu_check.backends_as_planned({sliding: "flex", full: "flex"}, "cuda")
    assert not gpu_check.backends_as_planned({sliding: "fa4", full: "sdpa"}, "cuda")
    assert gpu_check.backends_as_planned({sliding: "sdpa", full: "sdpa"}, "cpu")   # the smoke run's stand-ins


def test_the_profile_section_counts_kernels_per_step_and_layer_and_splits_gemm_time(gpu_check, tmp_path):
    """The smoke run profiles the demo-sized model's decode steps (CPU ops standing in for kernels);
    the table's arithmetic on CUDA-like kernel names: GEMMs (cuBLAS/CUTLASS names) apart from the rest."""
    out = tmp_path / "profile.json"
    assert gpu_check.main(["--smoke", "--only", "profile", "--out", str(out)]) == 0
    section = json.loads(out.read_text())["sections"]["profile"]
    assert section["ok"] and [r["batch"] for r in section["rows"]] == [2]
    row = section["rows"][0]
    assert row["kernels_per_step"] > 0 and row["kernels_per_layer"] == row["kernels_per_step"] / section["layers"]
    assert 0 < len(row["top"]) <= gpu_check.TOP_KERNELS
    kernels = [("sm90_xmma_gemm_bf16bf16_bf16f32", 0.030), ("triton_per_fused_add_mean_mul_pow_0", 0.002),
               ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 0.020), ("flash_fwd_kernel", 0.010)] * gpu_check.PROFILE_STEPS
    table = gpu_check.kernel_table(kernels, layers=2)
    assert table["kernels_per_step"] == 4 and table["kernels_per_layer"] == 2
    assert table["gemm_ms_per_step"] == pytest.approx(0.050) and table["other_ms_per_step"] == pytest.approx(0.012)
    assert table["top"][0]["name"].startswith("sm90_xmma_gemm") and table["top"][0]["calls_per_step"] == 1
