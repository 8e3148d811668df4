"""The GPU lease kit (scripts/gpu_lease/) without a GPU or the real bundle.

The real dry run (`bash scripts/gpu_lease/dry_run.sh`) needs `make gpu-bundle`'s ~150 MB download,
so CI runs it in pieces instead: the calls' structure against gpu_check's sections and the device's
limits, and the shell steps every call shares (verify a part, reassemble, unpack) on a tiny bundle
packed by the same code.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "scripts" / "gpu_lease"
CALLS = ["1_probe.sh", "2_kernels.sh", "3_serving.sh"]


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def kit():
    bundle = load("gpu_lease_bundle", KIT / "bundle.py")
    check = load("bench_gpu_check_for_lease", ROOT / "bench" / "gpu_check.py")
    yield bundle, check
    del sys.modules["gpu_lease_bundle"], sys.modules["bench_gpu_check_for_lease"]


def test_the_calls_fit_the_device_and_cover_every_section(kit):
    _, check = kit
    sections = []
    for i, name in enumerate(CALLS, 1):
        text = (KIT / name).read_text()
        assert len(text) < 2000, name   # pasted whole, a call's command must stay under 2,000 characters
        header = text.splitlines()[0]
        assert f"Lease call {i} of 3" in header
        timeout_s = int(re.search(r"timeout_s (\d+)", header).group(1))
        assert timeout_s <= 600
        run = re.search(r"run_check call\d (\d+) (.+)", text)
        assert int(run.group(1)) < timeout_s - 20, name   # its sections end before the call's limit
        sections += [w for w in run.group(2).split() if not w.startswith(("-", '"'))]
        carried = re.findall(r"\.gpu_bundle/[\w.-]+", header)
        assert all(re.fullmatch(r"\.gpu_bundle/(part-[a-z]|manifest\.json)", c) for c in carried), carried
    assert sorted(sections) == sorted(check.SECTIONS)
    subprocess.run(["bash", "-n", *(str(KIT / n) for n in [*CALLS, "env.sh", "dry_run.sh"])], check=True)


def test_the_bundle_pins_what_the_gpu_extra_pins(kit):
    bundle, _ = kit
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert set(extra) <= set(bundle.WHEELS)
    assert bundle.PART_BYTES < 48 * 2**20
    assert "gpu-bundle:" in (ROOT / "Makefile").read_text()
    assert "/.gpu_bundle/" in (ROOT / ".gitignore").read_text().split()


def test_a_call_verifies_reassembles_and_unpacks_the_parts(kit, tmp_path):
    bundle, _ = kit
    site = tmp_path / "src" / "site"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("VALUE = 42\n")
    (site / "pkg" / "noise.bin").write_bytes(__import__("os").urandom(3000))   # xz cannot shrink it: 3 parts
    manifest = bundle.pack(site, tmp_path / "bundle", part_bytes=1200)
    assert [p["name"] for p in manifest["parts"]] == ["part-a", "part-b", "part-c"]
    device = tmp_path / "device"
    device.mkdir()
    for p in manifest["parts"]:
        (device / p["name"]).write_bytes((tmp_path / "bundle" / p["name"]).read_bytes())
    (device / "manifest.json").write_text(json.dumps(manifest))
    env = {"OUT": str(tmp_path), "GPU_BUNDLE_DIR": str(device), "GPU_LEASE_PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}

    def shell(script: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", f". scripts/gpu_lease/env.sh; {script}"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)

    assert shell('verify part-b "$B/part-b" && unpack').returncode == 0
    assert (device / "site" / "pkg" / "__init__.py").read_text() == "VALUE = 42\n"
    corrupt = bytearray((device / "part-a").read_bytes())
    corrupt[100] ^= 1
    (device / "part-a").write_bytes(bytes(corrupt))
    failed = shell('verify part-a "$B/part-a"')
    assert failed.returncode != 0 and "differs from the manifest" in failed.stderr
