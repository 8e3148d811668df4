"""Peak FLOP/s and memory bandwidth of the device, the denominators of MFU and MBU.

Datasheets headline 2:4-sparse tensor throughput; MFU must divide by the *dense* figure or it comes
out at half the truth. The table lists dense numbers per SKU (NVIDIA datasheets, per GPU). The fp32
column is the non-tensor-core FP32 rate (TF32 is a different, lower-precision mode). Environment
variables override whatever was detected: MMSERVE_PEAK_FLOPS (FLOP/s) and MMSERVE_PEAK_BANDWIDTH
(bytes/s). On a CPU there is no datasheet to trust, so a short matmul and a large copy are timed once
per process and used as the peaks (MFU/MBU on CPU then mean "share of what this host sustains").
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ENV_PEAK_FLOPS = "MMSERVE_PEAK_FLOPS"
ENV_PEAK_BANDWIDTH = "MMSERVE_PEAK_BANDWIDTH"


@dataclass(frozen=True)
class DevicePeaks:
    name: str
    flops: float        # dense FLOP/s for the dtype in use
    bandwidth: float    # bytes/s
    source: str         # "table", "env", "calibrated"


@dataclass(frozen=True)
class _Sku:
    bf16: float   # dense bf16 == fp16 tensor FLOP/s
    fp32: float
    bandwidth: float


# Ordered: the first pattern that matches the device name wins, so specific names come first.
_TABLE: tuple[tuple[str, _Sku], ...] = (
    (r"GB200", _Sku(2.5e15, 80e12, 8.0e12)),
    (r"B200", _Sku(2.25e15, 75e12, 8.0e12)),
    (r"H200 NVL", _Sku(835e12, 60e12, 4.8e12)),
    (r"H200", _Sku(989.4e12, 66.9e12, 4.8e12)),
    (r"H100 NVL", _Sku(835e12, 60e12, 3.9e12)),
    (r"H100 PCIe", _Sku(756e12, 51.2e12, 2.0e12)),
    (r"H100", _Sku(989.4e12, 66.9e12, 3.35e12)),        # SXM5 ("NVIDIA H100 80GB HBM3")
    (r"H20\b", _Sku(148e12, 44e12, 4.0e12)),
    (r"A100.*PCIe.*40GB", _Sku(312e12, 19.5e12, 1.555e12)),
    (r"A100.*80GB.*PCIe", _Sku(312e12, 19.5e12, 1.935e12)),
    (r"A100.*80GB", _Sku(312e12, 19.5e12, 2.039e12)),   # SXM4 80GB
    (r"A100", _Sku(312e12, 19.5e12, 1.555e12)),         # SXM4 40GB
    (r"L40S", _Sku(362.05e12, 91.6e12, 864e9)),
    (r"L40", _Sku(181.05e12, 90.5e12, 864e9)),
    (r"L4\b", _Sku(121e12, 30.3e12, 300e9)),
    (r"A10\b", _Sku(125e12, 31.2e12, 600e9)),
    (r"A30", _Sku(165e12, 10.3e12, 933e9)),
)


def lookup(device_name: str, dtype: str = "bfloat16") -> DevicePeaks | None:
    """Table peaks for a CUDA device name (as torch.cuda.get_device_name() reports it), or None."""
    for pattern, sku in _TABLE:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            flops = sku.fp32 if dtype == "float32" else sku.bf16
            return DevicePeaks(device_name, flops, sku.bandwidth, "table")
    return None


@functools.cache
def calibrate_cpu(dtype: str = "float32") -> DevicePeaks:
    """Measured CPU peaks: best of a few square matmuls and of a few 64 MiB copies (cached per process)."""
    import torch

    tdtype = getattr(torch, dtype)
    n = 512
    a, b = torch.randn(n, n, dtype=tdtype), torch.randn(n, n, dtype=tdtype)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    flops = 2 * n ** 3 / best
    src = torch.empty(16 * 2 ** 20, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    bandwidth = 2 * src.numel() * src.element_size() / best  # a copy reads and writes every byte
    logger.info("calibrated CPU peaks: %.3g FLOP/s (%s matmul), %.3g B/s (copy)", flops, dtype, bandwidth)
    return DevicePeaks("cpu", flops, bandwidth, "calibrated")


def detect(device: str = "auto", dtype: str = "bfloat16") -> DevicePeaks:
    """Peaks for the device the engine runs on; env overrides win, unknown GPUs fall back to calibration."""
    peaks = None
    import torch

    if device != "cpu" and torch.cuda.is_available():
        index = torch.device(device).index if device.startswith("cuda:") else None
        name = torch.cuda.get_device_name(index)
        peaks = lookup(name, dtype)
        if peaks is None:
            logger.warning("no peak table entry for %r; set %s and %s for meaningful MFU/MBU",
                           name, ENV_PEAK_FLOPS, ENV_PEAK_BANDWIDTH)
    if peaks is None:
        peaks = calibrate_cpu("float32" if dtype == "float32" else dtype)
    return with_env_overrides(peaks)


def with_env_overrides(peaks: DevicePeaks) -> DevicePeaks:
    flops = os.environ.get(ENV_PEAK_FLOPS)
    bandwidth = os.environ.get(ENV_PEAK_BANDWIDTH)
    if not flops and not bandwidth:
        return peaks
    return DevicePeaks(peaks.name, float(flops) if flops else peaks.flops,
                       float(bandwidth) if bandwidth else peaks.bandwidth, "env")


_warned: set[str] = set()


def utilization(amount: float, seconds: float, peak: float, what: str) -> float:
    """amount / (seconds * peak). Above 1 is reported as is, never clamped, and logged once with why."""
    if seconds <= 0 or peak <= 0:
        return 0.0
    value = amount / (seconds * peak)
    if value > 1.0 and what not in _warned:
        _warned.add(what)
        logger.warning(
            "%s = %.0f%% exceeds 100%%: the peak (%.3g/s) is below what the step achieved, so either the "
            "peak is wrong for this device/dtype (override with %s / %s) or the perf model over-counts "
            "this step's work", what, 100 * value, peak, ENV_PEAK_FLOPS, ENV_PEAK_BANDWIDTH)
    return value
