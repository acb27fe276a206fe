"""Settings: precedence, and every bad input named with its field and a fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from devplug.config import load_settings
from devplug.errors import ConfigError
from devplug.scanners.generic import GenericScanner
from devplug.scanners.registry import build_scanners

GENERIC_OK = "  generic:\n    - resource: example.com/serial\n      match: {subsystem: tty}\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def devplug(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "devplug", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def test_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    config = write(tmp_path, "kubelet_dir: /from/file\ncdi_dir: /cdi/file\nlog_level: debug\n")
    env = {"DEVPLUG_KUBELET_DIR": "/from/env", "DEVPLUG_LOG_LEVEL": "warning"}
    settings = load_settings(config, {"kubelet_dir": Path("/from/flag")}, [], env)
    assert settings.kubelet_dir == Path("/from/flag")
    assert settings.log_level == "warning"
    assert settings.cdi.dir == Path("/cdi/file")  # the top-level key still sets cdi.dir
    defaults = load_settings(None, {}, [], {})
    assert defaults.kubelet_dir == Path("/var/lib/kubelet/device-plugins")
    assert defaults.cdi.dir == Path("/var/run/cdi")


def test_cdi_dir_from_file_env_and_flag(tmp_path: Path) -> None:
    config = write(tmp_path, "cdi: {dir: /cdi/file, annotations: true}\n")
    assert load_settings(config, {}, [], {}).cdi.dir == Path("/cdi/file")
    from_env = load_settings(config, {}, [], {"DEVPLUG_CDI_DIR": "/cdi/env"})
    assert from_env.cdi.dir == Path("/cdi/env") and from_env.cdi.annotations
    from_flag = load_settings(config, {"cdi_dir": Path("/cdi/flag")}, [], {"DEVPLUG_CDI_DIR": "/x"})
    assert from_flag.cdi.dir == Path("/cdi/flag") and from_flag.cdi.annotations


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        ("cdi: {dir: relative/cdi}", "cdi.dir", "absolute"),
        ("cdi: {kinds: {example.com/serial: serial}}", "cdi.kinds", "<vendor>/<class>"),
        (
            "cdi: {kinds: {example.com/serial: 1vendor.com/serial}}",
            "cdi.kinds",
            "start with a letter",
        ),
        ("cdi: {kinds: {serial: example.com/serial}}", "cdi.kinds", "not a resource name"),
        (
            "cdi: {kinds: {example.com/a: example.com/xy, example.com/b: example.com/xy}}",
            "cdi.kinds",
            "example.com/a and example.com/b would share the spec file example.com-xy.json",
        ),
        ("cdi: {enable: false}", "cdi.enable", "did you mean 'enabled'"),
        ("cdi: [x]", "cdi", "valid dictionary"),
    ],
)
def test_bad_cdi_settings_name_the_field(tmp_path: Path, text: str, field: str, words: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(write(tmp_path, text + "\n"), {}, [], {})
    assert refused.value.field == field
    assert words in refused.value.message


def test_scanner_flag_and_env_add_builtins_with_defaults(tmp_path: Path) -> None:
    settings = load_settings(None, {}, ["generic"], {})
    assert settings.scanners == {"generic": None}
    (scanner,) = build_scanners(settings.scanners)
    assert isinstance(scanner, GenericScanner) and scanner.entries == ()
    from_env = load_settings(None, {}, [], {"DEVPLUG_SCANNER": "generic"})
    assert list(from_env.scanners) == ["generic"]
    # A scanner configured in the file keeps its settings when also named by flag.
    config = write(tmp_path, "scanners:\n" + GENERIC_OK)
    kept = load_settings(config, {}, ["generic"], {})
    assert isinstance(kept.scanners["generic"], list)


def test_a_scanner_name_has_one_spelling_and_the_other_is_noted(tmp_path: Path) -> None:
    """Issue 25 item 1: ``intel_gpu`` (a config key's spelling) wherever a scanner is named;
    ``intel-gpu`` is accepted from a flag, the variable or a file key, and noted for a hint."""
    config = write(tmp_path, "scanners:\n  intel-gpu: {shared_dev_num: 3}\n")
    from_file = load_settings(config, {}, [], {})
    assert from_file.scanners == {"intel_gpu": {"shared_dev_num": 3}}
    assert [(r.source, r.given, r.name) for r in from_file.scanner_respellings] == [
        ("scanners.intel-gpu", "intel-gpu", "intel_gpu")
    ]
    from_both = load_settings(None, {}, ["intel-gpu"], {"DEVPLUG_SCANNER": "generic,intel-gpu"})
    assert list(from_both.scanners) == ["generic", "intel_gpu"]
    assert [r.source for r in from_both.scanner_respellings] == ["DEVPLUG_SCANNER", "--scanner"]
    assert "write intel_gpu" in from_both.scanner_respellings[0].hint
    spelt = load_settings(config, {}, ["intel_gpu", "generic"], {"DEVPLUG_SCANNER": "vfio"})
    assert list(spelt.scanners) == ["intel_gpu", "vfio", "generic"]
    assert [r.source for r in spelt.scanner_respellings] == ["scanners.intel-gpu"]
    assert spelt.scanners["intel_gpu"] == {"shared_dev_num": 3}  # the flag keeps the section


def test_two_file_keys_naming_one_scanner_are_refused(tmp_path: Path) -> None:
    config = write(tmp_path, "scanners:\n  intel_gpu: {}\n  intel-gpu: {shared_dev_num: 2}\n")
    with pytest.raises(ConfigError) as refused:
        load_settings(config, {}, [], {})
    assert refused.value.field == "scanners.intel-gpu"
    assert "the same scanner as scanners.intel_gpu; keep one section" in refused.value.message


def test_a_respelt_section_is_built_by_its_scanner(tmp_path: Path) -> None:
    config = write(tmp_path, "scanners:\n  intel-gpu: {shared_dev_num: 4}\n")
    (scanner,) = build_scanners(load_settings(config, {}, [], {}).scanners)
    assert scanner.name == "intel_gpu"
    assert scanner.settings.shared_dev_num == 4  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("yaml_text", "field", "hint"),
    [
        ("kubelet_dri: /x\n", "kubelet_dri", "did you mean 'kubelet_dir'"),
        ("kubelet_dir: relative/dir\n", "kubelet_dir", "absolute path"),
        ("log_level: loud\n", "log_level", "'debug', 'info', 'warning' or 'error'"),
        ("hotplug: {poll_s: 0}\n", "hotplug.poll_s", "greater than 0"),
        ("hotplug: {pol_s: 1}\n", "hotplug.pol_s", "did you mean 'poll_s'"),
        # Nothing close: the list of keys follows the same punctuation, in every section.
        (
            "dra: {driver: gpu.intel.com, resources: [gpu.intel.com/i915], zzz: 1}\n",
            "dra.zzz",
            "unknown setting; valid keys here: driver, kubelet_root, resources",
        ),
        ("hotplug: {zzz: 1}\n", "hotplug.zzz", "unknown setting; valid keys here: coalesce_ms"),
        ("hotplug: {source: udevd}\n", "hotplug.source", "'auto', 'udev'"),
        ("- a\n- b\n", "--config", "mapping at the top level"),
        ("kubelet_dir: [\n", "--config", "not valid YAML"),
    ],
)
def test_bad_top_level_settings(tmp_path: Path, yaml_text: str, field: str, hint: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(write(tmp_path, yaml_text), {}, [], {})
    assert exc.value.field == field
    assert hint in str(exc.value)


@pytest.mark.parametrize(
    ("entry", "field", "hint"),
    [
        (
            "    - resource: serial\n      match: {subsystem: tty}\n",
            "scanners.generic[0].resource",
            "contains a '/'",
        ),
        (
            "    - resource: kubernetes.io/x\n      match: {subsystem: tty}\n",
            "scanners.generic[0].resource",
            "reserved",
        ),
        ("    - resource: example.com/s\n", "scanners.generic[0].match", "is required"),
        (
            "    - resource: example.com/s\n      match: {}\n",
            "scanners.generic[0].match",
            "'subsystem' or 'devnode'",
        ),
        (
            "    - resource: example.com/s\n      match: {subsystem: ../../etc}\n",
            "scanners.generic[0].match.subsystem",
            "is not a valid value here (got '../../etc')",
        ),
        (
            "    - resource: example.com/s\n      match: {devnode: ttyUSB*}\n",
            "scanners.generic[0].match.devnode",
            "under /dev/",
        ),
        (
            "    - resource: example.com/s\n      match: {subsystem: tty, propertys: {}}\n",
            "scanners.generic[0].match.propertys",
            "did you mean 'properties'",
        ),
        (
            "    - resource: example.com/s\n      match: {subsystem: tty}\n      shares: 0\n",
            "scanners.generic[0].shares",
            "greater than or equal to 1",
        ),
        (
            "    - resource: example.com/s\n      match: {subsystem: tty}\n"
            "      permissions: rwx\n",
            "scanners.generic[0].permissions",
            "'r', 'w' and 'm', each at most once",
        ),
        (
            "    - resource: example.com/s\n      match: {subsystem: tty, attributes: {../x: y}}\n",
            "scanners.generic[0].match.attributes",
            "paths relative to the device's sysfs dir",
        ),
        (
            "    - resource: example.com/s\n      match: {subsystem: tty}\n"
            "    - resource: example.com/s\n      match: {subsystem: usb}\n",
            "scanners.generic[1].resource",
            "configured twice",
        ),
        ("    resource: example.com/s\n", "scanners.generic", "must be a list"),
    ],
)
def test_bad_generic_entries(tmp_path: Path, entry: str, field: str, hint: str) -> None:
    settings = load_settings(write(tmp_path, "scanners:\n  generic:\n" + entry), {}, [], {})
    with pytest.raises(ConfigError) as exc:
        build_scanners(settings.scanners)
    assert exc.value.field == field
    assert hint in str(exc.value)


def test_cli_config_errors_exit_2_before_serving(tmp_path: Path, short_dir: Path) -> None:
    kubelet_dir = short_dir / "kubelet"
    unknown = devplug("run", "--scanner", "gpu", "--kubelet-dir", str(kubelet_dir))
    assert unknown.returncode == 2
    assert "--scanner: unknown scanner 'gpu'; known scanners: generic" in unknown.stderr
    assert not kubelet_dir.exists()  # nothing was created or served
    bad = write(
        tmp_path, "scanners:\n  generic:\n    - resource: Serial\n      match: {subsystem: tty}\n"
    )
    refused = devplug("run", "--config", str(bad))
    assert refused.returncode == 2
    assert "scanners.generic[0].resource" in refused.stderr and "contains a '/'" in refused.stderr
    missing = devplug("scan", "--config", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "file not found" in missing.stderr
    nothing = devplug("run")
    assert nothing.returncode == 2 and "no scanner configured" in nothing.stderr
    assert unknown.stdout == refused.stdout == ""


def test_cli_refuses_a_kubelet_dir_too_long_for_sockets(tmp_path: Path) -> None:
    result = devplug("run", "--scanner", "generic", "--kubelet-dir", "/" + "d" * 100)
    assert result.returncode == 2
    assert "kubelet_dir" in result.stderr and "107-byte unix socket limit" in result.stderr


def test_cli_reads_config_path_and_flags_from_environment(tmp_path: Path) -> None:
    config = write(tmp_path, "scanners:\n" + GENERIC_OK + "kubelet_dir: relative\n")
    import os

    env = {**os.environ, "DEVPLUG_CONFIG": str(config)}
    assert "kubelet_dir" in devplug("scan", env=env).stderr
    env["DEVPLUG_KUBELET_DIR"] = "/abs/dir"
    result = devplug("scan", "--output", "json", env=env)
    assert result.returncode == 0, result.stderr


def test_cli_warns_about_unknown_devplug_variables(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "DEVPLUG_KUBELET_DRI": "/x", "DEVPLUG_LOG_FORMAT": "json"}
    result = devplug("scan", "--scanner", "generic", env=env)
    assert result.returncode == 0
    assert "config.env.unknown" in result.stderr and "DEVPLUG_KUBELET_DRI" in result.stderr


# ------------------------------------------------------------------------ odd input (issue 15)


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        ('kubelet_dir: "/var/lib/kubelet\\0x"\n', "kubelet_dir", "NUL byte"),
        ('cdi: {dir: "/var/run/cdi\\0x"}\n', "cdi.dir", "NUL byte"),
        ("hotplug: {resync_s: true}\n", "hotplug.resync_s", "must be a number, not true"),
        ("cdi: {instance: -x}\n", "cdi.instance", "starting with a letter or digit"),
        ("metrics_address: 999.1.1.1:9400\n", "metrics_address", "not an IPv4 address"),
        ("metrics_address: 'foo bar:9400'\n", "metrics_address", "not a host name"),
        ("metrics_address: '[zz]:9400'\n", "metrics_address", "not an IPv6 address"),
        ("metrics_address: host:65536\n", "metrics_address", "port must be 0 to 65535"),
    ],
)
def test_odd_values_are_refused_in_words(tmp_path: Path, text: str, field: str, words: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(write(tmp_path, text), {}, [], {})
    assert exc.value.field == field
    assert words in str(exc.value)
    assert "Value error" not in str(exc.value) and "^" not in str(exc.value)


@pytest.mark.parametrize(
    ("entry", "field", "words"),
    [
        ("      shares: true\n", "scanners.generic[0].shares", "must be a number, not true"),
        ("      permissions: rrr\n", "scanners.generic[0].permissions", "each at most once"),
    ],
)
def test_generic_shares_true_and_repeated_permissions_are_refused(
    tmp_path: Path, entry: str, field: str, words: str
) -> None:
    text = "scanners:\n" + GENERIC_OK + entry
    with pytest.raises(ConfigError) as exc:
        build_scanners(load_settings(write(tmp_path, text), {}, [], {}).scanners)
    assert exc.value.field == field and words in str(exc.value)


def test_a_non_utf8_file_is_one_line_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(b"kubelet_dir: /var/lib/k\xffubelet\n")
    with pytest.raises(ConfigError) as exc:
        load_settings(path, {}, [], {})
    assert str(exc.value) == f"--config: {path} is not UTF-8 text (byte 0xff at offset 23)"


def test_a_yaml_syntax_error_names_the_file_and_line_in_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "kubelet_dir: /x\nscanners:\n  generic: [\n")
    with pytest.raises(ConfigError) as exc:
        load_settings(path, {}, [], {})
    message = str(exc.value)
    assert message.startswith(f"--config: {path}:4:1: not valid YAML: ")
    assert "\n" not in message and "<unicode string>" not in message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("scanners:\n" + GENERIC_OK + "scanners:\n  vfio: {}\n", "'scanners'"),
        ("hotplug: {poll_s: 1, poll_s: 2}\n", "'poll_s'"),
    ],
)
def test_a_duplicate_key_is_refused(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(write(tmp_path, text), {}, [], {})
    assert f"duplicate key {key}" in str(exc.value)


def test_yaml_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    text = "base: &b {poll_s: 1}\nhotplug: {<<: *b, resync_s: 9}\n"
    with pytest.raises(ConfigError) as exc:  # 'base' itself is not a setting
        load_settings(write(tmp_path, text), {}, [], {})
    assert exc.value.field == "base"


def test_log_levels_in_any_case(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, "log_level: WARNING\n"), {}, [], {})
    assert settings.log_level == "warning"
    assert load_settings(None, {}, [], {"DEVPLUG_LOG_LEVEL": "Debug"}).log_level == "debug"


def test_errors_name_the_variable_or_flag_a_value_came_from(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(None, {}, [], {"DEVPLUG_LOG_LEVEL": "loud"})
    assert exc.value.field == "DEVPLUG_LOG_LEVEL"
    with pytest.raises(ConfigError) as exc:
        load_settings(None, {}, [], {"DEVPLUG_CDI_DIR": "relative"})
    assert exc.value.field == "DEVPLUG_CDI_DIR"
    with pytest.raises(ConfigError) as exc:
        load_settings(None, {"kubelet_dir": Path("rel")}, [], {"DEVPLUG_KUBELET_DIR": "/ok"})
    assert exc.value.field == "--kubelet-dir"
    with pytest.raises(ConfigError) as exc:
        load_settings(tmp_path / "gone.yaml", {}, [], {}, config_source="DEVPLUG_CONFIG")
    assert exc.value.field == "DEVPLUG_CONFIG"


def test_cli_names_devplug_config_and_devplug_scanner(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "DEVPLUG_CONFIG": str(tmp_path / "gone.yaml")}
    result = devplug("scan", env=env)
    assert result.returncode == 2
    assert result.stderr.startswith("devplug: configuration error: DEVPLUG_CONFIG: file not found")
    env = {**os.environ, "DEVPLUG_SCANNER": "generic,gpu"}
    result = devplug("scan", env=env)
    assert result.returncode == 2
    assert "DEVPLUG_SCANNER: unknown scanner 'gpu'" in result.stderr


def test_cli_nul_in_kubelet_dir_is_a_config_error(tmp_path: Path) -> None:
    config = write(tmp_path, 'kubelet_dir: "/tmp/a\\0b"\nscanners:\n' + GENERIC_OK)
    result = devplug("run", "--config", str(config))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "devplug: configuration error: kubelet_dir: must not contain a NUL byte, got '/tmp/a\\x00b'"
    ]


@pytest.mark.parametrize("flag", ["--kubelet-dir", "--cdi-dir"])
def test_cli_a_dir_that_is_a_file_is_not_a_directory(tmp_path: Path, flag: str) -> None:
    file = tmp_path / "file"
    file.write_text("")
    result = devplug("run", "--scanner", "generic", flag, str(file))
    assert result.returncode == 2
    assert f"{file} is not a directory" in result.stderr


DRA_OK = "dra:\n  driver: gpu.intel.com\n  resources: [gpu.intel.com/i915]\n"


def test_the_dra_section_takes_the_issues_contract(tmp_path: Path) -> None:
    """Issue 27 item 2: driver, resources, kubelet_root (default /var/lib/kubelet)."""
    settings = load_settings(write(tmp_path, DRA_OK), {}, [], {})
    assert settings.dra is not None
    assert settings.dra.driver == "gpu.intel.com"
    assert settings.dra.resources == ("gpu.intel.com/i915",)
    assert settings.dra.kubelet_root == Path("/var/lib/kubelet")
    moved = load_settings(write(tmp_path, DRA_OK + "  kubelet_root: /srv/kubelet\n"), {}, [], {})
    assert moved.dra is not None and moved.dra.kubelet_root == Path("/srv/kubelet")
    assert load_settings(None, {}, [], {}).dra is None  # no section: nothing through DRA
    # Which front serves a resource is set up once: a reload reports a change, keeps the old.
    assert settings.restart_only_changes(moved) == ["dra"]


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        ("dra: {driver: Gpu.Intel.com, resources: [a.com/x]}", "dra.driver", "DNS subdomain"),
        (f"dra: {{driver: {'a' * 64}, resources: [a.com/x]}}", "dra.driver", "at most 63"),
        ("dra: {driver: gpu_intel.com, resources: [a.com/x]}", "dra.driver", "DNS subdomain"),
        ("dra: {resources: [a.com/x]}", "dra.driver", "is required"),
        ("dra: {driver: a.com}", "dra.resources", "is required"),
        ("dra: {driver: a.com, resources: []}", "dra.resources", "at least one resource"),
        ("dra: {driver: a.com, resources: [i915]}", "dra.resources", "not a resource name"),
        ("dra: {driver: a.com, resources: [a.com/x, a.com/x]}", "dra.resources", "twice"),
        (
            "dra: {driver: a.com, resources: [a.com/x], kubelet_root: var/lib/kubelet}",
            "dra.kubelet_root",
            "absolute path",
        ),
        (
            "dra: {driver: a.com, resources: [a.com/x], kubelet_dir: /x}",
            "dra.kubelet_dir",
            "did you mean 'kubelet_root'",
        ),
        (
            "cdi: {enabled: false}\ndra: {driver: a.com, resources: [a.com/x]}",
            "cdi.enabled",
            "Prepare answers with the ids of devplug's CDI specs",
        ),
    ],
)
def test_bad_dra_settings_name_the_field(tmp_path: Path, text: str, field: str, words: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(write(tmp_path, text + "\n"), {}, [], {})
    assert refused.value.field == field
    assert words in refused.value.message


def dra_config(tmp_path: Path, resource: str, kubelet_root: Path) -> Path:
    return write(
        tmp_path,
        "scanners:\n  intel_gpu: {}\n"
        f"dra: {{driver: gpu.intel.com, resources: [{resource}], kubelet_root: {kubelet_root}}}\n",
    )


def run_dra(tmp_path: Path, resource: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``devplug run`` with a dra section, in an environment that has only ``env`` of the
    variables the DRA front reads (NODE_NAME, KUBECONFIG, KUBERNETES_SERVICE_HOST)."""
    import os

    environ = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NODE_NAME", "KUBECONFIG", "KUBERNETES_SERVICE_HOST")
    }
    config = dra_config(tmp_path, resource, tmp_path / "kubelet")
    kubelet_dir = tmp_path / "kubelet" / "device-plugins"
    return devplug(
        "run",
        "--config",
        str(config),
        "--kubelet-dir",
        str(kubelet_dir),
        "--cdi-dir",
        str(tmp_path / "cdi"),
        env={**environ, **env},
    )


