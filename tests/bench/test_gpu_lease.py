"""The GPU lease kit (scripts/gpu_lease/) without a GPU or the real bundle.

The real dry run (`bash scripts/gpu_lease/dry_run.sh`) needs `make gpu-bundle`'s ~150 MB download,
so CI runs it in pieces instead: the calls' structure against gpu_check's sections and the device's
limits, the shell steps every call shares (verify a part, reassemble, unpack) on a tiny bundle
packed by the same code, and, so the kit cannot rot as the code grows, every package the code
imports and every requirement it brings resolved against the device image's list and the bundle's.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import itertools
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from bench_scripts import bench_script

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
    with bench_script("gpu_check") as check:
        yield bundle, check
    del sys.modules["gpu_lease_bundle"]


def test_the_calls_fit_the_device_and_cover_every_section(kit):
    bundle, check = kit
    sections, carried_parts = [], []
    for i, name in enumerate(CALLS, 1):
        text = (KIT / name).read_text()
        assert len(text) < 2000, name   # pasted whole, a call's command must stay under 2,000 characters
        header = "\n".join(text.splitlines()[:2])
        assert f"Lease call {i} of 3" in header
        # every call names no kind: the first gets an H100 (an H200 if none starts), the others keep its machine (naming
        # another kind would give it back, and the bundle stashed in its /tmp with it)
        assert "kind: left out" in header, name
        timeout_s = int(re.search(r"timeout_s (\d+)", header).group(1))
        assert timeout_s <= 600
        run = re.search(r"run_check call\d (\d+) (.+)", text)
        assert int(run.group(1)) < timeout_s - 20, name   # its sections end (a deadline from the call's start) before its limit
        sections += [w for w in run.group(2).split() if not w.startswith(("-", '"'))]
        carried = re.findall(r"\.gpu_bundle/[\w.-]+", header)
        assert all(re.fullmatch(r"\.gpu_bundle/(part-[a-z]|manifest\.json)", c) for c in carried), carried
        carried_parts += [c.removeprefix(".gpu_bundle/") for c in carried if "part-" in c]
    assert sorted(sections) == sorted(check.SECTIONS)
    assert sorted(carried_parts) == [f"part-{chr(ord('a') + i)}" for i in range(bundle.LEASE_PARTS)]
    subprocess.run(["bash", "-n", *(str(KIT / n) for n in [*CALLS, "env.sh", "dry_run.sh"])], check=True)


def test_a_call_stops_its_sections_before_the_sessions_device_time_runs_out(tmp_path):
    """The tool cuts a call where the session's device time ends, whatever its timeout_s: with
    LEASE_LEFT_S (status's budget_left_s as the call is made) a call's sections stop 25 s before,
    so its log and JSON come back; without it, at the call's own deadline."""
    def left(deadline: int, lease_left: str | None) -> int:
        env = {"OUT": str(tmp_path), "PATH": "/usr/bin:/bin", **({"LEASE_LEFT_S": lease_left} if lease_left else {})}
        proc = subprocess.run(["bash", "-c", f". scripts/gpu_lease/env.sh; seconds_left {deadline}"], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=60, check=True)
        return int(proc.stdout)

    # bash's SECONDS counts whole seconds from both ends: a shell started at x.999 s already reads 1
    assert left(555, None) in (554, 555) and left(555, "900") in (554, 555)
    assert left(555, "300") in (274, 275)
    assert left(555, "20") == 10   # never 0, which `timeout` reads as no limit at all


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


# Imported only by tools that never run on the device: module -> the one file allowed to import it.
TOOLS_ONLY = {"grpc_tools": "src/mmserve/protogen.py"}
KIT_MODULES = [p.stem for p in KIT.glob("*.py")]   # the import check imports bundle.py beside it
BENCH_MODULES = [p.stem for p in (ROOT / "bench").glob("*.py")]   # gpu_check imports its siblings (tile_analysis)


def _gpu_check_siblings() -> list[Path]:
    """The bench/ modules gpu_check imports (tile_analysis, lease_device, ...): they run on the device too."""
    tree = ast.parse((ROOT / "bench" / "gpu_check.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    return [ROOT / "bench" / f"{m}.py" for m in sorted(names & set(BENCH_MODULES))]


DEVICE_CODE = [*(ROOT / "src" / "mmserve").rglob("*.py"), ROOT / "bench" / "gpu_check.py", *_gpu_check_siblings(),
               KIT / "import_check.py"]


def third_party_imports() -> dict[str, set[str]]:
    """Every absolute import outside the standard library and mmserve -> the files importing it."""
    found: dict[str, set[str]] = {}
    for path in DEVICE_CODE:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:   # `from a import b`: b may be a module
                names = [f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*"] or [node.module]
            else:
                continue
            for name in names:
                if name.split(".")[0] not in (*sys.stdlib_module_names, "mmserve", *KIT_MODULES, *BENCH_MODULES):
                    found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def installed_owners(normalise) -> dict[Path, set[str]]:
    """Each installed module file (as `dir/name`, suffixes dropped) and each package folder above it,
    up to its sys.path entry -> the distributions that installed files there."""
    roots = {Path(p).resolve() for p in sys.path if p}
    index: dict[Path, set[str]] = {}
    for dist in importlib.metadata.distributions():
        name = normalise(dist.metadata["Name"])
        for f in dist.files or []:
            if f.suffix not in (".py", ".so"):
                continue
            path = Path(dist.locate_file(f)).resolve()
            index.setdefault(path.with_name(path.name.split(".")[0]), set()).add(name)
            for folder in path.parents:
                if folder in roots:
                    break
                index.setdefault(folder, set()).add(name)
    return index


def owners(module: str, index: dict[Path, set[str]]) -> set[str]:
    """The distributions that installed `module` (its deepest package or file found): namespace
    packages (opentelemetry.*, google.*) span several, and a package that a .pth puts on the path
    (cutlass) is in no distribution's top-level list."""
    spec = importlib.util.find_spec(module.split(".")[0])   # a top-level name: found, not imported
    if spec is None:
        return set()
    roots = [Path(p).resolve() for p in spec.submodule_search_locations or [Path(spec.origin).parent]]
    parts = module.split(".")[1:] if spec.submodule_search_locations else [module]
    for depth in range(len(parts), -1, -1):
        for root in roots:
            if hits := index.get(root.joinpath(*parts[:depth])):
                return hits
    return set()


def test_every_import_resolves_to_the_image_or_the_bundle(kit):
    """A package that src/mmserve, gpu_check or the import check imports must be in the device
    image or in the bundle: else the first call that reaches it fails on the lent machine."""
    bundle, _ = kit
    provided = set(bundle.image_packages()) | set(bundle.pinned())
    index = installed_owners(bundle.normalise)
    missing = {}
    for module, paths in third_party_imports().items():
        if paths == {TOOLS_ONLY.get(module.split(".")[0])}:
            continue
        dists = owners(module, index)
        if not dists & provided:
            missing[module] = f"{sorted(paths)} import it; from {sorted(dists) or 'no installed distribution'}"
    assert not missing, f"add these to scripts/gpu_lease/bundle.py's WHEELS: {missing}"


def test_the_device_meets_every_runtime_requirement(kit):
    """mmserve's own requirements and those of each bundled package are met by the bundle's pins or
    the image's packages, version ranges checked where the image's version is known. A bundled
    package's requirements are read from this venv where it holds the pinned version; where a newer
    release came in through pyproject's ranges (CI installs fresh), its pin's own requirements are
    not on this machine, and only mmserve's ranges are checked against the pin (re-pin with
    `make gpu-bundle` before a lease; bundle.py reports the drift)."""
    bundle, _ = kit
    needs = {"mmserve": tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    for name, version in bundle.pinned().items():
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            assert name == "nvidia-cutlass-dsl-libs-cu13", name   # this CPU venv holds the cu12 build
            continue
        if dist.version == version:
            needs[name] = dist.requires or []
    assert bundle.unmet_requirements(needs) == []
    # and the check does catch a package or a version the device lacks
    assert bundle.unmet_requirements({"x": ["huggingface-hub>=2", "no-such-package", "torch<2; python_version < '3'"]}) == [
        "huggingface-hub>=2 (needed by x): the device would have 1.33.0",
        "no-such-package (needed by x): neither bundled nor in the image"]


def test_the_dry_runs_call_1_cannot_import_what_the_bundle_brings(tmp_path):
    """Call 1 runs before the bundle is unpacked: in the dry run image_only.py blocks the bundle's
    packages (a namespace's bundled subpackages only, and the CuTe DSL's .pth-added cutlass)."""
    image_only = load("gpu_lease_image_only", KIT / "image_only.py")
    site = tmp_path / "site"
    for folder in ("pydantic", "google/rpc", "nvidia_cutlass_dsl/dsl_packages/cutlass", "av.libs", "x-1.dist-info"):
        (site / folder).mkdir(parents=True)
    (site / "pydantic" / "__init__.py").touch()
    (site / "typing_inspection.py").touch()
    assert image_only.bundled_modules(site) == {"pydantic", "google.rpc", "cutlass", "typing_inspection",
                                                "nvidia_cutlass_dsl.dsl_packages"}
    script = tmp_path / "script.py"
    script.write_text("import google.protobuf, json\ntry:\n    import google.rpc.status_pb2\nexcept ImportError as e:\n"
                      "    print('blocked', e.name)\n")
    proc = subprocess.run([sys.executable, str(KIT / "image_only.py"), str(site), str(script)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.split() == ["blocked", "google.rpc"], proc.stderr


def test_a_part_and_the_working_tree_fit_one_call(kit):
    """A call carries the repository's working tree and one part: 64 MiB together at most. A large
    committed file (a checkpoint, say) would make calls 1 and 2 fail on the device before running."""
    bundle, _ = kit
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    tree = sum((ROOT / p).stat().st_size for p in tracked.decode().split("\0") if p and (ROOT / p).is_file())
    assert tree + bundle.PART_BYTES + 2**16 < 64 * 2**20, f"the tracked tree is {tree / 2**20:.1f} MiB"


def test_bundle_reports_a_pin_this_environment_does_not_hold(kit, monkeypatch):
    """A release newer than a pin (pyproject's ranges let it into a fresh venv) is reported by
    `make gpu-bundle`, not failed in CI: the device would run the pin, not what the tests ran."""
    bundle, _ = kit
    name = "transformers"
    assert name in bundle.pinned()
    monkeypatch.setattr(bundle, "WHEELS", [w for w in bundle.WHEELS if not w.startswith(name)] + [f"{name}==0.0.1"])
    assert [line for line in bundle.drift() if line.startswith(name)] == [
        f"{name}: the bundle pins 0.0.1, this environment has {importlib.metadata.version(name)}"]


def test_call_2s_torch_probes_catch_an_old_torch_and_a_broken_grouped_gemm(monkeypatch, capsys):
    """The import check's probes of the image's torch (2.11), here on CPU without the CUDA graph: they
    pass on this torch, name a torch below pyproject's floor, and catch a grouped GEMM that drops a group."""
    import torch

    probes = load("gpu_lease_import_check", KIT / "import_check.py").torch_probes
    assert probes("cpu") == [] and "torch probes passed" in capsys.readouterr().out
    monkeypatch.setattr(torch, "__version__", "2.10.0+cu128")
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, offs: real(a, b, offs=offs.roll(1)))
    old, broken = probes("cpu")
    assert "torch 2.10.0+cu128 is outside pyproject's" in old and "MoE grouped GEMM on cpu" in broken


# What call 3's sections schedule in one step on CUDA: its engines need no bucket past it. decode and profile
# time decode steps (64 rows at most) and serving's throughput does not need 8192-token prefill chunks: the
# CUDA default step, 2048; mixed's one step is its 2048-token chunk beside 63 decodes; video_prefill's chunk
# is 2048; capacity starts as a user would, so it takes the defaults (prefill steps to 8192).
CALL_3_STEP_TOKENS = {"decode": (64, 2048), "profile": (64, 2048), "serving": (16, 2048), "mixed": (2111, 2111),
                      "video_prefill": (2048, 2048), "capacity": (8192, 8192)}


def test_call_3s_engines_capture_buckets_only_up_to_their_sections_steps(kit, capsys):
    """Every engine with graphs captures a piecewise graph per token bucket to its largest step (44
    buckets to the CUDA default 8192, 36 to 2048): an engine's budget on CUDA must hold its section's
    steps and stop there. The dry run prints each engine's captures."""
    from mmserve.config import EngineConfig
    from mmserve.worker.piecewise_graphs import piecewise_sizes

    _, check = kit
    sections = re.search(r"run_check call3 \d+ (.+)", (KIT / "3_serving.sh").read_text()).group(1).split()
    sections = [s for s in sections if not s.startswith(("-", '"'))]
    assert sorted(sections) == sorted(CALL_3_STEP_TOKENS)
    budgets = check.engine_budgets(check.GPU, "cuda")
    steps = {s: [EngineConfig(device="cuda", **b).max_step_tokens for b in budgets[s]] for s in sections}
    for section, tokens in steps.items():
        low, high = CALL_3_STEP_TOKENS[section]
        assert tokens and all(low <= t <= high for t in tokens), (section, tokens)
    buckets = sum(len(piecewise_sizes(t)) for t in itertools.chain(*steps.values()))
    assert buckets == 5 * 36 + len(piecewise_sizes(2111)) + 44   # the 7 graph engines (decode's eager one captures none)
    plan = check.capture_plan(sections, check.GPU)
    assert len(plan) == 7 and "mixed[0]: steps to 2111 tokens" in "\n".join(plan)
    assert "capacity[0]: steps to 8192 tokens, 44 buckets, 2156 piecewise graphs (48 layers)" in plan[-1]
