"""Lease call 2's import check: the unpacked bundle's packages resolve, from the bundle.

On the device: every module below imports from the site tree (not the image: its transformers is
5.17), mmserve sees FA4 as installed, and the kernels it picks for this GPU are printed. Only the
modules gpu_check's sections need (REQUIRED) fail the call; the others are reported.

--dry-run (this CPU: Python 3.11, no GPU): the site tree's cp312 extensions that need nothing the
image adds import under a Python 3.12 (pyenv's, or GPU_LEASE_PY312); the CuTe DSL's libraries are
cp312 builds; and FA4 from the bundle's own sources compiles our kernels to sm_90a and sm_100a
under FakeTensorMode (tests/attention/test_attn_fa4_compile.py with the bundle's flash_attn first).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEVICE_MODULES = ["flash_attn.cute.interface", "cutlass.cute", "quack", "tvm_ffi", "torch_c_dlpack_ext",
                  "transformers", "av", "xgrammar", "zmq", "pydantic", "opentelemetry.trace", "opentelemetry.sdk",
                  "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "grpc_health.v1.health",
                  "grpc_reflection.v1alpha.reflection", "smg_grpc_proto", "mmserve.server.app"]
# gpu_check's sections need these (the engine: xgrammar for structured output, opentelemetry for tracing)
REQUIRED = {"flash_attn.cute.interface", "cutlass.cute", "transformers", "av", "xgrammar", "opentelemetry.trace"}
SELF_CONTAINED_CP312 = ["pydantic", "zmq", "av", "tvm_ffi"]   # import with only pure helpers beside them
PURE_FA4 = ["flash_attn", "quack"]                              # FA4's own sources in the bundle


def on_device(site: Path) -> int:
    import torch

    failed = 0
    for name in DEVICE_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            print(f"{'FAIL' if name in REQUIRED else 'warn'} {name}: {type(exc).__name__}: {exc}")
            failed += name in REQUIRED   # the rest serve the server, not gpu_check's sections
            continue
        top = sys.modules[name.split(".")[0]]
        where = Path(getattr(top, "__file__", "") or next(iter(getattr(top, "__path__", [""]))))
        bundled = site.resolve() in where.resolve().parents or name.startswith("mmserve.")
        print(f"{'ok  ' if bundled else 'IMAGE'} {name} {getattr(top, '__version__', '')} {where}")
        failed += name == "transformers" and not bundled   # 5.17 from the image would not do
        del module
    requirements_met(site)
    torch_probes("cuda")
    from mmserve.attention.backend import FULL, SLIDING, LayerAttentionSpec
    from mmserve.attention.fa4 import fa4_installed
    from mmserve.attention.selection import choose_backends, device_arch

    specs = {SLIDING: LayerAttentionSpec(SLIDING, 16, 8, 256, window=1024, bidirectional=True),
             FULL: LayerAttentionSpec(FULL, 16, 1, 512, window=None, bidirectional=False)}
    print("fa4_installed", fa4_installed(), "arch", device_arch("cuda"), "backends",
          choose_backends(specs, device_type="cuda", arch=device_arch("cuda"), dtype=torch.bfloat16,
                          fa4_installed=fa4_installed()))
    return 1 if failed or not fa4_installed() else 0


def requirements_met(site: Path) -> None:
    """The bundled packages' requirements against what this machine really has (the image's versions
    KINDS.md does not list: grpcio, protobuf, ...), bundle first as on sys.path; reported, not fatal:
    gpu_check's sections fail by themselves if one matters."""
    sys.path.insert(0, str(Path(__file__).parent))
    import bundle

    have: dict[str, str | None] = {}
    for dist in importlib.metadata.distributions():   # sys.path order: the first of a name is the one imported
        have.setdefault(bundle.normalise(dist.metadata["Name"]), dist.version)
    needs = {d.metadata["Name"]: d.requires or [] for d in importlib.metadata.distributions(path=[str(site)])}
    for unmet in bundle.unmet_requirements(needs, have):
        print("warn requirement", unmet)
    print("image:", ", ".join(f"{n} {have.get(n)}" for n in ("torch", "triton", "grpcio", "protobuf", "huggingface-hub",
                                                              "tokenizers", "safetensors", "numpy", "pillow")))


