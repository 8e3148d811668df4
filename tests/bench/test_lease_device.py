"""gpu_check's floors and memory plans follow the device a lease lends, not one kind's constants.

The readings are this workplace's (KINDS.md): an H100 copies ~3.0 TB/s and multiplies bf16 at ~798
TFLOP/s in ~78 GiB, an H200 ~4.3 TB/s and ~790 TFLOP/s in ~139 GiB. The arithmetic runs on them as
fake readings; the measurement itself (`lease_device.measure`) runs in the smoke run, on the CPU.
"""

from __future__ import annotations

import json

import pytest
from bench_scripts import bench_script

from mmserve.ipc.protocol import KvCapacity

GIB = 2**30


@pytest.fixture(scope="module")
def gpu_check():
    with bench_script("gpu_check") as module:
        yield module


def readings(lease_device, name: str, copy: float, gemm: float, memory_gib: float, sheet: tuple | None):
    return lease_device.Ceilings(name, copy, gemm, 0.01, *(sheet or (None, None)), 132, int(memory_gib * GIB), "fake")


@pytest.fixture(scope="module")
def kinds(gpu_check):
    import lease_device

    return {"h100": readings(lease_device, "NVIDIA H100 80GB HBM3", 3.0e12, 798e12, 79.1, (3.35e12, 989.4e12)),
            "h200": readings(lease_device, "NVIDIA H200", 4.3e12, 790e12, 139.8, (4.8e12, 989.4e12)),
            "off_table": readings(lease_device, "NVIDIA X", 1.0e12, 100e12, 40, None)}


def test_a_decode_steps_floor_is_its_bytes_over_the_devices_own_copy_bandwidth(kinds):
    """The 12B's decode step at batch 64 moves ~27.7 GB: 9.2 ms on an H100, 6.4 ms on an H200. With
    the H200's 4.3 TB/s hard-coded an H100 step would be held to a floor 1.43x too low."""
    step_bytes, seconds = 27.7e9, 12e-3
    h100, h200 = (kinds[k].against_floors(seconds, nbytes=step_bytes) for k in ("h100", "h200"))
    assert h100["floor_ms"] == pytest.approx(step_bytes / 3.0e12 * 1e3)
    assert h200["floor_ms"] == pytest.approx(step_bytes / 4.3e12 * 1e3)
    assert h100["over_floor"] == pytest.approx(seconds / (step_bytes / 3.0e12))
    assert h100["over_floor"] < h200["over_floor"] and h100["bound"] == h200["bound"] == "bytes"
    # the datasheet's peaks beside: the H100 SXM's 3.35 TB/s, a floor below the measured one
    assert h100["datasheet_floor_ms"] == pytest.approx(step_bytes / 3.35e12 * 1e3)
    assert h100["datasheet_floor_ms"] < h100["floor_ms"]
    assert h100["over_datasheet_floor"] == pytest.approx(seconds / (step_bytes / 3.35e12))


def test_a_mixed_steps_floor_is_the_larger_of_its_two_terms(kinds):
    """A 2048-token chunk beside 63 decodes: ~50 TFLOP and ~26 GB. The FLOP term bounds it on both
    kinds; bytes alone bound a step with few FLOPs."""
    flops, nbytes = 50e12, 26e9
    for kind, gemm in (("h100", 798e12), ("h200", 790e12)):
        c = kinds[kind]
        assert c.floor_s(nbytes, flops) == pytest.approx(flops / gemm)
        assert c.against_floors(0.1, nbytes, flops)["bound"] == "flops"
        assert c.floor_s(nbytes, 1e9) == pytest.approx(nbytes / c.copy_bytes_per_s)
        assert c.floor_s(flops=flops, datasheet=True) == pytest.approx(flops / 989.4e12)


def test_a_device_off_the_datasheet_table_keeps_its_measured_floor(kinds):
    c = kinds["off_table"]
    floors = c.against_floors(0.02, nbytes=10e9)
    assert floors["floor_ms"] == pytest.approx(10.0) and floors["over_floor"] == pytest.approx(2.0)
    assert floors["datasheet_floor_ms"] is None and floors["over_datasheet_floor"] is None
    record = c.record()
    assert record["device"] == "NVIDIA X" and record["copy_TBps"] == 1.0 and record["memory_gib"] == 40
    json.dumps(record)   # every section's JSON carries it


