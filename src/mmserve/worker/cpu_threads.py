"""How many cores this container really has, and the one torch intra-op pool sized from it.

`os.cpu_count()` reports the host's cores, not the container's: a pod limited to 2 CPUs on a 64-core
node would start 64 OpenMP threads that fight over 2 cores. The cgroup quota (`cpu.max`, or v1's
`cpu.cfs_quota_us / cpu.cfs_period_us`) and the CPU affinity mask say what this process may use;
the smaller wins.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

CGROUP = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP) -> float | None:
    """CPUs allowed by the cgroup quota, or None when unlimited or unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]   # cgroup v2: "200000 100000" or "max 100000"
        if quota != "max":
            return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())   # cgroup v1; -1 = unlimited
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        if quota > 0 and period > 0:
            return quota / period
    except (OSError, ValueError):
        pass
    return None


def available_cores(root: Path = CGROUP) -> int:
    """Cores this process can really use: the CPU affinity mask, capped by the cgroup quota (rounded up)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cores = min(cores, max(1, math.ceil(limit)))
    return max(1, cores)


def engine_threads(requested: int) -> int:
    """The engine's torch pool size: `--engine-threads` when set, else OMP_NUM_THREADS when the user set
    it, else the container's cores."""
    if requested > 0:
        return requested
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return available_cores()


def configure_torch_threads(num_threads: int) -> int:
    """Set this process's one torch intra-op pool (and a single inter-op thread); returns the size."""
    import torch

    torch.set_num_threads(num_threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:   # already set, or inter-op work already ran in this process
        pass
    logger.info("torch: %d intra-op threads", torch.get_num_threads())
    return torch.get_num_threads()


@contextlib.contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """torch's intra-op pool set to `num_threads` inside the block and restored after it, so whoever
    else runs torch in this process keeps the pool it configured (a no-op when it is that size already)."""
    import torch

    before = torch.get_num_threads()
    if num_threads == before:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