def torch_probes(device: str) -> list[str]:
    """The image's torch (2.11; CI tests 2.13) where no CPU test reaches: within pyproject's range, and
    the MoE's grouped GEMM (model/moe.py) with empty groups, eager and replayed from a CUDA graph (a
    host sync in it breaks capture). Reported, not fatal: gpu_check's sections have no MoE. Returns the
    failures (tests/bench/test_gpu_lease.py runs it on CPU, without the graph)."""
    import tomllib

    import torch
    from packaging.requirements import Requirement

    from mmserve.model.moe import Experts, grouped, per_expert
    from mmserve.model.spec import MoeSpec

    failures = []
    wanted = next(r for r in map(Requirement, tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                                 ["dependencies"]) if r.name == "torch")
    if not wanted.specifier.contains(torch.__version__, prereleases=True):
        failures.append(f"torch {torch.__version__} is outside pyproject's {wanted.specifier}")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    experts = Experts(64, MoeSpec(num_experts=8, top_k=2, intermediate=32)).to(device, dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
        rows, counts = torch.randn(12, 64, device=device, dtype=dtype), torch.tensor([5, 0, 3, 0, 0, 4, 0, 0], device=device)
        try:
            torch.testing.assert_close(grouped(rows, counts.cumsum(0), experts.gate_up_proj, experts.down_proj),
                                       per_expert(rows, counts.tolist(), experts.gate_up_proj, experts.down_proj),
                                       rtol=5e-2, atol=5e-2)
            if device == "cuda":
                x = torch.randn(16, 64, device=device, dtype=dtype)
                weights, ids = torch.rand(16, 2, device=device), torch.randint(0, 8, (16, 2), device=device)
                experts(x, weights, ids)   # warm-up, outside the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = experts(x, weights, ids)
                x.normal_()
                graph.replay()
                torch.testing.assert_close(out, experts(x, weights, ids))
        except Exception as exc:
            failures.append(f"MoE grouped GEMM on {device}: {type(exc).__name__}: {str(exc)[:300]}")
    for failure in failures or ["torch probes passed"]:
        print(f"{'warn' if failures else 'ok  '} torch {torch.__version__}: {failure}")
    return failures


def python312() -> str | None:
    """A Python 3.12 that runs (a pyenv shim on the PATH may not)."""
    candidates = [os.environ.get("GPU_LEASE_PY312"), *map(str, sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))),
                  shutil.which("python3.12")]
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "--version"], capture_output=True).returncode == 0:
            return candidate
    return None


def dry_run(site: Path) -> int:
    failed = 0
    py312 = python312()
    pure = next(Path(p) for p in sys.path if p.endswith("site-packages"))   # typing_extensions and such
    if py312 is None:
        print("SKIP cp312 imports: no Python 3.12 here (set GPU_LEASE_PY312)")
    else:
        env = dict(os.environ, PYTHONPATH=f"{site}:{pure}")
        for name in SELF_CONTAINED_CP312:
            proc = subprocess.run([py312, "-c", f"import {name}; print({name}.__file__)"], env=env,
                                  capture_output=True, text=True, timeout=120)
            ok = proc.returncode == 0 and str(site) in proc.stdout
            print(f"{'ok  ' if ok else 'FAIL'} cp312 import {name}: {(proc.stdout or proc.stderr).strip()[-200:]}")
            failed += not ok
    mlir = list((site / "nvidia_cutlass_dsl").rglob("*cpython-312*.so"))
    print(f"{'ok  ' if mlir else 'FAIL'} CuTe DSL cp312 libraries: {len(mlir)}")
    failed += not mlir
    with tempfile.TemporaryDirectory() as tmp:
        for name in PURE_FA4:
            (Path(tmp) / name).symlink_to(site / name)
        env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}:{tmp}", MMSERVE_REQUIRE_FA4_CHECK="1")
        where = subprocess.run([sys.executable, "-c", "import flash_attn.cute, quack; print(flash_attn.cute.__file__)"],
                               env=env, capture_output=True, text=True, timeout=120).stdout.strip()
        print(f"FA4 sources from {where}")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               str(ROOT / "tests/attention/test_attn_fa4_compile.py")], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        ok = proc.returncode == 0 and tmp in where
        print(f"{'ok  ' if ok else 'FAIL'} FA4 under FakeTensorMode: {proc.stdout.strip().splitlines()[-1]}")
        failed += not ok
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--site", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    return dry_run(args.site) if args.dry_run else on_device(args.site)


if __name__ == "__main__":
    sys.exit(main())
