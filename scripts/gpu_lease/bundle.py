"""`make gpu-bundle`: the Python packages a lent GPU lacks (an H100 or an H200: one image), packed to
travel with the lease's calls.

The device image has torch 2.11 (cu130), triton 3.6 and transformers 5.17 but no FA4, cutlass DSL,
PyAV or xgrammar, and nothing can be fetched there; a call carries at most 64 MiB. So: download the
cp312 manylinux wheels below (--no-deps: each needed one is named), unpack them into one site tree
(a wheel is a zip of its install tree), pack it as tar.xz and split it into parts under 48 MiB, with
a manifest of sha256s. Everything lands in .gpu_bundle/ (git-ignored); reruns reuse the wheels.

    python scripts/gpu_lease/bundle.py [--out .gpu_bundle]
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PART_BYTES = 48 * 2**20 - 2**16   # under the 48 MiB a part may have, so a part plus the repo fits one call
LEASE_PARTS = 2   # the lease's calls carry part a (call 1) and part b (call 2); a third needs a re-plan
IMAGE_PACKAGES = Path(__file__).with_name("device_image_packages.txt")


def reference_transformers() -> str:
    """pyproject's dev pin of transformers, the tests' reference: the device runs the one they ran."""
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    specs = [list(Requirement(r).specifier) for r in dev if Requirement(r).name == "transformers"]
    if len(specs) != 1 or len(specs[0]) != 1 or specs[0][0].operator != "==":
        raise SystemExit("pyproject.toml's dev extra must pin transformers exactly (transformers==X): "
                         "the lease bundle carries that version")
    return f"transformers=={specs[0][0].version}"


WHEELS = [
    # FA4 b36 and the CuTe DSL it compiles with (cu13: the image's CUDA)
    "flash-attn-4==4.0.0b36", "nvidia-cutlass-dsl==4.8.1", "nvidia-cutlass-dsl-libs-base==4.8.1",
    "nvidia-cutlass-dsl-libs-core==4.8.1", "nvidia-cutlass-dsl-libs-cu13==4.8.1", "quack-kernels==0.6.5",
    "apache-tvm-ffi==0.1.15.post2", "torch-c-dlpack-ext==0.1.5",
    # mmserve's runtime dependencies the image lacks, or has too old (transformers 5.17)
    reference_transformers(), "av==18.1.0", "xgrammar==0.2.9", "pydantic==2.14.4", "pydantic-core==2.50.5",
    "typing-inspection==0.4.5", "annotated-types==0.8.0", "pyzmq==27.3.0",
    "opentelemetry-api==1.45.2", "opentelemetry-sdk==1.45.2", "opentelemetry-semantic-conventions==0.66b2",
    "opentelemetry-exporter-otlp==1.45.2", "opentelemetry-exporter-otlp-proto-grpc==1.45.2",
    "opentelemetry-exporter-otlp-proto-http==1.45.2", "opentelemetry-exporter-otlp-proto-common==1.45.2",
    "opentelemetry-exporter-otlp-common==0.66b2", "opentelemetry-exporter-http-transport==0.66b2",
    "opentelemetry-proto==1.45.2", "grpcio-health-checking==1.81.1", "grpcio-reflection==1.81.1",
    "googleapis-common-protos==1.76.0", "smg-grpc-proto==0.4.28",
]
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35, 39)] + ["manylinux2014_x86_64",
                                                                                      "manylinux1_x86_64"]
# The cutlass wheel's .pth adds this folder to sys.path; a PYTHONPATH folder's .pth files are not
# read, so the lease scripts add it themselves (else fa4_installed() is True and FA4's import fails).
CUTLASS_PATH = "nvidia_cutlass_dsl/dsl_packages"
# nvidia-cutlass-dsl requires its CUDA 12 libraries by default; the bundle carries the -cu13 build instead
CUTLASS_CU12 = "nvidia-cutlass-dsl-libs-cu12"
# the device's Python, for requirement markers ("extra" empty: no extras are installed)
DEVICE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
                  "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
                  "platform_machine": "x86_64", "os_name": "posix", "extra": ""}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def download(wheels_dir: Path) -> list[Path]:
    wheels_dir.mkdir(parents=True, exist_ok=True)
    have = {normalise(p.name.split("-")[0]): p for p in wheels_dir.glob("*.whl")}
    missing = [w for w in WHEELS if normalise(w.split("==")[0]) not in have]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(wheels_dir),
               *(a for p in PLATFORMS for a in ("--platform", p)), *missing]
        subprocess.run(cmd, check=True)
    wheels = sorted(wheels_dir.glob("*.whl"))
    names = {normalise(p.name.split("-")[0]) for p in wheels}
    absent = [w for w in WHEELS if normalise(w.split("==")[0]) not in names]
    if absent:
        raise SystemExit(f"pip did not download {absent}")
    return wheels


def image_packages() -> dict[str, str | None]:
    """The device image's packages: normalised name -> version where KINDS.md gave one, else None."""
    lines = [line for line in IMAGE_PACKAGES.read_text().split("\n") if line and not line.startswith("#")]
    return {normalise(name): version or None for name, _, version in (line.partition("==") for line in lines)}


