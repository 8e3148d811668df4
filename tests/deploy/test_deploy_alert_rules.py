"""The alert rules: `promtool check rules` accepts them, `promtool test rules` shows each alert firing
on the series of its failure and staying quiet otherwise (those a live server cannot drive here:
latency, saturation, cache and MFU collapse; tests/metrics/test_prometheus_e2e.py drives the others
against a real server), the PrometheusRule carries the same groups, and the observability overlay's
Prometheus loads the file."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from deploy_k8s import K8S_DIR, container, find

sys.path.insert(0, str(K8S_DIR.parents[1] / "scripts"))
from local_prometheus import ALERT_RULES, INSTALL_HINT, in_ci  # noqa: E402

PROMETHEUS_RULE = K8S_DIR / "overlays" / "observability" / "prometheus-rule.yaml"
EXPECTED = {"MMServeNotServing", "MMServeNoReplicaUp", "MMServeHighErrorRate", "MMServeTTFTHigh", "MMServeTPOTHigh",
            "MMServeKVCacheNearlyFull", "MMServeQueueDepthHigh", "MMServePrefixCacheHitRateCollapse",
            "MMServeMFUCollapse"}


def _groups() -> list[dict]:
    return yaml.safe_load(ALERT_RULES.read_text())["groups"]


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if in_ci():
            pytest.fail(f"CI is set but promtool is not installed (make setup-prometheus: {INSTALL_HINT})")
        pytest.skip(f"promtool is not installed: {INSTALL_HINT}")
    return found


def _run(*args: str) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_promtool_checks_the_rules():
    out = _run(_promtool(), "check", "rules", str(ALERT_RULES))
    assert f"SUCCESS: {len(EXPECTED)} rules found" in out


def test_every_alert_is_there_with_severity_and_text():
    rules = [r for g in _groups() for r in g["rules"]]
    assert {r["alert"] for r in rules} == EXPECTED
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_prometheus_rule_has_the_same_groups():
    doc = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert doc["spec"]["groups"] == _groups(), "regenerate prometheus-rule.yaml from deploy/prometheus/alerts.yaml"


def test_observability_prometheus_loads_the_rules(rendered):
    docs = rendered["observability"]
    deployment = find(docs, "Deployment", "prometheus")
    config_cm = find(docs, "ConfigMap", "prometheus-config")
    (pattern,) = yaml.safe_load(config_cm["data"]["prometheus.yml"])["rule_files"]
    mount = next(m for m in container(deployment, "prometheus")["volumeMounts"]
                 if fnmatch.fnmatch(f"{m['mountPath']}/alerts.yaml", pattern))
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    rules_cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"])
    assert rules_cm["data"]["alerts.yaml"] == ALERT_RULES.read_text()


def _bucket_series(histogram: str, slow_le: str, per_minute: int) -> list[dict]:
    """A histogram whose observations all land in the bucket `slow_le` (and above)."""
    bounds = ["0.1", slow_le, "+Inf"]
    return [{"series": f'{histogram}_bucket{{le="{le}"}}', "values": f"0+{0 if le == '0.1' else per_minute}x40"}
            for le in bounds]


UNIT_TESTS = [
    # name, input series (1 m apart), eval time, alert, expected alerts' labels (without severity)
    ("server down", [{"series": 'up{job="mmserve",instance="a"}', "values": "1 1 0x10"},
                     {"series": 'up{job="mmserve",instance="b"}', "values": "1x12"}],
     "6m", "MMServeNotServing", [{"instance": "a", "job": "mmserve"}]),
    ("all up", [{"series": 'up{job="mmserve",instance="a"}', "values": "1x12"}], "10m", "MMServeNotServing", []),
    ("no target at all", [{"series": 'up{job="other"}', "values": "1x12"}], "10m", "MMServeNoReplicaUp", [{}]),
    ("errors by code", [
        {"series": 'mmserve_rpc_requests_total{rpc="Generate",code="OK"}', "values": "0+100x20"},
        {"series": 'mmserve_rpc_requests_total{rpc="Generate",code="UNAVAILABLE"}', "values": "0+20x20"},
        {"series": 'mmserve_rpc_requests_total{rpc="Generate",code="INVALID_ARGUMENT"}', "values": "0+1x20"}],
     "15m", "MMServeHighErrorRate", [{"code": "UNAVAILABLE"}]),
    ("cancellations are not errors", [
        {"series": 'mmserve_rpc_requests_total{rpc="Generate",code="OK"}', "values": "0+100x20"},
        {"series": 'mmserve_rpc_requests_total{rpc="Generate",code="CANCELLED"}', "values": "0+50x20"}],
     "15m", "MMServeHighErrorRate", []),
    ("slow first tokens", _bucket_series("mmserve_time_to_first_token_seconds", "20.0", 10), "30m", "MMServeTTFTHigh",
     [{}]),
    ("fast first tokens", _bucket_series("mmserve_time_to_first_token_seconds", "5.0", 10), "30m", "MMServeTTFTHigh", []),
    ("slow decode", _bucket_series("mmserve_time_per_output_token_seconds", "0.3", 10), "30m", "MMServeTPOTHigh", [{}]),
    ("KV full", [{"series": 'mmserve_kv_cache_usage{instance="a",pool="full_attention"}', "values": "0.95x20"},
                 {"series": 'mmserve_kv_cache_usage{instance="b",pool="full_attention"}', "values": "0.5x20"}],
     "15m", "MMServeKVCacheNearlyFull", [{"instance": "a"}]),
    ("KV full briefly", [{"series": 'mmserve_kv_cache_usage{instance="a",pool="full_attention"}',
                          "values": "0.95x5 0.2x15"}], "15m", "MMServeKVCacheNearlyFull", []),
    ("queue", [{"series": 'mmserve_requests_waiting{instance="a"}', "values": "12x20"}], "15m",
     "MMServeQueueDepthHigh", [{"instance": "a"}]),
    # 6 h at an 80% token hit rate, then 10%.
    ("hit rate collapse", [{"series": "mmserve_prefix_cache_queries_total", "values": "0+100x420"},
                           {"series": "mmserve_prefix_cache_hits_total", "values": "0+80x375 30010+10x45"}],
     "420m", "MMServePrefixCacheHitRateCollapse", [{}]),
    ("steady hit rate", [{"series": "mmserve_prefix_cache_queries_total", "values": "0+100x420"},
                         {"series": "mmserve_prefix_cache_hits_total", "values": "0+80x420"}],
     "420m", "MMServePrefixCacheHitRateCollapse", []),
]


def _mfu_case(device: str, expected: list[dict]):
    """Prefill FLOP/s falls tenfold after 6 h, on `device`."""
    return (f"prefill MFU collapse on {device}", [
        {"series": 'mmserve_perf_flops_total{phase="prefill"}', "values": "0+1e12x375 3.75e14+1e11x45"},
        {"series": 'mmserve_engine_step_duration_seconds_total{phase="prefill"}', "values": "0+1x420"},
        {"series": f'mmserve_device_peaks_info{{device="{device}"}}', "values": "1x420"}],
        "420m", "MMServeMFUCollapse", expected)


UNIT_TESTS += [_mfu_case("NVIDIA H100 80GB HBM3", [{}]), _mfu_case("cpu (x86, 16 threads)", [])]


@pytest.mark.parametrize("name, series, at, alert, expected", UNIT_TESTS, ids=[t[0] for t in UNIT_TESTS])
def test_promtool_unit_test(tmp_path: Path, name, series, at, alert, expected):
    """Each case: the alert's state at `at` on these series, by promtool's own rule evaluator. Annotations
    are stripped from a copy of the rules (promtool would compare their rendered text too)."""
    promtool = _promtool()
    groups = _groups()
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations")
    (tmp_path / "alerts.yaml").write_text(yaml.safe_dump({"groups": groups}))
    severity = next(r["labels"]["severity"] for g in groups for r in g["rules"] if r["alert"] == alert)
    test = {"rule_files": ["alerts.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "alert_rule_test": [{"eval_time": at, "alertname": alert,
                             "exp_alerts": [{"exp_labels": {**labels, "severity": severity}} for labels in expected]}],
    }]}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    _run(promtool, "test", "rules", str(tmp_path / "test.yaml"))
