"""Issue 16: what ``devplug run`` leaves unimported until it is needed, so start -> first list
stays short. Each check runs a daemon in a fresh interpreter (this one has imported everything
already) and reports which modules were loaded at each point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from devplug.model import DeviceInfo, DeviceNode
from devplug.testing import StaticScanner, daemon_settings
from devplug.testing.harness import in_process_daemon

SERIAL = "example.com/serial"

# A daemon serving one static resource to the simulator, metrics on; the report says which of
# WATCHED were imported once the kubelet had the first list, and after the first scrape.
DAEMON = textwrap.dedent(
    """
    import asyncio, json, sys, time
    from pathlib import Path

    from devplug.model import DeviceInfo, DeviceNode
    from devplug.ops.metrics import Metrics
    from devplug.testing import KubeletSimulator, StaticScanner, daemon_settings, running_daemon

    WATCHED = {watched!r}
    RESOURCE = "example.com/serial"


    def loaded():
        return sorted(m for m in WATCHED if m in sys.modules)


    # When the first ListAndWatch list was built, and when the CDI task's modules loaded.
    times = {{}}
    list_built = Metrics.list_built


    def first_list(self, resource, size_bytes):
        times.setdefault("list", time.perf_counter())
        list_built(self, resource, size_bytes)


    Metrics.list_built = first_list


    class Watch:
        def find_spec(self, name, path=None, target=None):
            if name == "devplug.cdi.sync":
                times.setdefault("cdi", time.perf_counter())
            if name in WATCHED and name not in sys.modules:
                times.setdefault(name, time.perf_counter())


    sys.meta_path.insert(0, Watch())
    preloaded = [name for name in WATCHED if name in sys.modules]  # with devplug's imports


    async def scrape(port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        await writer.wait_closed()
        return data.decode()


    async def main():
        root = Path(sys.argv[1])
        kubelet_dir = root / "kubelet"
        scanner = StaticScanner(
            {{RESOURCE: {{"dev0": DeviceInfo(nodes=(DeviceNode("/dev/null"),))}}}}
        )
        settings = daemon_settings(kubelet_dir, metrics_address="127.0.0.1:0")
        report = {{}}
        async with KubeletSimulator(kubelet_dir) as kubelet:
            async with running_daemon(settings, [scanner]) as daemon:
                session = await kubelet.wait_for_plugin(RESOURCE)
                await session.wait_for_update(lambda listed: len(listed) == 1)
                report["listed"] = loaded()
                text = await scrape(daemon.metrics_port)
                report["scraped"] = loaded()
                report["answer"] = text.splitlines()[0]
                report["devices"] = [
                    line for line in text.splitlines() if line.startswith("devplug_devices{{")
                ]
                await daemon.stats.wait_for(lambda s: RESOURCE in s.cdi_specs, timeout=10)
                report["spec"] = sorted(p.name for p in (root / "cdi").glob("*.json"))
                report["cdi_after_list"] = times["cdi"] > times["list"]
                report["before_list"] = sorted(
                    n for n in WATCHED if n in preloaded or times.get(n, 1e99) < times["list"]
                )
        print(json.dumps(report))


    asyncio.run(main())
    """
)


def run_daemon(tmp_path: Path, watched: tuple[str, ...]) -> dict[str, Any]:
    script = tmp_path / "daemon.py"
    script.write_text(DAEMON.format(watched=watched))
    return run_report(script, str(tmp_path))


def run_report(script: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``script`` in a fresh interpreter, without this environment's DEVPLUG_ and
    PYDANTIC_ settings but with ``env``; its last line, as JSON."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("DEVPLUG_", "PYDANTIC_"))}
    result = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**environ, **(env or {})},
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return report


def test_prometheus_client_loads_at_the_first_scrape_not_before(tmp_path: Path) -> None:
    """Its package (exposition, HTTP and WSGI servers: ~15 ms) is not needed to serve devices;
    the metrics count from the start all the same and the first scrape shows them."""
    report = run_daemon(tmp_path, ("prometheus_client", "prometheus_client.exposition"))
    assert report["listed"] == []
    assert report["scraped"] == ["prometheus_client", "prometheus_client.exposition"]
    assert report["answer"] == "HTTP/1.1 200 OK"
    assert report["devices"] == [
        'devplug_devices{health="Healthy",resource="example.com/serial"} 1.0'
    ]


# devplug's command line in this process, then what it loaded, and whether a model built
# afterwards still finds pydantic's real plugin loader.
COMMAND = textwrap.dedent(
    """
    import json, sys

    from devplug.cli import main

    code = main({args!r})
    report = {{"exit": code, "metadata": "importlib.metadata" in sys.modules}}
    report["pydantic"] = "pydantic" in sys.modules
    import pydantic

    class Later(pydantic.BaseModel):
        x: int = 0

    loader = sys.modules["pydantic.plugin._loader"]
    report["later"] = [Later(x=1).x, hasattr(loader, "PYDANTIC_ENTRY_POINT_GROUP")]
    print(json.dumps(report))
    """
)


def run_command(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    script = tmp_path / "command.py"
    script.write_text(COMMAND.format(args=list(args)))
    return run_report(script, env=env)


def config_file(tmp_path: Path) -> Path:
    config = tmp_path / "config.yaml"
    config.write_text("scanners: {generic: [{resource: example.com/mem, match: {subsystem: mem}}]}")
    return config


def test_the_cdi_task_loads_after_the_first_list_and_writes_the_spec(tmp_path: Path) -> None:
    """The CDI modules and first render (~15 ms at start-up) wait for the first lists; the
    spec is written all the same (Allocate names CDI devices only once it is on disk)."""
    report = run_daemon(tmp_path, ("devplug.cdi.sync",))
    assert report["cdi_after_list"] is True
    assert report["spec"] == ["example.com-serial.json"]


async def test_without_a_kubelet_the_specs_are_written_all_the_same(tmp_path: Path) -> None:
    """No first list is coming: the CDI task starts CDI_START_TIMEOUT_S after the first scan."""
    settings = daemon_settings(tmp_path / "kubelet")
    scanner = StaticScanner({SERIAL: {"dev0": DeviceInfo(nodes=(DeviceNode("/dev/null"),))}})
    async with in_process_daemon(settings, [scanner]) as daemon:
        assert daemon.servers.unregistered() == [SERIAL]
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=10)
    assert (tmp_path / "cdi" / "example.com-serial.json").exists() is False  # removed on stop


def test_settings_load_without_pydantic_plugin_discovery(tmp_path: Path) -> None:
    """Discovery (importlib.metadata and every distribution's entry points: 12-15 ms) is
    skipped while devplug builds its settings models; a model built afterwards gets pydantic's
    real loader back."""
    report = run_command(tmp_path, "scan", "--config", str(config_file(tmp_path)))
    assert report == {"exit": 0, "metadata": False, "pydantic": True, "later": [1, True]}


def test_pydantic_disable_plugins_leaves_discovery_to_pydantic(tmp_path: Path) -> None:
    report = run_command(
        tmp_path,
        "scan",
        "--config",
        str(config_file(tmp_path)),
        env={"PYDANTIC_DISABLE_PLUGINS": ""},
    )
    assert report == {"exit": 0, "metadata": True, "pydantic": True, "later": [1, True]}


def test_a_config_error_still_names_the_field(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("scanners: {generic: [{resource: example.com/mem, match: {subsystm: x}}]}")
    report = run_command(tmp_path, "run", "--config", str(config))
    assert report["exit"] == 2


# ``devplug run`` as the process's own command line (sys.argv), with Daemon.run replaced by a
# probe: whether the collector ran while pydantic and grpc imported, and when the daemon runs.
RUN_PROBED = textwrap.dedent(
    """
    import gc, importlib.machinery, json, sys

    report = {{}}


    async def probe(self):
        report["running"] = [gc.isenabled(), gc.get_freeze_count() > 0]


    class Watch:
        def find_spec(self, name, path=None, target=None):
            if name in ("pydantic", "grpc") and name not in report:
                report[name] = gc.isenabled()
            if name != "devplug.daemon":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run_module = spec.loader.exec_module

            def exec_module(module):
                run_module(module)
                module.Daemon.run = probe

            spec.loader.exec_module = exec_module
            return spec


    sys.meta_path.insert(0, Watch())
    sys.argv = ["devplug", "run", *{args!r}]
    from devplug.cli import main

    report["exit"] = main()
    report["after"] = gc.isenabled()
    print(json.dumps(report))
    """
)


def run_probed(tmp_path: Path, *args: str) -> dict[str, Any]:
    script = tmp_path / "probed.py"
    script.write_text(RUN_PROBED.format(args=list(args)))
    return run_report(script)


def test_run_imports_with_the_collector_off_and_serves_with_it_on(tmp_path: Path) -> None:
    """The collector's passes over the objects imports create (15-20 ms of start-up) are
    skipped; the daemon runs with it on again, the imported objects frozen."""
    args = ["--config", str(config_file(tmp_path)), "--kubelet-dir", str(tmp_path / "kubelet")]
    args += ["--cdi-dir", str(tmp_path / "cdi"), "--log-format", "json"]
    report = run_probed(tmp_path, *args)
    assert report == {
        "pydantic": False,
        "grpc": False,
        "running": [True, True],
        "exit": 0,
        "after": True,
    }


def test_a_refused_config_leaves_the_collector_on(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("scanners: {generic: [{resource: example.com/mem, match: {subsystm: x}}]}")
    report = run_probed(tmp_path, "--config", str(config))
    assert report == {"pydantic": False, "exit": 2, "after": True}


def test_aiofiles_loads_with_the_cdi_task_not_before(tmp_path: Path) -> None:
    """Allocate's catalog, loaded at start, stamps specs with one lstat of its own
    (``cdi.stamps``): aiofiles and its modules (~2 ms) come with the CDI task's file work."""
    report = run_daemon(tmp_path, ("aiofiles",))
    assert report["before_list"] == []
    assert report["spec"] == ["example.com-serial.json"]
