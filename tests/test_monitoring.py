"""The Grafana dashboard and the Prometheus alert rules in deploy/ stay true to the metrics.

promtool (Debian's ``prometheus`` package, installed by .ci/run) checks the rules, runs their
unit tests (deploy/prometheus/devplug-rules.test.yaml), and parses every query of the
dashboard; every metric they name is one the daemon exports; docs/operations.md lists the
dashboard's panels and the alerts.
"""

from __future__ import annotations

import asyncio
import json
import platform
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from devplug import __version__
from devplug.model import DeviceInfo, DeviceTree
from devplug.ops.metrics import Metrics
from devplug.testing import KubeletSimulator, StaticScanner, daemon_settings, running_daemon

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "devplug-rules.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "devplug-rules.test.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "devplug-dashboard.json"
OPERATIONS = ROOT / "docs" / "operations.md"
PODMONITOR = ROOT / "deploy" / "prometheus" / "podmonitor.yaml"
KUBE = ROOT / "deploy" / "kubernetes"

# Grafana's variables, replaced by what they stand for to give promtool plain PromQL.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$job": ".*", "$instance": ".*"}


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    assert tool is not None, "promtool is missing: .ci/run installs Debian's prometheus package"
    return subprocess.run(
        [tool, *args], capture_output=True, text=True, cwd=cwd, timeout=120, check=False
    )


def dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


def dashboard_queries() -> list[str]:
    return [target["expr"] for panel in dashboard()["panels"] for target in panel["targets"]]


def rule_expressions() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def alert_names() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"]]


def exported_series() -> set[str]:
    """Every series name devplug's /metrics can show, with prometheus_client's suffixes."""
    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
    }
    return {
        family.name + suffix
        for family in Metrics().registry.collect()
        for suffix in suffixes[family.type]
    }


def test_the_rules_pass_promtool_check() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_each_alert_fires_when_it_should_under_promtool_test() -> None:
    result = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert tested == set(alert_names()), "every alert needs a promtool unit test"


def test_the_alerts_cover_what_operators_need() -> None:
    wanted = {
        "DevplugDevicesWithdrawn",
        "DevplugRegistrationFailing",
        "DevplugDevicesHeldBack",
        "DevplugScanErrors",
        "DevplugListNearLimit",
        "DevplugDown",
        "DevplugAbsent",
        "DevplugPodsUnavailable",
    }
    assert wanted <= set(alert_names())


def test_the_down_alerts_name_the_job_the_podmonitor_gives() -> None:
    """DevplugDown and DevplugAbsent read `up{job="devplug"}`: the PodMonitor must scrape the
    DaemonSet's pods on its metrics port and call their job that."""
    monitor = yaml.safe_load(PODMONITOR.read_text())
    daemonset = yaml.safe_load((KUBE / "base" / "daemonset.yaml").read_text())
    kustomization = yaml.safe_load((KUBE / "base" / "kustomization.yaml").read_text())
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    spec = monitor["spec"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    assert spec["namespaceSelector"]["matchNames"] == [kustomization["namespace"]]
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["port"] in {port["name"] for port in container["ports"]}
    job = pod_labels[spec["jobLabel"]]
    expressions = " ".join(rule_expressions())
    assert f'up{{job="{job}"}}' in expressions
    assert set(re.findall(r'up\{job="([^"]*)"\}', expressions)) == {job}


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    rules = []
    for index, query in enumerate(dashboard_queries()):
        for variable, value in GRAFANA_VARIABLES.items():
            query = query.replace(variable, value)
        assert "$" not in query, f"a Grafana variable promtool cannot read: {query}"
        rules.append({"record": f"devplug:dashboard_query_{index}", "expr": query})
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("source", ["dashboard", "rules"])
def test_every_metric_named_is_one_devplug_exports(source: str) -> None:
    queries = dashboard_queries() if source == "dashboard" else rule_expressions()
    named = {name for query in queries for name in re.findall(r"\bdevplug_[a-z_]+\b", query)}
    assert named, f"no metric found in the {source}"
    unknown = named - exported_series()
    assert not unknown, f"the {source} names metrics devplug does not export: {sorted(unknown)}"


def test_the_dashboard_shows_every_metric_family() -> None:
    text = " ".join(dashboard_queries())
    missing = [family.name for family in Metrics().registry.collect() if family.name not in text]
    assert not missing, f"metrics without a dashboard panel: {missing}"


def test_the_dashboard_is_importable_json_with_its_variables() -> None:
    document = dashboard()
    assert document["uid"] == "devplug" and document["panels"]
    variables = {v["name"] for v in document["templating"]["list"]}
    assert variables == {"datasource", "job", "instance"}
    ids = [panel["id"] for panel in document["panels"]]
    assert len(ids) == len(set(ids))
    for panel in document["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_the_operations_guide_lists_the_panels_and_the_alerts() -> None:
    text = OPERATIONS.read_text()
    for panel in dashboard()["panels"]:
        assert f"| {panel['title']} |" in text, (
            f"panel not listed in operations.md: {panel['title']}"
        )
    for alert in alert_names():
        assert f"`{alert}`" in text, f"alert not described in operations.md: {alert}"


class FailingScanner(StaticScanner):
    """Serves one device, then fails every scan once ``failing`` is set."""

    failing = False

    def scan(self, source: Any) -> DeviceTree:
        if self.failing:
            raise OSError(24, "Too many open files")
        return super().scan(source)


async def test_a_failed_scan_counts_in_devplug_scan_failures_total(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    """What DevplugScanErrors and the dashboard's failure panels read."""
    scanner = FailingScanner({"example.com/serial": {"dev0": DeviceInfo()}})
    async with running_daemon(daemon_settings(kubelet_dir), [scanner]) as daemon:
        await (await kubelet.wait_for_plugin("example.com/serial")).wait_for_update()
        scanner.failing = True
        await daemon.rescan()
        assert daemon.metric("devplug_scan_failures_total", scanner=scanner.name) == 1.0


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
    return body.decode()


async def test_build_info_names_the_versions_on_the_metrics_endpoint(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    """What the dashboard's version table and a fleet's version count read: one series, 1."""
    settings = daemon_settings(kubelet_dir, metrics_address="127.0.0.1:0")
    scanner = StaticScanner({"example.com/serial": {"dev0": DeviceInfo()}})
    async with running_daemon(settings, [scanner]) as daemon:
        await (await kubelet.wait_for_plugin("example.com/serial")).wait_for_update()
        assert daemon.metrics_port is not None
        text = await asyncio.to_thread(fetch, f"http://127.0.0.1:{daemon.metrics_port}/metrics")
    families = {family.name: family for family in text_string_to_metric_families(text)}
    (sample,) = families["devplug_build_info"].samples
    assert families["devplug_build_info"].type == "gauge"
    assert sample.value == 1
    assert sample.labels == {
        "version": __version__,
        "python": platform.python_version(),
        "grpc": grpc.__version__,
    }
