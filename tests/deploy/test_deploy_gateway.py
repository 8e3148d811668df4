"""The `gateway` overlay (SMG in front of the mmserve pods) and the `llm-d` InferencePool overlay,
checked offline against the server overlay they sit beside: SMG's container args parse with the
real `smg` argument parser, its discovery finds the pods the server overlays label, on their gRPC
port, with no more RBAC than listing pods; probes and scraping reach SMG's own ports; the image
pins the same `smg` the tests run; the InferencePool selects the same pods and port over h2c."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from deploy_dockerfile import parse as parse_dockerfile
from deploy_k8s import config_env, container, find, render

from mmserve.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]


def server_pod(rendered) -> tuple[dict, dict]:
    deployment = find(rendered["cpu"], "Deployment", "mmserve")
    return deployment["spec"]["template"]["metadata"]["labels"], container(deployment, "mmserve")


def smg(rendered) -> tuple[dict, dict]:
    deployment = find(rendered["gateway"], "Deployment", "smg")
    return deployment, container(deployment, "smg")


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_smg_args_parse_with_the_real_smg_and_name_cache_aware(rendered):
    from smg.launch_router import parse_router_args

    _, c = smg(rendered)
    assert c["args"][0] == "launch"
    args = [a.replace("$(POD_NAMESPACE)", "mmserve") for a in c["args"][1:]]
    parsed = parse_router_args(args)
    assert parsed.policy == "cache_aware" and parsed.service_discovery
    assert parsed.service_discovery_namespace == "mmserve"
    env = {e["name"] for e in c["env"]}
    assert "POD_NAMESPACE" in env and "$(POD_NAMESPACE)" in c["args"]


def test_discovery_finds_the_server_pods_on_their_grpc_port(rendered):
    labels, server = server_pod(rendered)
    _, c = smg(rendered)
    selector = dict(s.split("=", 1) for s in [flag(c["args"], "--selector")])
    assert selector.items() <= labels.items()
    grpc_port = next(p["containerPort"] for p in server["ports"] if p["name"] == "grpc")
    assert int(flag(c["args"], "--service-discovery-port")) == grpc_port


def test_rbac_lets_smg_read_pods_and_nothing_more(rendered):
    docs = rendered["gateway"]
    deployment, _ = smg(rendered)
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    binding = find(docs, "RoleBinding", "smg")
    assert {"kind": "ServiceAccount", "name": account} in [
        {k: s[k] for k in ("kind", "name")} for s in binding["subjects"]]
    role = find(docs, "Role", binding["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]


def test_probes_and_scraping_reach_smgs_own_ports(rendered):
    deployment, c = smg(rendered)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == int(flag(c["args"], "--port"))
    assert ports["metrics"] == int(flag(c["args"], "--prometheus-port"))
    assert c["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": ports["http"]}
    assert c["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": ports["http"]}
    notes = deployment["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and int(notes["prometheus.io/port"]) == ports["metrics"]
    # Nothing may look the tokenizer up off the cluster: the Hub endpoint is a closed loopback port.
    hf = next(e["value"] for e in c["env"] if e["name"] == "HF_ENDPOINT")
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", hf)


def test_the_smg_image_pins_the_tested_smg_and_runs_unprivileged():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pin = next(d for d in pyproject["project"]["optional-dependencies"]["dev"] if d.startswith("smg=="))
    dockerfile = parse_dockerfile(ROOT / "deploy" / "docker" / "Dockerfile.smg")
    stage = dockerfile.stages[-1]
    assert any(f"pip install {pin}" in i.value for i in stage.instructions if i.keyword == "RUN")
    user = [i.value for i in stage.instructions if i.keyword == "USER"]
    assert user and not user[-1].startswith(("0", "root"))
    entry = next(i for i in stage.instructions if i.keyword == "ENTRYPOINT").exec_form()
    assert entry is not None and entry[-1] == "smg"


@pytest.fixture(scope="module")
def llm_d(rendered):
    return render("llm-d")


def test_the_inference_pool_selects_the_server_pods_over_h2c(rendered, llm_d):
    labels, server = server_pod(rendered)
    pool = find(llm_d, "InferencePool", "mmserve")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    grpc_port = next(p["containerPort"] for p in server["ports"] if p["name"] == "grpc")
    assert pool["spec"]["targetPorts"] == [{"number": grpc_port}]
    assert pool["spec"]["appProtocol"] == "kubernetes.io/h2c"
    assert pool["spec"]["endpointPickerRef"]["name"]


def epp_config(llm_d) -> dict:
    return yaml.safe_load(find(llm_d, "ConfigMap", "mmserve-epp-config")["data"]["epp-config.yaml"])


def test_the_epp_scrapes_the_pods_metrics_port_with_vllms_names(llm_d):
    """The EPP's metrics source scrapes each pod's metrics port, not the pool's target port (gRPC,
    where its HTTP GET finds nothing), and feeds the core metrics extractor, which picks the metric
    names by the pods' engine-type label: vLLM's, the set mmserve exports beside its own."""
    deployment = find(llm_d, "Deployment", "mmserve")
    c = container(deployment, "mmserve")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    env = config_env(llm_d, deployment, "mmserve")
    epp = epp_config(llm_d)
    plugins = {p.get("name", p["type"]): p for p in epp["plugins"]}
    [source] = [s for s in epp["dataLayer"]["sources"] if plugins[s["pluginRef"]]["type"] == "metrics-data-source"]
    assert plugins[source["pluginRef"]]["parameters"]["port"] == ports["metrics"] == int(env["MMSERVE_METRICS_PORT"])
    assert ports["metrics"] not in [t["number"] for t in find(llm_d, "InferencePool", "mmserve")["spec"]["targetPorts"]]
    [extractor] = [plugins[e["pluginRef"]] for e in source["extractors"]]
    assert extractor["type"] == "core-metrics-extractor"
    # llm-d-router's default engine label key, and its built-in engine type whose names are vLLM's
    label = extractor.get("parameters", {}).get("engineLabelKey", "llm-d.ai/engine-type")
    assert deployment["spec"]["template"]["metadata"]["labels"][label] == "vllm"


def test_the_llm_d_overlay_validates_apart_from_the_crd(llm_d):
    version = kubernetes_validate.latest_version()
    for doc in llm_d:
        if doc["kind"] != "InferencePool":   # a CRD: its fields are checked above
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_llm_d_pods_publish_kv_events_where_the_scorer_subscribes(llm_d):
    """Each pod's --kv-events-config parses as the server parses it (POD_IP defined before the value
    that expands it), binds the ports the pods declare; the EPP config's precise prefix-cache scorer
    finds those pods by label and subscribes to those ports with a matching topic filter and block size."""
    from mmserve.server.kv_event_publisher import KvEventsConfig

    deployment = find(llm_d, "Deployment", "mmserve")
    c = container(deployment, "mmserve")
    names = [e["name"] for e in c["env"]]
    assert names.index("POD_IP") < names.index("MMSERVE_KV_EVENTS_CONFIG")
    pod_ip = next(e for e in c["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    text = next(e["value"] for e in c["env"] if e["name"] == "MMSERVE_KV_EVENTS_CONFIG")
    events = KvEventsConfig.parse(text.replace("$(POD_IP)", "10.0.0.7"))
    assert events.enabled and events.topic == "kv@10.0.0.7@demo_model"   # the served model's name
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert events.endpoint == f"tcp://*:{ports['kv-events']}" and events.replay_endpoint == f"tcp://*:{ports['kv-replay']}"

    epp = epp_config(llm_d)
    assert epp["kind"] == "EndpointPickerConfig"
    scorer = next(p for p in epp["plugins"] if p["type"] == "precise-prefix-cache-scorer")["parameters"]
    kv = scorer["kvEventsConfig"]
    assert kv["discoverPods"] and events.topic.startswith(kv["topicFilter"])
    discovery = kv["podDiscoveryConfig"]
    assert discovery["socketPort"] == ports["kv-events"]
    assert "replaySocketPort" not in discovery   # v0.10.0's replay never indexes a long-lived pod (gateway.md)
    selector = dict(s.split("=", 1) for s in discovery["podLabelSelector"].split(","))
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert discovery["podNamespace"] == deployment["metadata"]["namespace"]
    block_size = int(config_env(llm_d, deployment, "mmserve").get("MMSERVE_BLOCK_SIZE", EngineConfig().block_size))
    assert scorer["tokenProcessorConfig"]["blockSize"] == block_size
    # llm-d-router v0.9.0 on: the scorer subscribes to the pods the endpoint notifications name
    sources = {s["pluginRef"]: [e["pluginRef"] for e in s["extractors"]] for s in epp["dataLayer"]["sources"]}
    assert "precise-prefix-cache-scorer" in sources["endpoint-notification-source"]
    # the requests are VllmEngine/Generate over h2c (the InferencePool's protocol): the vllmgrpc parser's
    assert [p["pluginRef"] for p in epp["requestHandler"]["parsers"]] == ["vllmgrpc-parser"]
    profile = {p["pluginRef"] for prof in epp["schedulingProfiles"] for p in prof["plugins"]}
    wired = {*sources, *(e for extractors in sources.values() for e in extractors), "vllmgrpc-parser"}
    assert {p["type"] for p in epp["plugins"]} == profile | wired | {"single-profile-handler"}
