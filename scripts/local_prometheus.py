"""A real Prometheus on loopback, scraping mmserve servers, with the shipped alert rules loaded.

Why: the Grafana dashboard's PromQL, the exemplars and the alert rules are only right if Prometheus
itself evaluates them. `make prometheus` runs this for people (it prints the dashboard's queries as
links into Prometheus' UI); tests/metrics/test_prometheus_e2e.py drives the same `LocalPrometheus`.

    python scripts/local_prometheus.py --target 127.0.0.1:9464 [--port 9090]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "mmserve.json"
ALERT_RULES = ROOT / "deploy" / "prometheus" / "alerts.yaml"
INSTALL_HINT = "apt-get update && apt-get install -y prometheus"
JOB = "mmserve"   # the job name the alert rules select (the observability overlay's too)


def in_ci() -> bool:
    """CI is set (as CI systems set it, and .ci/run): a missing Prometheus fails the tests there."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def binary(name: str = "prometheus") -> str | None:
    """The installed `prometheus` (or `promtool`), or None."""
    return shutil.which(name)


def dashboard_queries(dashboard: Path = DASHBOARD, rate_interval: str = "1m") -> list[tuple[str, str]]:
    """(panel title and refId, PromQL) of every target of every panel, with Grafana's built-in interval
    variables set to `rate_interval` and the dashboard's own variables to their current value (or `.*`)."""
    data = json.loads(dashboard.read_text())
    variables = {"__rate_interval": rate_interval, "__interval": rate_interval, "__range": rate_interval}
    for var in data.get("templating", {}).get("list", []):
        current = (var.get("current") or {}).get("value")
        variables[var["name"]] = current if isinstance(current, str) and current != "$__all" else ".*"

    def substitute(expr: str) -> str:
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables[m.group(1) or m.group(2)], expr)

    return [(f"{panel['title']} [{target.get('refId', i)}]", substitute(target["expr"]))
            for panel in data["panels"] for i, target in enumerate(panel.get("targets", []))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalPrometheus:
    """`prometheus` in a temp dir on 127.0.0.1: exemplar storage on, scraping `targets` (host:port of
    /metrics) every `interval_s`, evaluating `rule_files` as often. Use as a context manager."""

    def __init__(self, targets: list[str], *, rule_files: list[Path] = (), interval_s: float = 1.0,
                 port: int = 0, executable: str | None = None):
        self.executable = executable or binary()
        if self.executable is None:
            raise FileNotFoundError(f"prometheus is not installed: {INSTALL_HINT}")
        self.targets, self.rule_files, self.interval_s = list(targets), list(rule_files), interval_s
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir: tempfile.TemporaryDirectory | None = None
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LocalPrometheus:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout_s: float = 60.0) -> LocalPrometheus:
        self._dir = tempfile.TemporaryDirectory(prefix="mmserve-prometheus-")
        root = Path(self._dir.name)
        interval = f"{round(self.interval_s * 1000)}ms"
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": self.targets}]}],
        }
        (root / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = root / "prometheus.log"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [self.executable, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--enable-feature=exemplar-storage",
                 "--web.enable-lifecycle"], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.process.returncode}):\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"prometheus not ready within {timeout_s}s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self._dir else ""

    # -- the HTTP API ------------------------------------------------------------------------------

    def api(self, path: str, **params) -> object:
        """GET /api/v1/<path>; returns `data`, raises with Prometheus' own error message."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise ValueError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query now: the result's series (vector) or one pseudo-series for a scalar."""
        data = self.api("query", query=expr, time=f"{time.time():.3f}")
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def exemplars(self, expr: str, seconds: float) -> list[dict]:
        now = time.time()
        return self.api("query_exemplars", query=expr, start=f"{now - seconds:.3f}", end=f"{now:.3f}")

    def alerts(self) -> dict[str, str]:
        """alert name -> its state (pending/firing) for the alerts active now."""
        return {a["labels"]["alertname"]: a["state"] for a in self.api("alerts")["alerts"]}

    def target_health(self) -> list[str]:
        return [t["health"] for t in self.api("targets")["activeTargets"]]


def _graph_link(url: str, expr: str) -> str:
    return f"{url}/graph?" + urllib.parse.urlencode({"g0.expr": expr, "g0.tab": "0", "g0.range_input": "15m"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", help="host:port of a server's /metrics (repeatable)")
    parser.add_argument("--port", type=int, default=9090, help="Prometheus' own port on 127.0.0.1")
    parser.add_argument("--interval", type=float, default=5.0, help="scrape and rule evaluation interval, s")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))   # leave through the `with`: Prometheus stops too
    with LocalPrometheus(args.target or ["127.0.0.1:9464"], rule_files=[ALERT_RULES], interval_s=args.interval,
                         port=args.port) as prometheus:
        print(f"Prometheus on {prometheus.url}, scraping {', '.join(prometheus.targets)}\n")
        print("The dashboard's queries (deploy/grafana/mmserve.json):")
        for title, expr in dashboard_queries(rate_interval="1m"):
            print(f"  {title}\n    {_graph_link(prometheus.url, expr)}")
        print(f"\nAlerts (deploy/prometheus/alerts.yaml): {prometheus.url}/alerts\nCtrl-C stops.")
        try:
            prometheus.process.wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
