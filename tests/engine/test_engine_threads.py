"""The engine's torch pool follows the container's real CPU limit: cgroup v2 `cpu.max`, v1 CFS quota,
capped by the affinity mask; an explicit --engine-threads or OMP_NUM_THREADS wins. A step may run on
a narrower pool for a while (`torch_threads`), which is restored after it."""

from __future__ import annotations

import os

import pytest
import torch

from mmserve.worker.cpu_threads import available_cores, cgroup_cpu_limit, engine_threads, torch_threads


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


def test_explicit_settings_win(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert engine_threads(5) == 5 and engine_threads(0) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert engine_threads(0) == available_cores()


def test_torch_threads_narrows_the_pool_for_a_block_and_restores_it_even_on_error():
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), torch_threads(1):
        raise RuntimeError("a failing step")
    assert torch.get_num_threads() == before