def test_a_sections_kv_cache_is_what_the_device_holds_beside_the_checkpoint(gpu_check):
    """mixed asks 32 GiB: the 12B gets it on both kinds; the 26B-A4B (48.1 GiB of weights) gets what
    an H100 has left beside them; a checkpoint of 75 GiB gets nothing on an H100. (The 31B's 58.3 GiB
    leaves ~14 GiB, which passes this check: its engine refuses only after loading, docs/benchmarks.md.)"""
    import lease_device

    kv, headroom = lease_device.kv_cache_bytes, lease_device.ENGINE_HEADROOM
    h100_free, h200_free = int(78.5 * GIB), int(139 * GIB)
    assert kv(32 * GIB, int(22.3 * GIB), h100_free) == kv(32 * GIB, int(22.3 * GIB), h200_free) == 32 * GIB
    assert kv(32 * GIB, int(48.1 * GIB), h100_free) == h100_free - int(48.1 * GIB) - headroom
    assert kv(32 * GIB, int(48.1 * GIB), h200_free) == 32 * GIB
    assert kv(32 * GIB, int(75 * GIB), h100_free) == 0


def test_an_engine_that_would_not_fit_fails_its_section_before_loading(gpu_check, tmp_path, monkeypatch):
    """engine_kv_cache reads the checkpoint's size from its files and the device's free memory: a
    checkpoint too large for this kind stops the section with the kind it needs, before a load."""
    (tmp_path / "model-00001.safetensors").write_bytes(b"")
    import os

    os.truncate(tmp_path / "model-00001.safetensors", 60 * GIB)   # sparse: no disk used
    monkeypatch.setattr(gpu_check.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(gpu_check.torch.cuda, "mem_get_info", lambda: (int(78.5 * GIB), int(79.1 * GIB)))
    assert gpu_check.engine_kv_cache(tmp_path, 8) == 8 * GIB
    assert gpu_check.engine_kv_cache(tmp_path, 16) == int(78.5 * GIB) - 60 * GIB - 6 * GIB
    monkeypatch.setattr(gpu_check.torch.cuda, "mem_get_info", lambda: (int(66.5 * GIB), int(79.1 * GIB)))
    with pytest.raises(RuntimeError, match="needs a device with more memory"):
        gpu_check.engine_kv_cache(tmp_path, 8)


def test_capacity_sends_what_the_sized_cache_holds(gpu_check):
    """Issue 36's 64 x 8k on the 12B: an H200's profiled cache holds them all; an H100's (an estimate
    of its full-attention pool) about 33; a cache seating fewer requests sends that many."""
    def cache(full_tokens: int, seats: int) -> KvCapacity:
        return KvCapacity({"full_attention": full_tokens, "sliding_attention": 100_000}, 1, 0, seats, "profile")

    assert gpu_check.capacity_requests(cache(3_114_800, 128), 64, 8192, 16) == 64
    assert gpu_check.capacity_requests(cache(273_392, 113), 64, 8192, 16) == 273_392 // 8208 == 33
    assert gpu_check.capacity_requests(cache(3_114_800, 20), 64, 8192, 16) == 20


def test_a_gpu_runs_ceilings_come_from_its_own_properties_and_the_datasheet_row_of_its_name(gpu_check, monkeypatch):
    """measure() on CUDA, its calibration and device properties faked: the measured rates as read,
    SMs and memory from the device, the datasheet row its name selects (an H100 SXM's, an H200's)."""
    import types

    import lease_device

    from mmserve.metrics import peaks

    def fake_gpu(name: str, copy: float, gemm: float, sms: int, memory: int):
        monkeypatch.setattr(peaks, "calibrate_accelerator",
                            lambda device, dtype: peaks.DevicePeaks(name, gemm, copy, "calibrated", dtype, 0.02))
        monkeypatch.setattr(lease_device.torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(
            name=name, multi_processor_count=sms, total_memory=memory))
        monkeypatch.setattr(lease_device.torch.cuda, "empty_cache", lambda: None)
        return lease_device.measure("cuda")

    h100 = fake_gpu("NVIDIA H100 80GB HBM3", 3.0e12, 798e12, 132, 81559 * 2**20)
    assert (h100.copy_bytes_per_s, h100.gemm_flops, h100.spread) == (3.0e12, 798e12, 0.02)
    assert (h100.datasheet_bytes_per_s, h100.datasheet_flops) == (3.35e12, 989.4e12)
    assert (h100.sms, h100.memory_bytes) == (132, 81559 * 2**20) and "8192^3 bf16 GEMM" in h100.method
    h200 = fake_gpu("NVIDIA H200", 4.3e12, 790e12, 132, 143771 * 2**20)
    assert h200.datasheet_bytes_per_s == 4.8e12 and h200.memory_bytes == 143771 * 2**20
    unknown = fake_gpu("NVIDIA Z9", 1e12, 1e14, 48, 24 * GIB)
    assert unknown.sms == 48 and unknown.datasheet_bytes_per_s is None and unknown.datasheet_flops is None