@pytest.mark.parametrize(
    ("resource", "env", "line"),
    [
        (
            "gpu.intel.com/i915",
            {},
            "NODE_NAME: is not set: give the daemon its node's name (the DaemonSet sets it from "
            "spec.nodeName through the downward API)",
        ),
        (
            "gpu.intel.com/i915",
            {"NODE_NAME": "Node_1"},
            "NODE_NAME: 'Node_1' is not a node name: must be a DNS subdomain",
        ),
        (
            "gpu.intel.com/i915",
            {"NODE_NAME": "node-a"},
            "KUBECONFIG: no API server configured: not running in a pod",
        ),
        (
            "gpu.intel.com/i915",
            {"NODE_NAME": "node-a", "KUBECONFIG": "/nonexistent/kubeconfig"},
            "KUBECONFIG: /nonexistent/kubeconfig:",
        ),
        (
            "gpu.intel.com/i91",
            {"NODE_NAME": "node-a"},
            "dra.resources: 'gpu.intel.com/i91' is made by none of the configured scanners "
            "(intel_gpu)",
        ),
        (
            "gpu.intel.com/monitoring",  # made only with scanners.intel_gpu.monitoring
            {"NODE_NAME": "node-a"},
            "dra.resources: 'gpu.intel.com/monitoring' is made by none",
        ),
    ],
)
def test_cli_dra_refuses_to_start_naming_the_setting(
    short_dir: Path, resource: str, env: dict[str, str], line: str
) -> None:
    """Issue 27 item 2: a missing node name or kubeconfig, an unknown resource: one line
    naming the setting, exit 2, and nothing served (no socket, no dir made)."""
    result = run_dra(short_dir, resource, **env)
    assert result.returncode == 2, result.stderr
    (printed,) = result.stderr.strip().splitlines()
    assert printed.startswith("devplug: configuration error: " + line), printed
    assert not (short_dir / "kubelet").exists()


