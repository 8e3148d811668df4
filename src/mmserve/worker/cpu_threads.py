"""The engine process's one torch pool: how many threads, and how they wait.

How many: `--engine-threads` when set, else OMP_NUM_THREADS when set, else the cores this container
really has. `os.cpu_count()` reports the host's cores, not the container's: a pod limited to 2 CPUs
on a 64-core node would start 64 OpenMP threads that fight over 2 cores. The cgroup quota (`cpu.max`,
or v1's `cpu.cfs_quota_us / cpu.cfs_period_us`) and the CPU affinity mask say what this process may
use; the smaller wins.

How they wait: torch's OpenMP runtime (GNU libgomp) lets a thread that waits for work spin ~300,000
times before it sleeps, and in a decode step of small ops the next parallel region comes sooner
than that, so a team thread never leaves its core. Beside anything else that wants that core (the
front end's decode and gRPC work, another process) the spinning takes the time the others need, and
the team's barriers wait for whichever of its threads the scheduler set aside: on 2 cores with a
busy process beside the server, a spinning 2-thread engine served 2-8x fewer tokens per second
and spent 3.5-4.8x the CPU per token of the same pool waiting passively (docs/benchmarks.md, "Noisy
neighbours"). So the engine process starts with OMP_WAIT_POLICY=PASSIVE (a waiting thread sleeps
at once) unless the user chose a wait policy; libgomp reads it as it loads, so it is set in the
environment of the processes about to start.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

logger = logging.getLogger(__name__)

CGROUP = Path("/sys/fs/cgroup")
WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")   # a user's choice of how OpenMP threads wait


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


def engine_threads(requested: int, root: Path = CGROUP) -> int:
    """The engine's torch pool size: `--engine-threads` when set, else OMP_NUM_THREADS when the user set
    it, else the container's cores."""
    if requested > 0:
        return requested
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return available_cores(root)


def passive_openmp_waits() -> None:
    """Processes started from here on (the engine process, its tensor-parallel ranks) get
    OMP_WAIT_POLICY=PASSIVE, unless the user set a wait policy. This process's own OpenMP runtime,
    loaded already, keeps the policy it read then."""
    if not any(name in os.environ for name in WAIT_POLICY_VARS):
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def configure_torch_threads(num_threads: int) -> int:
    """Set this process's one torch intra-op pool (and a single inter-op thread); returns the size."""
    import torch

    torch.set_num_threads(num_threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:   # already set, or inter-op work already ran in this process
        pass
    logger.info("torch: %d intra-op threads (OpenMP waits: %s)", torch.get_num_threads(),
                os.environ.get("OMP_WAIT_POLICY", "libgomp's default, spinning first"))
    return torch.get_num_threads()
