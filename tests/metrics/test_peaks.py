"""Device peaks: table lookup by the names torch reports, env overrides, the cached CPU calibration,
and MFU/MBU that are never silently above 100%."""

from __future__ import annotations

import logging
import random

import pytest

from mmserve.metrics import peaks
from mmserve.metrics.peaks import DevicePeaks, calibrate_cpu, detect, lookup, utilization


@pytest.mark.parametrize("name, bf16, fp32, bandwidth", [
    ("NVIDIA H100 80GB HBM3", 989.4e12, 66.9e12, 3.35e12),
    ("NVIDIA H100 PCIe", 756e12, 51.2e12, 2.0e12),
    ("NVIDIA H100 NVL", 835e12, 60e12, 3.9e12),
    ("NVIDIA H200", 989.4e12, 66.9e12, 4.8e12),
    ("NVIDIA A100-SXM4-80GB", 312e12, 19.5e12, 2.039e12),
    ("NVIDIA A100-SXM4-40GB", 312e12, 19.5e12, 1.555e12),
    ("NVIDIA A100 80GB PCIe", 312e12, 19.5e12, 1.935e12),
    ("NVIDIA A100-PCIE-40GB", 312e12, 19.5e12, 1.555e12),
    ("NVIDIA B200", 2.25e15, 75e12, 8.0e12),
    ("NVIDIA L40S", 362.05e12, 91.6e12, 864e9),
    ("NVIDIA L4", 121e12, 30.3e12, 300e9),
])
def test_table_lookup_by_device_name(name, bf16, fp32, bandwidth):
    got = lookup(name, "bfloat16")
    assert (got.flops, got.bandwidth, got.source) == (bf16, bandwidth, "table")
    assert lookup(name, "float16").flops == bf16
    assert lookup(name, "float32").flops == fp32


def test_unknown_device_has_no_entry():
    assert lookup("Tesla T4") is None


def test_cpu_calibration_is_measured_once_and_env_overrides_it(monkeypatch):
    monkeypatch.delenv(peaks.ENV_PEAK_FLOPS, raising=False)
    monkeypatch.delenv(peaks.ENV_PEAK_BANDWIDTH, raising=False)
    first = calibrate_cpu("float32")
    assert first is calibrate_cpu("float32")
    assert first.flops > 1e6 and first.bandwidth > 1e6 and first.source == "calibrated"
    assert detect("cpu", "float32") == first
    flops, bandwidth = random.uniform(1e12, 1e15), random.uniform(1e11, 1e13)
    monkeypatch.setenv(peaks.ENV_PEAK_FLOPS, str(flops))
    monkeypatch.setenv(peaks.ENV_PEAK_BANDWIDTH, str(bandwidth))
    assert detect("cpu", "float32") == DevicePeaks("cpu", flops, bandwidth, "env")


def test_utilization_above_one_is_reported_and_logged(caplog):
    amount, seconds, peak = random.uniform(1, 100), random.uniform(0.1, 1), random.uniform(1, 10)
    assert utilization(amount, seconds, peak, "MFU-test-a") == pytest.approx(amount / (seconds * peak))
    over = 2.5 * seconds * peak
    with caplog.at_level(logging.WARNING, logger="mmserve.metrics.peaks"):
        assert utilization(over, seconds, peak, "MFU-test-b") == pytest.approx(2.5)
    assert any("exceeds 100%" in r.getMessage() and "MFU-test-b" in r.getMessage() for r in caplog.records)
    assert utilization(1.0, 0.0, peak, "MFU-test-c") == 0.0


@pytest.mark.gpu
def test_cuda_device_is_in_the_table(monkeypatch):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: checks that the device's name maps to a table entry")
    monkeypatch.delenv(peaks.ENV_PEAK_FLOPS, raising=False)
    monkeypatch.delenv(peaks.ENV_PEAK_BANDWIDTH, raising=False)
    got = detect("cuda", "bfloat16")
    assert got.source == "table", f"{torch.cuda.get_device_name()} has no peak table entry"
    assert got.name == torch.cuda.get_device_name()
