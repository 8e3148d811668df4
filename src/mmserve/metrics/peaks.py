"""Peak FLOP/s and memory bandwidth of the device, the denominators of MFU and MBU.

Where the figure comes from, in order:
1. `MMSERVE_PEAK_FLOPS` (FLOP/s) and `MMSERVE_PEAK_BANDWIDTH` (bytes/s) override anything detected.
2. A CUDA device named in the table below: vendor datasheet figures, *dense* (datasheets headline the
   2:4-sparse rate, which is twice what dense matmuls can reach).
3. Anything else is measured where the engine runs, with the engine's dtype: an unknown GPU on that
   GPU (a large matmul and a device-to-device copy), a CPU on the calling thread (see
   `calibrate_cpu`). Measurements are cached per machine in `MMSERVE_PEAKS_CACHE` (a JSON file,
   default `~/.cache/mmserve/peaks.json`; `off` disables), so restarts report the same denominator.

Call `detect` in the process and on the thread that will run the model: torch's OpenMP pool belongs
to the thread that first ran a parallel region, and a measurement elsewhere measures something else.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_PEAK_FLOPS = "MMSERVE_PEAK_FLOPS"
ENV_PEAK_BANDWIDTH = "MMSERVE_PEAK_BANDWIDTH"
ENV_PEAKS_CACHE = "MMSERVE_PEAKS_CACHE"
SPREAD_WARNING = 0.20  # rounds of a calibration that disagree by more than this are not trusted or cached


@dataclass(frozen=True)
class DevicePeaks:
    name: str
    flops: float        # dense FLOP/s for `dtype`
    bandwidth: float    # bytes/s
    source: str         # "table", "calibrated", "cached" (calibrated earlier on this machine), "env"
    dtype: str = ""
    spread: float = 0.0  # calibration: (best - worst) / best over its rounds; 0 for table and env figures


@dataclass(frozen=True)
class _Sku:
    bf16: float          # dense bf16 == fp16 tensor FLOP/s, FP32 accumulate (what torch matmuls use)
    fp8: float | None    # dense fp8 tensor FLOP/s, FP32 accumulate; None: no fp8 tensor cores
    fp32: float          # non-tensor FP32 (TF32 is a different, lower-precision mode)
    bandwidth: float     # memory bytes/s


# Ordered: the first pattern that matches the device name wins, so specific names come first.
# Sources (per GPU; the sparse headline halved where only that is printed):
# - B200/GB200: NVIDIA Blackwell architecture technical brief (HGX B200 at 1000 W, GB200 at 1200 W).
# - H200/H200 NVL: NVIDIA H200 Tensor Core GPU datasheet; H100 SXM/NVL/PCIe: NVIDIA H100 datasheet.
# - H20: NVIDIA H20 product brief. A100 (SXM4/PCIe, 40/80 GB): NVIDIA A100 datasheet.
# - L40S, L40, L4, A10, A30: their NVIDIA datasheets.
# - RTX 4090: NVIDIA Ada Lovelace architecture whitepaper (GeForce tensor cores run FP32 accumulate at
#   half the FP16-accumulate rate); RTX 5090: NVIDIA RTX Blackwell GPU architecture whitepaper (same rule).
_TABLE: tuple[tuple[str, _Sku], ...] = (
    (r"GB200", _Sku(2.5e15, 5.0e15, 90e12, 8.0e12)),
    (r"B200", _Sku(2.25e15, 4.5e15, 80e12, 8.0e12)),
    (r"H200 NVL", _Sku(835e12, 1671e12, 60e12, 4.8e12)),
    (r"H200", _Sku(989.4e12, 1978.9e12, 66.9e12, 4.8e12)),
    (r"H100 NVL", _Sku(835e12, 1671e12, 60e12, 3.9e12)),
    (r"H100 PCIe", _Sku(756e12, 1513e12, 51.2e12, 2.0e12)),
    (r"H100", _Sku(989.4e12, 1978.9e12, 66.9e12, 3.35e12)),        # SXM5 ("NVIDIA H100 80GB HBM3")
    (r"H20\b", _Sku(148e12, 296e12, 44e12, 4.0e12)),
    (r"A100.*PCIe.*40GB", _Sku(312e12, None, 19.5e12, 1.555e12)),
    (r"A100.*80GB.*PCIe", _Sku(312e12, None, 19.5e12, 1.935e12)),
    (r"A100.*80GB", _Sku(312e12, None, 19.5e12, 2.039e12)),     # SXM4 80GB
    (r"A100", _Sku(312e12, None, 19.5e12, 1.555e12)),           # SXM4 40GB
    (r"L40S", _Sku(362.05e12, 733e12, 91.6e12, 864e9)),
    (r"L40", _Sku(181.05e12, 362e12, 90.5e12, 864e9)),
    (r"L4\b", _Sku(121e12, 242.5e12, 30.3e12, 300e9)),
    (r"RTX 5090", _Sku(209.5e12, 419e12, 104.8e12, 1.792e12)),
    (r"RTX 4090", _Sku(165.2e12, 330.3e12, 82.6e12, 1.008e12)),
    (r"A10\b", _Sku(125e12, None, 31.2e12, 600e9)),
    (r"A30", _Sku(165e12, None, 10.3e12, 933e9)),
)


def known_devices() -> list[str]:
    """The table's GPUs as a person names them (for a refusal listing what `lookup` knows)."""
    return [re.sub(r"\\b", "", pattern).replace(".*", " ") for pattern, _ in _TABLE]


