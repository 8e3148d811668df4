"""The device a gpu_check run is on, read once per run: what its floors divide by, what it holds.

The lease lends an H100 by default and an H200 when a call names it (~3.0 against ~4.3 TB/s of
copy bandwidth, ~798 against ~790 TFLOP/s of bf16 GEMM, ~78 against ~139 GiB), so no constant
serves both. Each run measures its device once, by the same two operations as this workplace's
readings of the kinds (which report a mean of ten products where this takes the best sample): a
device-to-device copy of 1 GiB counting bytes read and written, and an 8192^3 bf16 GEMM
on random data (`mmserve.metrics.peaks.calibrate_accelerator`: after a warm-up, 3 rounds of 5
samples of 4 back-to-back calls between synchronisations; the best sample, since a floor is what
no version beats; well under a second). Every floor divides by these, and by the datasheet's
dense peaks beside them (`mmserve.metrics.peaks`), the second reference. Memory: an engine's KV
cache is what its section asks for, or what the device has free beside the checkpoint, whichever
is less.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

METHOD = ("calibrate_accelerator: best of 3 rounds x 5 samples of 4 back-to-back calls after a warm-up, a 1 GiB "
          "device-to-device copy (bytes read + written) and an 8192^3 bf16 GEMM on random data")
SMOKE_METHOD = "the smoke run's stand-in: calibrate_accelerator on the CPU, an 8 MiB copy and a 128^3 float32 GEMM"
# Beside the weights and the KV cache: activations, CUDA graph pools, the CUDA context and library
# workspaces (the 6 GiB docs/configuration.md assumes until a lease measures the memory profile).
ENGINE_HEADROOM = 6 * 2**30


@dataclass(frozen=True)
class Ceilings:
    """This device's measured copy bandwidth and GEMM rate, and its datasheet's (None off the table)."""

    device: str
    copy_bytes_per_s: float
    gemm_flops: float
    spread: float                        # how far the calibration's rounds disagreed (0: not at all)
    datasheet_bytes_per_s: float | None
    datasheet_flops: float | None
    sms: int | None                      # multiprocessors (None on a CPU)
    memory_bytes: int | None             # the device's total memory (None on a CPU)
    method: str

    def floor_s(self, nbytes: float = 0.0, flops: float = 0.0, *, datasheet: bool = False) -> float | None:
        """max(bytes / bandwidth, FLOPs / FLOP rate): the time no version of the work beats."""
        bandwidth, rate = ((self.datasheet_bytes_per_s, self.datasheet_flops) if datasheet
                           else (self.copy_bytes_per_s, self.gemm_flops))
        if bandwidth is None or rate is None:
            return None
        return max(nbytes / bandwidth, flops / rate)

    def against_floors(self, seconds: float, nbytes: float = 0.0, flops: float = 0.0) -> dict:
        """A measured time against both floors: `floor_ms`, `over_floor` (the measured ceilings),
        `datasheet_floor_ms`, `over_datasheet_floor` (None off the table), and which term bounds it."""
        floor, sheet = self.floor_s(nbytes, flops), self.floor_s(nbytes, flops, datasheet=True)
        return {"floor_ms": floor * 1e3, "over_floor": seconds / floor,
                "datasheet_floor_ms": None if sheet is None else sheet * 1e3,
                "over_datasheet_floor": None if sheet is None else seconds / sheet,
                "bound": "bytes" if nbytes / self.copy_bytes_per_s >= flops / self.gemm_flops else "flops"}

    def record(self) -> dict:
        """What every section's JSON carries beside its numbers."""
        return {**asdict(self), "copy_TBps": self.copy_bytes_per_s / 1e12, "gemm_TFLOPs": self.gemm_flops / 1e12,
                "memory_gib": None if self.memory_bytes is None else self.memory_bytes / 2**30}


def measure(device: str) -> Ceilings:
    """This run's device, measured (bf16 on CUDA; the smoke run: float32 on tiny shapes, the plumbing)."""
    from mmserve.metrics.peaks import calibrate_accelerator, lookup

    if device != "cuda":
        peaks = calibrate_accelerator(device, "float32", rounds=2, samples=2, matmul_n=128, copy_bytes=8 * 2**20,
                                      repeats=2)
        return Ceilings(peaks.name, peaks.bandwidth, peaks.flops, peaks.spread, None, None, None, None, SMOKE_METHOD)
    peaks = calibrate_accelerator("cuda", "bfloat16")
    torch.cuda.empty_cache()   # its buffers: no section should find them reserved
    props = torch.cuda.get_device_properties(0)
    sheet = lookup(props.name, "bfloat16")
    return Ceilings(props.name, peaks.bandwidth, peaks.flops, peaks.spread, sheet and sheet.bandwidth,
                    sheet and sheet.flops, props.multi_processor_count, props.total_memory, METHOD)


def kv_cache_bytes(wanted: int, checkpoint_bytes: int, free_bytes: int, headroom: int = ENGINE_HEADROOM) -> int:
    """The KV cache an engine of the section gets: `wanted`, or what the device's free memory holds
    beside the checkpoint's weights and `headroom`, whichever is less (0: the section does not fit
    this device, and needs a larger kind)."""
    return max(0, min(wanted, free_bytes - checkpoint_bytes - headroom))
