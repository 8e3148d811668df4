"""Rendered kustomize overlays, shared by the deploy tests (rendered once per session)."""

from __future__ import annotations

import shutil

import pytest
from deploy_k8s import OVERLAYS, render


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: cannot render the kustomize overlays")
    return {name: render(name) for name in (*OVERLAYS, "multinode")}
