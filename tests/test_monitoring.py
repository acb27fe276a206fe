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
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_cordon import SERIAL, cordon, serials, uncordon

from devplug import __version__
from devplug.daemon import Daemon
from devplug.model import DeviceInfo, DeviceTree
from devplug.ops.metrics import Metrics
from devplug.testing import KubeletSimulator, StaticScanner, daemon_settings, running_daemon
from devplug.testing.harness import DaemonStarter

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
        # Who holds the devices (the kubelet's pod resources API), the DRA front, cordons.
        "DevplugUnhealthyDevicesInUse",
        "DevplugDevicesGoneWhileAllocated",
        "DevplugAllocatableDrift",
        "DevplugPodResourcesUnavailable",
        "DevplugDraNotRegistered",
        "DevplugDraSliceWritesFailing",
        "DevplugDraSlicesRejected",
        "DevplugCordonsUnreadable",
        "DevplugDevicesCordonedLong",
    }
    assert wanted <= set(alert_names())


def test_each_alert_has_a_known_severity_and_says_what_to_do() -> None:
    """Routing reads the severity (critical: devices or the node's capacity lost; warning:
    some of it at risk; info: a check that cannot run, or housekeeping); the operations
    guide's table gives the same one."""
    guide = OPERATIONS.read_text()
    groups = yaml.safe_load(RULES.read_text())["groups"]
    for rule in (rule for group in groups for rule in group["rules"]):
        name, severity = rule["alert"], rule["labels"]["severity"]
        assert severity in {"critical", "warning", "info"}, name
        annotations = rule["annotations"]
        assert annotations["summary"].strip(), name
        assert len(annotations["description"].split()) >= 15, f"{name}: say what to do"
        assert f"| `{name}` | {severity} |" in guide, f"{name}: not a {severity} in the guide"


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


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(daemon: Daemon) -> Samples:
    """The daemon's /metrics over HTTP: (name, sorted labels) -> value."""
    assert daemon.http is not None
    text = await asyncio.to_thread(fetch, f"http://127.0.0.1:{daemon.http.port}/metrics")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def cordon_samples(found: Samples) -> dict[str, float]:
    """The cordon metrics' samples, by name (SERIAL's, and the unlabelled one)."""
    wanted = {(("resource", SERIAL),), ()}
    names = {
        "devplug_devices_cordoned",
        "devplug_cordon_oldest_timestamp_seconds",
        "devplug_cordons_unreadable",
    }
    return {
        name: value for (name, labels), value in found.items() if name in names and labels in wanted
    }


def write_cordons(kubelet_dir: Path, content: str) -> Path:
    state = kubelet_dir / "devplug" / "devplug.cordons.json"
    state.parent.mkdir(mode=0o700, exist_ok=True)
    state.write_text(content)
    return state


async def test_cordons_on_the_metrics_endpoint_follow_cordon_and_uncordon(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter
) -> None:
    """What the Cordoned devices panel and DevplugDevicesCordonedLong read: the count follows
    `devplug cordon` and `uncordon`; the oldest time is the oldest cordon's `since`."""
    put = "2025-01-31T09:30:00Z"
    cordons = {SERIAL: {"s1": {"reason": "bad fan", "since": put}}}
    write_cordons(kubelet_dir, json.dumps({"version": 1, "cordons": cordons}))
    settings = daemon_settings(kubelet_dir, metrics_address="127.0.0.1:0")
    daemon = await start_daemon(settings, [StaticScanner(serials("s0", "s1", "s2"))])
    await (await kubelet.wait_for_plugin(SERIAL)).wait_for_update()
    oldest = datetime.fromisoformat(put).timestamp()
    assert cordon_samples(await scrape(daemon)) == {
        "devplug_devices_cordoned": 1,
        "devplug_cordon_oldest_timestamp_seconds": oldest,
        "devplug_cordons_unreadable": 0,
    }

    await cordon(kubelet_dir, "s0")  # a newer cordon: the oldest stays s1's
    assert cordon_samples(await scrape(daemon)) == {
        "devplug_devices_cordoned": 2,
        "devplug_cordon_oldest_timestamp_seconds": oldest,
        "devplug_cordons_unreadable": 0,
    }

    await uncordon(kubelet_dir, "s1")
    found = cordon_samples(await scrape(daemon))
    assert found["devplug_devices_cordoned"] == 1
    assert found["devplug_cordon_oldest_timestamp_seconds"] > oldest  # s0's, put just now

    await uncordon(kubelet_dir, "s0")
    # None left: the count reads 0, and no oldest time (a 0 would be a cordon of 1970).
    assert cordon_samples(await scrape(daemon)) == {
        "devplug_devices_cordoned": 0,
        "devplug_cordons_unreadable": 0,
    }


async def test_an_unreadable_cordon_file_shows_on_the_metrics_endpoint_until_fixed(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter
) -> None:
    """What DevplugCordonsUnreadable reads: 1 while every device is held for want of the
    file, 0 once it is fixed and devplug reloaded."""
    state = write_cordons(kubelet_dir, '{"version": 1, "cordons": {')  # cut short
    settings = daemon_settings(
        kubelet_dir, metrics_address="127.0.0.1:0", hotplug={"health_hold_down_s": 0}
    )
    scanner = StaticScanner(serials("s0", "s1"))
    daemon = await start_daemon(settings, [scanner], config_loader=lambda: (settings, [scanner]))
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update()
    assert cordon_samples(await scrape(daemon)) == {"devplug_cordons_unreadable": 1}

    cordons = {SERIAL: {"s1": {"reason": "bad fan", "since": "2025-01-31T09:30:00Z"}}}
    state.write_text(json.dumps({"version": 1, "cordons": cordons}))
    daemon.request_reload()
    await session.wait_for_update(lambda listed: listed["s0"].health == "Healthy")
    found = cordon_samples(await scrape(daemon))
    assert found["devplug_cordons_unreadable"] == 0
    assert found["devplug_devices_cordoned"] == 1


async def test_cordoned_devices_present_are_counted_apart_from_the_unhealthy_ones(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter
) -> None:
    """What DevplugDevicesUnhealthy takes off devplug_devices{health="Unhealthy"}: the cordoned
    devices advertised now, not a cordon of a device that is away (which a fault beside it
    would hide behind)."""
    since = "2025-01-31T09:30:00Z"
    cordons = {SERIAL: {i: {"reason": "bad fan", "since": since} for i in ("s1", "away")}}
    write_cordons(kubelet_dir, json.dumps({"version": 1, "cordons": cordons}))
    settings = daemon_settings(kubelet_dir, metrics_address="127.0.0.1:0")
    daemon = await start_daemon(settings, [StaticScanner(serials("s0", "s1"))])
    await (await kubelet.wait_for_plugin(SERIAL)).wait_for_update()
    found = await scrape(daemon)
    by_resource = (("resource", SERIAL),)
    assert found[("devplug_devices_cordoned", by_resource)] == 2
    assert found[("devplug_devices_cordoned_advertised", by_resource)] == 1
    unhealthy = (("health", "Unhealthy"), ("resource", SERIAL))
    assert found[("devplug_devices", unhealthy)] == 1

    await uncordon(kubelet_dir, "s1")
    found = await scrape(daemon)
    assert found[("devplug_devices_cordoned_advertised", by_resource)] == 0