def test_scanners_say_which_resources_they_make() -> None:
    from devplug.scanners.base import ResourceNamer
    from devplug.scanners.intel_gpu import IntelGpuScanner
    from devplug.scanners.vfio import VfioScanner

    intel = IntelGpuScanner.from_config({})
    assert isinstance(intel, ResourceNamer)
    assert intel.makes_resource("gpu.intel.com/i915") and intel.makes_resource("gpu.intel.com/xe")
    assert not intel.makes_resource("gpu.intel.com/monitoring")
    assert not intel.makes_resource("gpu.example.com/i915")
    assert IntelGpuScanner.from_config({"monitoring": True}).makes_resource(
        "gpu.intel.com/monitoring"
    )
    generic = GenericScanner.from_config(
        [{"resource": "example.com/serial", "match": {"subsystem": "tty"}}]
    )
    assert generic.makes_resource("example.com/serial")
    assert not generic.makes_resource("example.com/other")
    vfio = VfioScanner.from_config(
        {"devices": [{"selector": "8086:1572", "resource": "intel.com/x710"}]}
    )
    assert vfio.makes_resource("intel.com/x710")
    assert vfio.makes_resource("vfio.devplug.io/10de_2204")  # a default name
    assert not vfio.makes_resource("vfio.devplug.io/8086_1572")  # that id takes x710's
    assert not vfio.makes_resource("vfio.devplug.io/10DE_2204")
    assert not vfio.makes_resource("vfio.example.com/10de_2204")


def test_a_scanner_that_does_not_say_may_make_any_resource() -> None:
    from devplug.dra.front import check_resources
    from devplug.scanners.intel_gpu import IntelGpuScanner
    from devplug.testing.harness import StaticScanner

    intel = IntelGpuScanner.from_config({})
    check_resources(["gpu.intel.com/i915"], [intel])
    with pytest.raises(ConfigError) as refused:
        check_resources(["gpu.intel.com/i915", "example.com/x"], [intel])
    assert refused.value.field == "dra.resources" and "'example.com/x'" in refused.value.message
    check_resources(["example.com/x"], [intel, StaticScanner()])  # it may make it