def pinned() -> dict[str, str]:
    """The bundle's packages: normalised name -> pinned version."""
    return {normalise(name): version for name, _, version in (w.partition("==") for w in WHEELS)}


def unmet_requirements(needs: dict[str, list[str]], have: dict[str, str | None] | None = None) -> list[str]:
    """Of `needs` (who -> their requirement strings), those that the device would not meet: markers
    evaluated for its Python, the bundle's pins first (they come first on PYTHONPATH), then the
    image's packages, version ranges checked where the version is known (an unknown one passes:
    the lease's import check, which passes what is installed there as `have`, checks it)."""
    have = image_packages() | pinned() if have is None else have
    unmet = set()
    for who, requirements in needs.items():
        for text in requirements:
            req = Requirement(text)
            name = normalise(req.name)
            if (req.marker and not req.marker.evaluate(DEVICE_MARKERS)) or name == CUTLASS_CU12:
                continue
            if name not in have:
                unmet.add(f"{req} (needed by {who}): neither bundled nor in the image")
            elif have[name] and not req.specifier.contains(have[name], prereleases=True):
                unmet.add(f"{req} (needed by {who}): the device would have {have[name]}")
    return sorted(unmet)


def wheel_requirements(wheels: list[Path]) -> dict[str, list[str]]:
    needs = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            parsed = email.parser.Parser().parsestr(z.read(meta).decode())
        needs[parsed["Name"]] = parsed.get_all("Requires-Dist") or []
    return needs


def drift() -> list[str]:
    """Bundled packages whose version in this environment differs from the pin: the device would
    run another version than the tests here did (pyproject's ranges let a new release in)."""
    import importlib.metadata

    out = []
    for name, version in pinned().items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if have != version:
            out.append(f"{name}: the bundle pins {version}, this environment has {have}")
    return out


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def build(out: Path) -> dict:
    wheels = download(out / "wheels")
    site = out / "site"
    shutil.rmtree(site, ignore_errors=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    if not (site / CUTLASS_PATH).is_dir():
        raise SystemExit(f"{CUTLASS_PATH} is not in the site tree: the lease scripts' PYTHONPATH needs updating")
    for cache in site.rglob("__pycache__"):
        shutil.rmtree(cache)
    manifest = pack(site, out)
    manifest["wheels"] = [{"name": w.name, "bytes": w.stat().st_size, "sha256": sha256(w)} for w in wheels]
    manifest["unmet_requirements"] = unmet_requirements(wheel_requirements(wheels))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def pack(site: Path, out: Path, part_bytes: int = PART_BYTES) -> dict:
    """site -> out/part-a, part-b, ... (a tar.xz of `site/` split) and out/manifest.json."""
    out.mkdir(parents=True, exist_ok=True)
    archive = out / "site.tar.xz"
    # xz -9, one thread: the best ratio (99.6 MB from 443 MB), so the bundle is two parts
    with archive.open("wb") as sink, subprocess.Popen(["xz", "-9", "-T1", "-c"], stdin=subprocess.PIPE,
                                                      stdout=sink) as xz:
        with tarfile.open(fileobj=xz.stdin, mode="w|") as tar:
            tar.add(site, arcname="site")
        xz.stdin.close()
    if xz.returncode:
        raise SystemExit("xz failed")
    return split(archive, out, part_bytes, site_bytes=sum(p.stat().st_size for p in site.rglob("*") if p.is_file()))


def split(archive: Path, out: Path, part_bytes: int = PART_BYTES, site_bytes: int = 0) -> dict:
    """archive -> out/part-a, part-b, ... and out/manifest.json; the archive is removed."""
    for old in out.glob("part-*"):
        old.unlink()
    parts = []
    with archive.open("rb") as f:
        while chunk := f.read(part_bytes):
            part = out / f"part-{chr(ord('a') + len(parts))}"
            part.write_bytes(chunk)
            parts.append(part)
    manifest = {"archive": archive.name, "archive_sha256": sha256(archive), "archive_bytes": archive.stat().st_size,
                "site_bytes": site_bytes, "cutlass_path": CUTLASS_PATH,
                "parts": [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256(p)} for p in parts]}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    archive.unlink()   # the parts are the archive
    return manifest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / ".gpu_bundle")
    manifest = build(p.parse_args().out)
    mib = [round(part["bytes"] / 2**20, 1) for part in manifest["parts"]]
    print(f"{len(manifest['wheels'])} wheels, {sum(w['bytes'] for w in manifest['wheels']) / 1e6:.1f} MB; site "
          f"{manifest['site_bytes'] / 1e6:.0f} MB; tar.xz {manifest['archive_bytes'] / 1e6:.1f} MB in parts of {mib} MiB")
    if manifest["unmet_requirements"]:
        print("requirements the device would not meet:", ", ".join(manifest["unmet_requirements"]))
    for line in drift():
        print(f"version drift (re-pin WHEELS to test what the device runs): {line}")
    if len(manifest["parts"]) > LEASE_PARTS:
        print(f"{len(manifest['parts'])} parts, but the lease's calls carry {LEASE_PARTS}: carry the rest in call 3 "
              "and unpack there, or drop a wheel (scripts/gpu_lease/, docs/benchmarks.md)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
