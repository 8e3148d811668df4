"""The engine's torch pool follows the container's real CPU limit (cgroup v2 `cpu.max`, v1 CFS quota,
capped by the affinity mask); an explicit --engine-threads or OMP_NUM_THREADS wins. The engine
process's OpenMP threads sleep while they wait (OMP_WAIT_POLICY=PASSIVE) unless the user chose
otherwise. Why: docs/deploy.md#threads-and-processes."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from loopback_server import engine_config

from mmserve.config import DEMO_MODEL_DIR
from mmserve.engine.core_client import CoreClient
from mmserve.worker.cpu_threads import available_cores, cgroup_cpu_limit, engine_threads, passive_openmp_waits


@pytest.fixture
def no_thread_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """None of the user's thread variables set; whatever a test sets is undone after it."""
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.setenv(name, "")   # recorded, so the teardown restores the original (or its absence)
        monkeypatch.delenv(name)
    return monkeypatch


def fake_machine(monkeypatch: pytest.MonkeyPatch, root: Path, *, cpus: int, cpu_max: str | None) -> Path:
    """A process allowed `cpus` CPUs by its affinity mask, in a cgroup whose cpu.max is `cpu_max`."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    root.mkdir(exist_ok=True)
    if cpu_max is not None:
        (root / "cpu.max").write_text(cpu_max + "\n")
    return root


def test_cgroup_v2_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.5
    assert available_cores(tmp_path) == min(2, len(os.sched_getaffinity(0)))   # 1.5 CPUs -> 2 threads
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    assert available_cores(tmp_path) == len(os.sched_getaffinity(0))


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path) == 0.5 and available_cores(tmp_path) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(tmp_path) is None


def test_no_cgroup_files_means_the_affinity_mask(tmp_path):
    assert cgroup_cpu_limit(tmp_path) is None and available_cores(tmp_path) == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("cpus, cpu_max, threads", [
    (2, None, 2),                # this bench machine: both cores
    (64, "200000 100000", 2),    # a 2-CPU pod on a 64-core node: the quota, not the node
    (64, "350000 100000", 4),    # 3.5 CPUs round up
    (64, "50000 100000", 1),     # half a CPU: still one thread
    (8, "max 100000", 8),        # no quota: the affinity mask
    (4, "1600000 100000", 4),    # a quota above the mask: the mask
])
def test_the_default_pool_is_the_containers_cores(no_thread_env, tmp_path, cpus, cpu_max, threads):
    root = fake_machine(no_thread_env, tmp_path / "cgroup", cpus=cpus, cpu_max=cpu_max)
    assert engine_threads(0, root) == threads


def test_explicit_settings_win(no_thread_env, tmp_path):
    root = fake_machine(no_thread_env, tmp_path / "cgroup", cpus=8, cpu_max=None)
    no_thread_env.setenv("OMP_NUM_THREADS", "8")
    assert engine_threads(5, root) == 5 and engine_threads(0, root) == 8


def test_the_users_wait_policy_is_kept(no_thread_env):
    passive_openmp_waits()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    no_thread_env.setenv("OMP_WAIT_POLICY", "ACTIVE")
    passive_openmp_waits()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    no_thread_env.delenv("OMP_WAIT_POLICY")
    no_thread_env.setenv("GOMP_SPINCOUNT", "10000")
    passive_openmp_waits()
    assert "OMP_WAIT_POLICY" not in os.environ


def test_the_engine_process_gets_the_default_pool_and_passive_waits(no_thread_env, spawned_engines):
    """The real spawned engine process: its pool (reported in EngineReady) and the environment its
    OpenMP runtime read as it loaded."""
    async def start_and_stop():
        client = CoreClient(engine_config(DEMO_MODEL_DIR, engine_threads=0), on_outputs=lambda outputs: None,
                            on_exit=lambda error: None)
        ready = await client.start()
        try:
            return ready.torch_threads, Path(f"/proc/{ready.pid}/environ").read_bytes().split(b"\0")
        finally:
            await client.shutdown()

    threads, environ = asyncio.run(start_and_stop())
    assert threads == available_cores()
    assert b"OMP_WAIT_POLICY=PASSIVE" in environ
