"""Render the kustomize overlays and look objects up in the output."""

from __future__ import annotations

import subprocess
from pathlib import Path

import kubernetes_validate
import yaml

K8S_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "observability", "gateway")
SERVER_OVERLAYS = ("cpu", "gpu")


def render(overlay: str) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(K8S_DIR / "overlays" / overlay)],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    """The one object of `kind` (whose name starts with `name`: generated ConfigMaps carry a hash)."""
    hits = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"].startswith(name))]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in hits]}"
    return hits[0]


def container(deployment: dict, name: str) -> dict:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def config_env(docs: list[dict], deployment: dict, container_name: str) -> dict[str, str]:
    """The environment the container sees: its ConfigMaps (envFrom) overridden by literal `env`."""
    c = container(deployment, container_name)
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        cm = next(d for d in docs if d["kind"] == "ConfigMap"
                  and d["metadata"]["name"] == source["configMapRef"]["name"])
        env.update(cm["data"])
    env.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    return env


# Every Kubernetes minor from 1.30 to the newest schema the validator ships.
VERSIONS = [f"1.{minor}.0" for minor in range(30, int(kubernetes_validate.latest_version().split(".")[1]) + 1)]


def schema_errors(docs: list[dict]) -> list[str]:
    """Each doc's strict validation errors against every version in VERSIONS, one line each."""
    errors = []
    for version in VERSIONS:
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                errors.append(f"k8s {version} {doc['kind']}/{doc['metadata']['name']}: {e.message}")
    return errors
