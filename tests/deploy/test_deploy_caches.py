"""Compiled kernels survive restarts on GPU: the CUDA image and the gpu overlay point FA4's, the CuTe
DSL's, TorchInductor's and Triton's caches (and the device-peaks cache) into /cache, the image declares
it a volume, the overlay backs it with a persistent claim, and the variable names are the ones those
packages really read (their installed sources are checked where present)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from deploy_dockerfile import parse
from deploy_k8s import config_env, container, find

from mmserve.metrics.peaks import ENV_PEAKS_CACHE

CACHE_ROOT = "/cache"
CACHE_DIRS = {  # variable -> (module whose source reads it, the text that shows it does)
    "TORCHINDUCTOR_CACHE_DIR": ("torch._inductor.runtime.cache_dir_utils", '"TORCHINDUCTOR_CACHE_DIR"'),
    "TRITON_CACHE_DIR": ("torch._inductor.runtime.cache_dir_utils", '"TRITON_CACHE_DIR"'),
    "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": ("flash_attn.cute.cache_utils", '"FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"'),
    "CUTE_DSL_CACHE_DIR": ("cutlass.base_dsl.env_manager", 'env_var("CACHE_DIR"'),  # [DSL_NAME]_CACHE_DIR
    ENV_PEAKS_CACHE: (None, None),
}
ENABLE = {"FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1"}  # FA4 caches to disk only when asked
CUDA_DOCKERFILE = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "Dockerfile.cuda"


def test_gpu_pods_keep_every_compile_cache_on_a_persistent_volume(rendered):
    docs = rendered["gpu"]
    deployment = find(docs, "Deployment", "mmserve")
    env = config_env(docs, deployment, "mmserve")
    mount = next(m for m in container(deployment, "mmserve")["volumeMounts"] if m["mountPath"] == CACHE_ROOT)
    assert not mount.get("readOnly")
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    claim = find(docs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert "ReadWriteMany" in claim["spec"]["accessModes"], "replicas share the compiled kernels"
    for name in CACHE_DIRS:
        assert env[name].startswith(CACHE_ROOT + "/"), name
    assert len({env[name] for name in CACHE_DIRS}) == len(CACHE_DIRS), "each cache its own directory"
    assert {k: env[k] for k in ENABLE} == ENABLE


def test_cuda_image_sets_the_same_cache_paths_on_a_volume(rendered):
    final = parse(CUDA_DOCKERFILE).stages[-1]
    image_env = final.env()
    pod_env = config_env(rendered["gpu"], find(rendered["gpu"], "Deployment", "mmserve"), "mmserve")
    for name in [*CACHE_DIRS, *ENABLE]:
        assert image_env[name] == pod_env[name], name
    volumes = [v for i in final.all("VOLUME") for v in (i.exec_form() or i.value.split())]
    assert CACHE_ROOT in volumes
    assert any(CACHE_ROOT in i.value and "chown" in i.value for i in final.all("RUN")), "the runtime user writes it"


@pytest.mark.parametrize("name", [n for n, (module, _) in CACHE_DIRS.items() if module])
def test_cache_variables_are_what_the_packages_read(name):
    module, needle = CACHE_DIRS[name]
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        spec = None
    if spec is None or spec.origin is None:
        pytest.skip(f"{module} is not installed here (the fa4-check extra installs it)")
    assert needle in Path(spec.origin).read_text(), f"{module} no longer reads {name}"
