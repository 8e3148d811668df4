"""The manifests agree with the code they deploy: health service names, ports, drain grace, every
MMSERVE_* variable and --flag, the OTLP path pods -> collector -> Jaeger, and Service -> pod wiring."""

from __future__ import annotations

import argparse
import importlib.util
from urllib.parse import urlsplit

import pytest
import yaml
from deploy_k8s import OVERLAYS, SERVER_OVERLAYS, config_env, container, find

from mmserve import cli, config
from mmserve.metrics import peaks
from mmserve.metrics.prometheus import PROMETHEUS_NAMES
from mmserve.metrics.tracing import traces_endpoint
from mmserve.server.health import GENERATION_SERVICE, OVERALL

CONFIG_CLASSES = (config.EngineConfig, config.ServerConfig)
PEAKS_ENV = (peaks.ENV_PEAK_FLOPS, peaks.ENV_PEAK_BANDWIDTH, peaks.ENV_PEAKS_CACHE)  # read by metrics/peaks.py
DRAIN_MARGIN_S = 5


def server(docs: list[dict]) -> tuple[dict, dict]:
    deployment = find(docs, "Deployment", "mmserve")
    return deployment, container(deployment, "mmserve")


def port_named(c: dict, name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_probes_ask_the_servers_health_services_on_its_port(rendered, overlay):
    _, c = server(rendered[overlay])
    env = config_env(rendered[overlay], find(rendered[overlay], "Deployment", "mmserve"), "mmserve")
    grpc_port = port_named(c, "grpc")
    assert grpc_port == int(env["MMSERVE_PORT"])
    assert env["MMSERVE_HOST"] == "0.0.0.0", "probes dial the pod IP, so the server must not bind loopback"
    expected = {"livenessProbe": OVERALL, "readinessProbe": GENERATION_SERVICE, "startupProbe": GENERATION_SERVICE}
    for probe, service in expected.items():
        assert c[probe]["grpc"] == {"port": grpc_port, "service": service}, probe


def test_startup_probe_allows_longer_model_loads_on_gpu(rendered):
    def budget_s(overlay: str) -> int:
        probe = server(rendered[overlay])[1]["startupProbe"]
        return probe["periodSeconds"] * probe["failureThreshold"]

    assert budget_s("cpu") >= 120
    assert budget_s("gpu") >= 600


def serving_and_worker_pods(docs: list[dict]) -> tuple[dict, list[dict]]:
    """The pod template that runs `mmserve serve`, and those of its tensor-parallel workers: a
    Deployment's (no workers), or a LeaderWorkerSet's leader and workers."""
    sets = [d for d in docs if d["kind"] == "LeaderWorkerSet"]
    if not sets:
        return find(docs, "Deployment", "mmserve")["spec"]["template"], []
    group = find(sets, "LeaderWorkerSet", "mmserve")["spec"]["leaderWorkerTemplate"]
    return group["leaderTemplate"], [group["workerTemplate"]]


@pytest.mark.parametrize("overlay", (*SERVER_OVERLAYS, "multinode"))
def test_termination_grace_covers_prestop_and_drain(rendered, overlay):
    """The server's pod outlives its preStop and drain; a tensor-parallel worker pod outlives the
    server's pod (a group's pods get SIGTERM together, and the drain needs the worker's ranks)."""
    docs = rendered[overlay]
    serving, workers = serving_and_worker_pods(docs)
    env = config_env(docs, {"spec": {"template": serving}}, "mmserve")
    drain_s = float(env.get("MMSERVE_DRAIN_GRACE_S", config.ServerConfig.drain_grace_s))
    pre_stop_s = container({"spec": {"template": serving}}, "mmserve")["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace_s = serving["spec"]["terminationGracePeriodSeconds"]
    assert grace_s >= pre_stop_s + drain_s + DRAIN_MARGIN_S
    for worker in workers:
        assert worker["spec"]["terminationGracePeriodSeconds"] >= grace_s + DRAIN_MARGIN_S


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_every_mmserve_variable_exists_and_parses(rendered, overlay, monkeypatch):
    deployment, _ = server(rendered[overlay])
    env = {k: v for k, v in config_env(rendered[overlay], deployment, "mmserve").items() if k.startswith("MMSERVE_")}
    flags = {name for cls in CONFIG_CLASSES for name in config.env_names(cls)}
    assert sorted(set(env) - flags - set(PEAKS_ENV)) == []
    env = {k: v for k, v in env.items() if k in flags}
    # The server reads these through its own argparse defaults: a value of the wrong type fails here.
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    for cls in CONFIG_CLASSES:
        config.add_dataclass_args(parser, cls)
    args = parser.parse_args([])
    for name, value in env.items():
        field = name.removeprefix("MMSERVE_").lower()
        assert getattr(args, field) == type(getattr(args, field))(value), name


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_every_flag_exists(rendered, overlay):
    args = server(rendered[overlay])[1]["args"]
    top, serve = args[: args.index("serve")], args[args.index("serve") + 1:]
    top_flags = {s for a in cli.build_parser(["serve"])._actions for s in a.option_strings}
    serve_flags = {f for cls in CONFIG_CLASSES for f in config.flag_names(cls)}
    assert [a for a in top if a.startswith("--") and a not in top_flags] == []
    assert [a for a in serve if a.startswith("--") and a.split("=")[0] not in serve_flags] == []


@pytest.mark.skipif(importlib.util.find_spec("mmserve.server.cli") is None,
                    reason="mmserve.server.cli (the `serve` subcommand) has not landed yet")
@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_the_real_cli_parses_the_container_args(rendered, overlay):
    args = server(rendered[overlay])[1]["args"]
    parsed = cli.build_parser(args).parse_args(args)
    assert parsed.command == "serve" and hasattr(parsed, "func")


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_services_headless_and_clusterip_reach_the_grpc_port(rendered, overlay):
    docs = rendered[overlay]
    deployment, c = server(docs)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    headless = find(docs, "Service", "mmserve-headless")
    cluster_ip = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "mmserve")
    assert headless["spec"]["clusterIP"] == "None"
    assert cluster_ip["spec"]["type"] == "ClusterIP"
    for svc in (headless, cluster_ip):
        grpc = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
        assert port_named(c, grpc["targetPort"]) == port_named(c, "grpc")
        assert svc["spec"]["selector"].items() <= labels.items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_port_lands_on_a_selected_container_port(rendered, overlay):
    docs = rendered[overlay]
    pods = [d["spec"]["template"] for d in docs if d["kind"] == "Deployment"]
    for svc in (d for d in docs if d["kind"] == "Service"):
        selected = [p for p in pods if svc["spec"]["selector"].items() <= p["metadata"]["labels"].items()]
        assert selected, f"Service {svc['metadata']['name']} selects no pod"
        ports = {(p["name"], p["containerPort"]) for pod in selected
                 for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        for sp in svc["spec"]["ports"]:
            target = sp.get("targetPort", sp["port"])
            assert any(target in pair for pair in ports), f"{svc['metadata']['name']}:{sp['port']} -> {target}"


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_pdb_and_hpa_govern_the_server(rendered, overlay):
    docs = rendered[overlay]
    deployment, _ = server(docs)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    pdb, hpa = find(docs, "PodDisruptionBudget"), find(docs, "HorizontalPodAutoscaler")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["maxUnavailable"], "an eviction must leave a replica serving"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == PROMETHEUS_NAMES["mmserve.requests.waiting"]


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_shared_memory_and_model_volumes(rendered, overlay):
    deployment, c = server(rendered[overlay])
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm" and volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert mounts["models"] == "/models"
    model = config_env(rendered[overlay], deployment, "mmserve").get("MMSERVE_MODEL")
    if overlay == "gpu":
        claim = volumes["models"]["persistentVolumeClaim"]["claimName"]
        assert find(rendered[overlay], "PersistentVolumeClaim", claim)["metadata"]["name"] == claim
        assert model is not None and model.startswith("/models/")
    else:
        assert model is None, "the cpu overlay serves the embedded demo model"


def test_gpu_overlay_requests_one_gpu_and_cpu_none(rendered):
    gpu = server(rendered["gpu"])[1]["resources"]
    assert gpu["limits"]["nvidia.com/gpu"] == gpu["requests"]["nvidia.com/gpu"] == "1"
    env = config_env(rendered["gpu"], server(rendered["gpu"])[0], "mmserve")
    assert env["MMSERVE_DEVICE"] == "cuda"
    # the KV cache is sized from the GPU's memory, not a byte count fit to one GPU model
    assert float(env["MMSERVE_GPU_MEMORY_UTILIZATION"]) == 0.9 and "MMSERVE_KV_CACHE_BYTES" not in env
    cpu = server(rendered["cpu"])[1]["resources"]
    assert "nvidia.com/gpu" not in {**cpu.get("limits", {}), **cpu.get("requests", {})}


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_pods_export_traces_to_the_collector_of_the_observability_overlay(rendered, overlay, monkeypatch):
    deployment, _ = server(rendered[overlay])
    for name, value in config_env(rendered[overlay], deployment, "mmserve").items():
        if name.startswith("OTEL_"):
            monkeypatch.setenv(name, value)
    protocol, url = traces_endpoint(config.ServerConfig.otlp_traces_endpoint or None)  # what the server dials
    endpoint = urlsplit(url)
    collector = find(rendered["observability"], "Service", endpoint.hostname)
    port = next(p for p in collector["spec"]["ports"] if p["port"] == endpoint.port)
    assert protocol == port["appProtocol"] == "grpc"


def test_collector_forwards_to_jaeger(rendered):
    docs = rendered["observability"]
    collector = container(find(docs, "Deployment", "otel-collector"), "otel-collector")
    (config_arg,) = [a for a in collector["args"] if a.startswith("--config=")]
    mount = next(m for m in collector["volumeMounts"] if config_arg.split("=", 1)[1].startswith(m["mountPath"]))
    volume = next(v for v in find(docs, "Deployment", "otel-collector")["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == mount["name"])
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"])
    cfg = yaml.safe_load(cm["data"][config_arg.rsplit("/", 1)[1]])

    for name, pipeline in cfg["service"]["pipelines"].items():
        for section in ("receivers", "processors", "exporters"):
            assert set(pipeline.get(section, [])) <= set(cfg[section]), f"{name}.{section}"
    assert int(cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1]) == port_named(
        collector, "otlp-grpc")
    (exporter,) = cfg["service"]["pipelines"]["traces"]["exporters"]
    host, port = cfg["exporters"][exporter]["endpoint"].rsplit(":", 1)
    jaeger_svc = find(docs, "Service", host)
    assert any(p["port"] == int(port) and p["name"] == "otlp-grpc" for p in jaeger_svc["spec"]["ports"])
    assert {p["port"] for p in jaeger_svc["spec"]["ports"]} >= {4317, 4318, 16686}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_as_non_root_with_resources(rendered, overlay):
    for deployment in (d for d in rendered[overlay] if d["kind"] == "Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert {"cpu", "memory"} <= set(c["resources"]["requests"])


QUANTITY_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity_bytes(value: str) -> int:
    """A Kubernetes quantity ("20Gi", "500M", "1024") in bytes."""
    for unit, factor in QUANTITY_UNITS.items():
        if value.endswith(unit) and value[: -len(unit)].isdigit():
            return int(value[: -len(unit)]) * factor
    return int(value)


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_uploaded_media_have_a_writable_volume_larger_than_the_server_fills(rendered, overlay):
    """--media-dir is a mounted, writable volume (the root filesystem is read-only), and the server's
    own bound stays under the emptyDir's sizeLimit, past which the kubelet would evict the pod."""
    deployment, c = server(rendered[overlay])
    env = config_env(rendered[overlay], deployment, "mmserve")
    media_dir = env["MMSERVE_MEDIA_DIR"]
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == media_dir)
    assert not mount.get("readOnly")
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    max_bytes = int(env.get("MMSERVE_MEDIA_DIR_MAX_BYTES", config.ServerConfig.media_dir_max_bytes))
    max_upload = int(env.get("MMSERVE_MAX_UPLOAD_BYTES", config.ServerConfig.max_upload_bytes))
    assert max_upload <= max_bytes, "an upload larger than the spool could never be stored"
    if "persistentVolumeClaim" not in volume:
        assert max_bytes < quantity_bytes(volume["emptyDir"]["sizeLimit"]), "the spool could outgrow its volume"
