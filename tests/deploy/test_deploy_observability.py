"""The observability overlay wires up: Prometheus scrapes the server pods where their annotations say
(OpenMetrics, exemplar storage on), Grafana's datasources reach the overlay's Prometheus and Jaeger
and map exemplars' trace ids to Jaeger, and it provisions deploy/grafana/mmserve.json unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from deploy_k8s import K8S_DIR, config_env, container, find

DASHBOARD = K8S_DIR.parent / "grafana" / "mmserve.json"


def _mounted_config(docs: list[dict], deployment: dict, container_name: str, path: str) -> str:
    """The text of the file at `path` in the container, from the ConfigMap volume mounted above it."""
    c = container(deployment, container_name)
    mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"])
    return cm["data"][Path(path).relative_to(mount["mountPath"]).as_posix()]


def _service_url(docs: list[dict], name: str, port_name: str) -> str:
    svc = find(docs, "Service", name)
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == port_name)
    return f"http://{name}:{port}"


def test_prometheus_scrapes_the_server_pods_with_exemplars(rendered):
    docs = rendered["observability"]
    deployment = find(docs, "Deployment", "prometheus")
    args = container(deployment, "prometheus")["args"]
    assert "--enable-feature=exemplar-storage" in args
    (config_arg,) = [a for a in args if a.startswith("--config.file=")]
    cfg = yaml.safe_load(_mounted_config(docs, deployment, "prometheus", config_arg.split("=", 1)[1]))
    (job,) = cfg["scrape_configs"]
    assert job["scrape_protocols"][0].startswith("OpenMetricsText"), "only OpenMetrics carries exemplars"
    relabel = {tuple(r["source_labels"]): r for r in job["relabel_configs"]}
    keep = relabel[("__meta_kubernetes_pod_annotation_prometheus_io_scrape",)]
    port_rule = relabel[("__address__", "__meta_kubernetes_pod_annotation_prometheus_io_port")]
    path_rule = relabel[("__meta_kubernetes_pod_annotation_prometheus_io_path",)]
    assert (keep["action"], keep["regex"]) == ("keep", "true")
    assert {r.get("target_label") for r in job["relabel_configs"]} >= {"namespace", "pod"}, "the HPA adapter rule needs them"
    for overlay in ("cpu", "gpu"):
        server = find(rendered[overlay], "Deployment", "mmserve")
        annotations = server["spec"]["template"]["metadata"]["annotations"]
        metrics_port = next(p["containerPort"] for p in container(server, "mmserve")["ports"] if p["name"] == "metrics")
        assert annotations["prometheus.io/scrape"] == keep["regex"]
        assert int(annotations["prometheus.io/port"]) == metrics_port
        assert int(config_env(rendered[overlay], server, "mmserve")["MMSERVE_METRICS_PORT"]) == metrics_port
        assert annotations["prometheus.io/path"] == "/metrics"
        assert port_rule["target_label"] == "__address__" and path_rule["target_label"] == "__metrics_path__"
    # Pod discovery needs list/watch on pods, granted to the Deployment's service account.
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    binding = find(docs, "RoleBinding")
    role = find(docs, "Role", binding["roleRef"]["name"])
    assert {"kind": "ServiceAccount", "name": account} in [{k: s[k] for k in ("kind", "name")} for s in binding["subjects"]]
    assert any("pods" in r["resources"] and {"list", "watch"} <= set(r["verbs"]) for r in role["rules"])


def test_grafana_provisions_datasources_and_the_dashboard(rendered):
    docs = rendered["observability"]
    deployment = find(docs, "Deployment", "grafana")
    datasources = yaml.safe_load(_mounted_config(
        docs, deployment, "grafana", "/etc/grafana/provisioning/datasources/datasources.yaml"))["datasources"]
    by_type = {d["type"]: d for d in datasources}
    assert by_type["prometheus"]["url"] == _service_url(docs, "prometheus", "web")
    assert by_type["jaeger"]["url"] == _service_url(docs, "jaeger", "ui")
    (destination,) = by_type["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert destination == {"name": "trace_id", "datasourceUid": by_type["jaeger"]["uid"]}, \
        "the exemplar label the server writes is trace_id"

    providers = yaml.safe_load(_mounted_config(
        docs, deployment, "grafana", "/etc/grafana/provisioning/dashboards/mmserve.yaml"))["providers"]
    (provider,) = providers
    dashboard_path = provider["options"]["path"] + "/mmserve.json"
    provisioned = _mounted_config(docs, deployment, "grafana", dashboard_path)
    assert provisioned == DASHBOARD.read_text()
    dashboard = json.loads(provisioned)
    uids = {d["uid"] for d in datasources}
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] in uids, panel["title"]
        assert all(t["datasource"]["uid"] in uids for t in panel["targets"]), panel["title"]
    home = next(e["value"] for e in container(deployment, "grafana")["env"]
                if e["name"] == "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    assert home == dashboard_path
