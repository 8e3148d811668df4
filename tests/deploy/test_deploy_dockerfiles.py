"""The images: non-root, exec-form entrypoint (SIGTERM reaches the server), ports and health check
that match the server and the manifests, sources that exist and pass the .dockerignore."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import pytest
import yaml
from deploy_dockerfile import Dockerfile, Instruction, parse

from mmserve import config
from mmserve.metrics import peaks
from mmserve.server.health import GENERATION_SERVICE

ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = ROOT / "deploy" / "docker"
IMAGES = ("cpu", "cuda")


@pytest.fixture(scope="module", params=IMAGES)
def image(request) -> tuple[Path, Dockerfile]:
    path = DOCKER_DIR / f"Dockerfile.{request.param}"
    return path, parse(path)


def k8s_grpc_port() -> int:
    deployment = yaml.safe_load((ROOT / "deploy/k8s/base/deployment.yaml").read_text())
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")


def admitted(path: str, ignore_file: Path) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a parent covers children."""
    keep = True
    parts = path.split("/")
    for line in ignore_file.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatch("/".join(parts[:n]), pattern) for n in range(1, len(parts) + 1)):
            keep = negate
    return keep


def test_final_stage_runs_as_a_non_root_user(image):
    _, df = image
    final = df.stages[-1]
    (user,) = final.all("USER")
    name = user.value.split(":")[0]
    assert name not in ("root", "0")
    runs = final.all("RUN")
    assert any(name in r.value for r in runs if "useradd" in r.value), "the user is created in the image"
    entry = final.all("ENTRYPOINT")[0]
    assert user.line < entry.line


def test_entrypoint_is_exec_form_and_runs_mmserve_serve(image):
    _, df = image
    final = df.stages[-1]
    (entry,), (cmd,) = final.all("ENTRYPOINT"), final.all("CMD")
    argv = entry.exec_form()
    assert argv is not None, "shell form wraps the server in /bin/sh -c, which does not forward SIGTERM"
    assert cmd.exec_form() == ["serve"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    program = argv[argv.index("--") + 1] if "--" in argv else argv[0]
    assert program in scripts
    if "--" in argv:  # an init (tini) in front must forward signals to its child
        assert any("tini" in r.value for r in final.all("RUN")), "the init binary is installed"


def test_ports_env_and_health_check_match_server_and_manifests(image):
    _, df = image
    final = df.stages[-1]
    env = final.env()
    port = int(env["MMSERVE_PORT"])
    assert port == k8s_grpc_port()
    assert env["MMSERVE_HOST"] == "0.0.0.0"
    exposed = {int(p.split("/")[0]) for e in final.all("EXPOSE") for p in e.value.split()}
    assert {port, int(env["MMSERVE_METRICS_PORT"])} <= exposed
    known = {n for cls in (config.EngineConfig, config.ServerConfig) for n in config.env_names(cls)}
    known |= {peaks.ENV_PEAK_FLOPS, peaks.ENV_PEAK_BANDWIDTH, peaks.ENV_PEAKS_CACHE}  # read by metrics/peaks.py
    assert sorted(k for k in env if k.startswith("MMSERVE_") and k not in known) == []

    (hc,) = final.all("HEALTHCHECK")
    flags, words = hc.flags_and_args()
    assert words[0] == "CMD"
    probe = Instruction("CMD", hc.value[hc.value.index("CMD") + 3:].strip(), hc.line).exec_form()
    assert probe is not None, "exec form: no shell needed in the image to run the check"
    script = probe[1]
    assert any(script in c.value for c in final.all("COPY")), "the health check script is in the image"
    assert probe[probe.index("--port") + 1] == str(port)
    assert probe[probe.index("--service") + 1] == GENERATION_SERVICE
    assert {"interval", "timeout", "start-period"} <= set(flags)


def test_models_and_media_volumes(image):
    """Checkpoints mount at /models; uploads go where MMSERVE_MEDIA_DIR points, a volume the server's
    user owns (gigabytes of video must not land on the container's writable layer)."""
    _, df = image
    final = df.stages[-1]
    volumes = [v for i in final.all("VOLUME") for v in (i.exec_form() or i.value.split())]
    media_dir = final.env()["MMSERVE_MEDIA_DIR"]
    assert "/models" in volumes and media_dir in volumes
    chowns = [r.value for r in final.all("RUN") if "chown" in r.value]
    assert any(media_dir in r for r in chowns), "the non-root user can write the media volume"


def test_torch_threads_follow_the_container_limit(image):
    """No OMP_NUM_THREADS baked in: it would override the cgroup quota the engine sizes its pool from."""
    _, df = image
    assert "OMP_NUM_THREADS" not in df.stages[-1].env()


def test_copy_sources_exist_and_pass_the_dockerignore(image):
    path, df = image
    ignore = path.with_name(path.name + ".dockerignore")
    assert ignore.exists(), "BuildKit reads <Dockerfile>.dockerignore; without it the context holds .venv"
    names = {s.name for s in df.stages if s.name}
    for stage in df.stages:
        for copy in stage.all("COPY"):
            flags, words = copy.flags_and_args()
            sources = words[:-1]
            if "from" in flags:
                assert flags["from"] in names or "${" in flags["from"] or ":" in flags["from"]
                continue
            for src in sources:
                assert (ROOT / src).exists(), f"{path.name}:{copy.line}: {src} missing"
                assert admitted(src, ignore), f"{path.name}:{copy.line}: {src} excluded by {ignore.name}"
    assert not admitted(".venv", ignore) and not admitted("tests/test_api_stubs.py", ignore)


def test_base_images_come_from_declared_args(image):
    _, df = image
    declared = {a.value.split("=")[0] for a in df.global_args}
    for stage in df.stages:
        if stage.base.startswith("${"):
            assert stage.base[2:-1] in declared
        else:
            assert stage.base in {s.name for s in df.stages}


def test_cpu_image_installs_cpu_torch_before_the_package():
    build = parse(DOCKER_DIR / "Dockerfile.cpu").stages[0]
    runs = [r.value for r in build.all("RUN") if "pip install" in r.value]
    torch_at = next(i for i, r in enumerate(runs) if "torch==" in r)
    assert "download.pytorch.org/whl/cpu" in runs[torch_at]
    assert torch_at < next(i for i, r in enumerate(runs) if "/src" in r)


def test_cuda_image_installs_the_gpu_extra():
    build = parse(DOCKER_DIR / "Dockerfile.cuda").stages[1]
    assert any("/src[gpu]" in r.value for r in build.all("RUN"))
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "gpu" in extras