def lookup(device_name: str, dtype: str = "bfloat16") -> DevicePeaks | None:
    """Table peaks for a CUDA device name (as torch.cuda.get_device_name() reports it), or None."""
    for pattern, sku in _TABLE:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            if dtype == "float32":
                flops = sku.fp32
            elif dtype.startswith(("fp8", "float8")) and sku.fp8 is not None:
                flops = sku.fp8
            else:  # bf16/fp16, and fp8 weights on a GPU without fp8 tensor cores (upcast to bf16)
                flops = sku.bf16
            return DevicePeaks(device_name, flops, sku.bandwidth, "table", dtype)
    return None


# -- measurement --------------------------------------------------------------------------------------


def _best_rounds(run: Callable[[], float], rounds: int, samples: int) -> list[float]:
    """Best (shortest) of `samples` timings in each of `rounds` rounds."""
    return [min(run() for _ in range(samples)) for _ in range(rounds)]


def _spread(best_times: list[float]) -> float:
    """How far the rounds disagree: (slowest - fastest) / slowest, as a share of the best rate."""
    return 1.0 - min(best_times) / max(best_times)


def calibrate_cpu(dtype: str = "float32", *, rounds: int = 5, samples: int = 6, matmul_n: int = 512,
                  copy_bytes: int = 64 * 2**20) -> DevicePeaks:
    """Peaks of this host for torch's thread count, measured so that other processes' load barely moves them.

    One thread runs `rounds` rounds, each the best of `samples` square matmuls (the engine's dtype)
    and of a few copies larger than the caches, timed in that thread's own CPU time: time the
    scheduler gives to other processes is not counted, so a shared, loaded host measures close to an
    idle one (a multi-threaded measurement stalls whenever one of its threads is descheduled). The peak
    is the best round times the threads torch uses, i.e. ideal scaling across cores: MFU/MBU on a CPU
    mean "share of what these cores sustain". The spread of the rounds says how much to trust it.
    """
    import torch

    threads = torch.get_num_threads()
    tdtype = getattr(torch, dtype) if dtype in ("float32", "bfloat16", "float16") else torch.float32
    a, b = torch.randn(matmul_n, matmul_n, dtype=tdtype), torch.randn(matmul_n, matmul_n, dtype=tdtype)
    out = torch.empty(matmul_n, matmul_n, dtype=tdtype)
    src = torch.ones(copy_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)

    def timed(fn: Callable[[], object]) -> Callable[[], float]:
        def run() -> float:
            start = time.thread_time()
            fn()
            return time.thread_time() - start
        return run

    torch.set_num_threads(1)
    try:
        torch.mm(a, b, out=out)  # first touch: page faults, kernel selection
        dst.copy_(src)
        mm_times = _best_rounds(timed(lambda: torch.mm(a, b, out=out)), rounds, samples)
        copy_times = _best_rounds(timed(lambda: dst.copy_(src)), rounds, max(2, samples // 3))
    finally:
        torch.set_num_threads(threads)
    flops = threads * 2 * matmul_n**3 / min(mm_times)
    bandwidth = threads * 2 * copy_bytes / min(copy_times)  # a copy reads and writes every byte
    spread = max(_spread(mm_times), _spread(copy_times))
    return DevicePeaks(f"cpu ({_cpu_model()}, {threads} threads)", flops, bandwidth, "calibrated", dtype, spread)


def calibrate_accelerator(device: str, dtype: str = "bfloat16", *, rounds: int = 3, samples: int = 5,
                          matmul_n: int = 8192, copy_bytes: int = 2**30, repeats: int = 4) -> DevicePeaks:
    """Peaks of a GPU with no table entry, measured on that GPU: a large `dtype` matmul and a
    device-to-device copy, `repeats` back to back between synchronisations (so launch and sync
    overheads vanish), best of `samples` per round. Works on any torch device (tests run it on CPU
    with tiny sizes, since this machine has no GPU)."""
    import torch

    dev = torch.device(device)
    tdtype = getattr(torch, dtype) if dtype in ("float32", "bfloat16", "float16") else torch.bfloat16
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    a = torch.randn(matmul_n, matmul_n, dtype=tdtype, device=dev)
    b = torch.randn(matmul_n, matmul_n, dtype=tdtype, device=dev)
    out = torch.empty(matmul_n, matmul_n, dtype=tdtype, device=dev)
    src = torch.ones(copy_bytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)

    def timed(fn: Callable[[], object]) -> Callable[[], float]:
        def run() -> float:
            sync()
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            sync()
            return (time.perf_counter() - start) / repeats
        return run

    mm, cp = timed(lambda: torch.mm(a, b, out=out)), timed(lambda: dst.copy_(src))
    mm(), cp()  # warm-up: kernel selection, allocation
    mm_times, copy_times = _best_rounds(mm, rounds, samples), _best_rounds(cp, rounds, samples)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    spread = max(_spread(mm_times), _spread(copy_times))
    return DevicePeaks(name, 2 * matmul_n**3 / min(mm_times), 2 * copy_bytes / min(copy_times), "calibrated",
                       dtype, spread)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- per-machine cache ----------------------------------------------------------------------------------


def cache_path() -> Path | None:
    """The JSON file holding this machine's calibrations, or None when caching is off."""
    value = os.environ.get(ENV_PEAKS_CACHE)
    if value is not None and value.strip().lower() in ("", "off", "0", "none"):
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mmserve" / "peaks.json"


def _read_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _cached(key: str, measure: Callable[[], DevicePeaks]) -> DevicePeaks:
    """The calibration stored under `key`, else a fresh one (stored when its spread is acceptable)."""
    path = cache_path()
    if path is not None and isinstance(entry := _read_cache(path).get(key), dict):
        try:
            return DevicePeaks(**{**entry, "source": "cached"})
        except TypeError:
            pass  # an entry from another version: measure again
    peaks = measure()
    if path is not None and peaks.spread <= SPREAD_WARNING:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            entries = _read_cache(path)
            entries[key] = asdict(peaks)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
            tmp.replace(path)
        except OSError as e:
            logger.debug("could not cache device peaks in %s: %s", path, e)
    return peaks


def _machine_key(kind: str, dtype: str) -> str:
    import torch

    return f"{kind}|{dtype}|torch {torch.__version__}|threads {torch.get_num_threads()}|{os.cpu_count()} cpus"


def detect(device: str = "auto", dtype: str = "bfloat16") -> DevicePeaks:
    """Peaks for the device the engine runs on (env overrides win; unknown devices are measured there)."""
    flops, bandwidth = os.environ.get(ENV_PEAK_FLOPS), os.environ.get(ENV_PEAK_BANDWIDTH)
    if flops and bandwidth:  # nothing left to detect: skip the measurement
        peaks = DevicePeaks(device, float(flops), float(bandwidth), "env", dtype)
        log_peaks(peaks)
        return peaks
    import torch

    if device != "cpu" and torch.cuda.is_available():
        index = torch.device(device).index if device.startswith("cuda:") else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        peaks = lookup(name, dtype)
        if peaks is None:
            logger.warning("no peak table entry for %r: measuring this GPU (set %s and %s to use datasheet figures)",
                           name, ENV_PEAK_FLOPS, ENV_PEAK_BANDWIDTH)
            key = _machine_key(f"cuda {name} (cuda {torch.version.cuda})", dtype)
            peaks = _cached(key, lambda: calibrate_accelerator(f"cuda:{index}", dtype))
    else:
        peaks = _cached(_machine_key(f"cpu {_cpu_model()}", dtype), lambda: calibrate_cpu(dtype))
    peaks = with_env_overrides(peaks)
    log_peaks(peaks)
    return peaks


def log_peaks(peaks: DevicePeaks) -> None:
    """The one log line that says what MFU/MBU divide by (tests and operators read it)."""
    logger.info("device peaks: %s, %s: %.4g FLOP/s, %.4g B/s (source %s, spread %.0f%%)", peaks.name,
                peaks.dtype or "?", peaks.flops, peaks.bandwidth, peaks.source, 100 * peaks.spread)
    if peaks.spread > SPREAD_WARNING:
        logger.warning("device peak calibration is noisy: its rounds disagree by %.0f%% (> %.0f%%), so MFU/MBU "
                       "may be off by as much; not cached. Set %s and %s to fix the denominators", 100 * peaks.spread,
                       100 * SPREAD_WARNING, ENV_PEAK_FLOPS, ENV_PEAK_BANDWIDTH)


def with_env_overrides(peaks: DevicePeaks) -> DevicePeaks:
    flops = os.environ.get(ENV_PEAK_FLOPS)
    bandwidth = os.environ.get(ENV_PEAK_BANDWIDTH)
    if not flops and not bandwidth:
        return peaks
    return DevicePeaks(peaks.name, float(flops) if flops else peaks.flops,
                       float(bandwidth) if bandwidth else peaks.bandwidth, "env", peaks.dtype, peaks.spread)


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
