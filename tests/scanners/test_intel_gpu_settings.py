"""``scanners.intel_gpu``: defaults, every bad setting named with its field, and the size guard."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import structlog

from devplug.config import load_settings
from devplug.errors import ConfigError
from devplug.model import DeviceInfo, Health
from devplug.scanners.intel_gpu import IntelGpuScanner, IntelGpuSettings, ListTooLargeError
from devplug.scanners.intel_gpu.entry import GpuEntry as _Entry
from devplug.scanners.intel_gpu.settings import max_shares_per_gpu, share_bytes
from devplug.scanners.registry import build_scanners
from devplug.sizing import KUBELET_MAX_RECEIVE_BYTES, WARN_FRACTION, device_entry_bytes

FIELD = "scanners.intel_gpu"
LIMIT = KUBELET_MAX_RECEIVE_BYTES
I915 = "gpu.intel.com/i915"
XE = "gpu.intel.com/xe"


def settings(**raw: Any) -> IntelGpuSettings:
    return IntelGpuSettings.from_raw(raw, FIELD)


def refused(raw: Any) -> ConfigError:
    with pytest.raises(ConfigError) as exc:
        IntelGpuSettings.from_raw(raw, FIELD)
    return exc.value


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------ defaults


@pytest.mark.parametrize("raw", [None, {}])
def test_defaults_follow_intels_plugin(raw: dict[str, Any] | None) -> None:
    got = IntelGpuSettings.from_raw(raw, FIELD)
    assert got.shared_dev_num == 1
    assert got.allocation_policy == "none"
    assert got.bypath == "single"
    assert got.allow_ids == () and got.deny_ids == ()
    assert got.monitoring is False
    assert IntelGpuScanner().settings == got


def test_every_setting_is_read() -> None:
    got = settings(
        shared_dev_num=4,
        allocation_policy="packed",
        bypath="all",
        deny_ids=["0x56c0"],
        monitoring=True,
    )
    assert (got.shared_dev_num, got.allocation_policy, got.bypath) == (4, "packed", "all")
    assert got.deny_ids == ("0x56c0",) and got.monitoring is True


@pytest.mark.parametrize("raw", [[], "packed", 3])
def test_a_section_that_is_not_a_mapping_is_refused(raw: Any) -> None:
    error = refused(raw)
    assert error.field == FIELD and "must be a mapping" in str(error)


# ------------------------------------------------------------- through load_settings


def test_scanner_flag_intel_gpu_names_the_intel_gpu_section() -> None:
    loaded = load_settings(None, {}, ["intel-gpu"], {})
    assert loaded.scanners == {"intel_gpu": None}
    (scanner,) = build_scanners(loaded.scanners)
    assert isinstance(scanner, IntelGpuScanner)
    assert scanner.name == "intel_gpu" and scanner.settings == IntelGpuSettings()
    from_env = load_settings(None, {}, [], {"DEVPLUG_SCANNER": "generic,intel-gpu"})
    assert list(from_env.scanners) == ["generic", "intel_gpu"]


def test_file_settings_are_kept_when_the_flag_also_names_the_scanner(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        "scanners:\n  intel_gpu:\n    shared_dev_num: 4\n    allocation_policy: balanced\n",
    )
    (scanner,) = build_scanners(load_settings(config, {}, ["intel-gpu"], {}).scanners)
    assert isinstance(scanner, IntelGpuScanner)
    assert scanner.settings.shared_dev_num == 4
    assert scanner.settings.allocation_policy == "balanced"


@pytest.mark.parametrize(
    ("section", "field", "hint"),
    [
        ("shared_devnum: 2", "shared_devnum", "did you mean 'shared_dev_num'"),
        ("allocation_policy: spread", "allocation_policy", "'none', 'balanced' or 'packed'"),
        ("bypath: some", "bypath", "'single', 'none' or 'all'"),
        ("shared_dev_num: 0", "shared_dev_num", "greater than or equal to 1"),
        ("allow_ids: [0x56c0]", "allow_ids", "quote them in YAML"),  # YAML reads an int
        ("deny_ids: ['56c0']", "deny_ids", "0x followed by four hex digits"),
        (
            "allow_ids: ['0x56c0']\n    deny_ids: ['0x56c1']",
            "deny_ids",
            "mutually exclusive",
        ),
    ],
)
def test_bad_settings_in_the_file_name_their_field(
    tmp_path: Path, section: str, field: str, hint: str
) -> None:
    config = write(tmp_path, f"scanners:\n  intel_gpu:\n    {section}\n")
    loaded = load_settings(config, {}, [], {})
    with pytest.raises(ConfigError) as exc:
        build_scanners(loaded.scanners)
    assert exc.value.field == f"{FIELD}.{field}"
    assert hint in str(exc.value)


# ------------------------------------------------------------------------ device ids


def test_allow_and_deny_together_are_refused_on_deny_ids() -> None:
    error = refused({"allow_ids": ["0x56c0"], "deny_ids": ["0x56c1"]})
    assert error.field == "scanners.intel_gpu.deny_ids"
    assert "mutually exclusive" in error.message
    # Either alone, or one of them empty, is fine.
    assert settings(allow_ids=["0x56c0"], deny_ids=[]).allow_ids == ("0x56c0",)
    assert settings(deny_ids=["0x56c0"]).deny_ids == ("0x56c0",)


@pytest.mark.parametrize("key", ["allow_ids", "deny_ids"])
@pytest.mark.parametrize("bad", ["56c0", "0x56c", "0xZZZZ", "0x56c00", "0x 56c0", "", 22208])
def test_bad_device_ids_name_the_field(key: str, bad: object) -> None:
    error = refused({key: ["0x56c0", bad]})
    assert error.field == f"{FIELD}.{key}"
    assert "0x followed by four hex digits" in error.message
    assert repr(bad) in error.message


@pytest.mark.parametrize("key", ["allow_ids", "deny_ids"])
def test_device_ids_must_be_a_list(key: str) -> None:
    error = refused({key: "0x56c0"})
    assert error.field == f"{FIELD}.{key}"


def test_device_ids_are_normalised_to_lower_case_and_deduplicated() -> None:
    got = settings(allow_ids=["0x56C0", " 0x56a0 ", "0X56C0", "0x56c0"])
    assert got.allow_ids == ("0x56c0", "0x56a0")
    assert settings(deny_ids=["0xE20B"]).deny_ids == ("0xe20b",)


def test_admits_with_an_allow_list() -> None:
    allow = settings(allow_ids=["0x56C0", "0x56a0"])
    assert allow.admits("0x56c0") and allow.admits("0x56a0")
    assert not allow.admits("0x56c1")
    assert not allow.admits(None)  # a GPU whose device id could not be read


def test_admits_with_a_deny_list() -> None:
    deny = settings(deny_ids=["0x56C0"])
    assert not deny.admits("0x56c0")
    assert deny.admits("0x56c1")
    assert deny.admits(None)


def test_admits_everything_without_lists() -> None:
    assert settings().admits("0x56c0") and settings().admits(None)


# ---------------------------------------------------------------------- other errors


def test_unknown_key_gets_a_did_you_mean_hint() -> None:
    error = refused({"shared_devnum": 2})
    assert error.field == "scanners.intel_gpu.shared_devnum"
    assert "did you mean 'shared_dev_num'" in error.message
    assert "allocation_policy" in error.message  # the valid keys are listed
    other = refused({"alloc_policy": "packed"})
    assert "did you mean 'allocation_policy'" in other.message


@pytest.mark.parametrize("value", [0, -1])
def test_shared_dev_num_below_one_is_refused(value: int) -> None:
    error = refused({"shared_dev_num": value})
    assert error.field == "scanners.intel_gpu.shared_dev_num"
    assert "greater than or equal to 1" in error.message


def test_shared_dev_num_above_the_maximum_is_refused_with_the_maximum() -> None:
    most = max_shares_per_gpu()
    assert settings(shared_dev_num=most).shared_dev_num == most
    error = refused({"shared_dev_num": most + 1})
    assert error.field == "scanners.intel_gpu.shared_dev_num"
    assert f"use at most {most}" in error.message
    assert "4 MiB" in error.message
    assert refused({"shared_dev_num": 10 * most}).field == error.field


def test_max_shares_per_gpu_is_the_largest_that_fits() -> None:
    most = max_shares_per_gpu()
    assert share_bytes(most) <= LIMIT < share_bytes(most + 1)
    # share_bytes bounds the real cost: the worst real ids, one by one, fit too.
    worst = sum(device_entry_bytes(f"ffff:ff:1f.7-{i}", "Unhealthy", (255,)) for i in range(most))
    assert worst <= share_bytes(most)
    assert share_bytes(1) == device_entry_bytes("ffff:ff:1f.7", "Unhealthy", (255,))


def test_one_gpu_at_the_maximum_passes_the_scanner_size_guard() -> None:
    most = max_shares_per_gpu()
    scanner = IntelGpuScanner(settings(shared_dev_num=most))
    sick = DeviceInfo(health=Health.UNHEALTHY, numa_nodes=(255,))
    entry = scanner._entry(I915, "ffff:ff:1f.7", sick, frozenset())
    assert len(entry.ids) == most and entry.list_bytes <= LIMIT
    scanner._check_sizes({"gpu": entry}, {I915})  # no ListTooLargeError


# ---------------------------------------------------------------------- size guard

SHARES = 20_000


def address(index: int) -> str:
    return f"0000:{index + 1:02x}:00.0"  # same length for every index below 255


def gpu_bytes(shares: int) -> int:
    """What one GPU without NUMA information is counted for: its ids as if Unhealthy (the
    longer word), so that a change of health never decides whether a list fits."""
    ids = [address(0)] if shares == 1 else [f"{address(0)}-{i}" for i in range(shares)]
    return sum(device_entry_bytes(i, "Unhealthy") for i in ids)


def advertised(
    shares: int, gpus: int, resource: str = I915
) -> tuple[IntelGpuScanner, dict[str, _Entry]]:
    scanner = IntelGpuScanner(settings(shared_dev_num=shares))
    entries: dict[str, _Entry] = {}
    for index in range(gpus):
        info = DeviceInfo(sources=(f"/sys/devices/pci0000:00/{address(index)}",))
        entries[f"/sys/devices/pci0000:00/{address(index)}"] = scanner._entry(
            resource, address(index), info, frozenset()
        )
    return scanner, entries


def gpus_for(low: float, high: float, shares: int = SHARES) -> int:
    """A GPU count whose total lands in [low * LIMIT, high * LIMIT)."""
    per_gpu = gpu_bytes(shares)
    for gpus in range(1, LIMIT // per_gpu + 3):
        if low * LIMIT <= gpus * per_gpu < high * LIMIT:
            return gpus
    raise AssertionError(f"no GPU count lands in [{low}, {high}) x {LIMIT}")


def test_entries_cost_what_device_entry_bytes_says() -> None:
    _, entries = advertised(SHARES, 3)
    assert all(entry.list_bytes == gpu_bytes(SHARES) for entry in entries.values())
    _, single = advertised(1, 1)
    (entry,) = single.values()
    assert entry.ids == (address(0),) and entry.list_bytes == gpu_bytes(1)
    # NUMA nodes are part of each id's entry; health is not: a healthy GPU is counted at the
    # unhealthy size, so that turning unhealthy cannot push a list over the limit.
    scanner = IntelGpuScanner(settings(shared_dev_num=3))
    sick = DeviceInfo(health=Health.UNHEALTHY, numa_nodes=(1,))
    well = DeviceInfo(numa_nodes=(1,))
    entry = scanner._entry(I915, address(0), sick, frozenset())
    assert entry.ids == tuple(f"{address(0)}-{i}" for i in range(3))
    assert entry.list_bytes == sum(device_entry_bytes(i, "Unhealthy", (1,)) for i in entry.ids)
    assert scanner._entry(I915, address(0), well, frozenset()).list_bytes == entry.list_bytes
    assert entry.list_bytes > sum(device_entry_bytes(i, "Healthy", (1,)) for i in entry.ids)


def test_a_list_over_4_mib_is_refused_with_a_smaller_shared_dev_num() -> None:
    gpus = gpus_for(1.0, 2.0)
    scanner, entries = advertised(SHARES, gpus)
    total = gpus * gpu_bytes(SHARES)
    assert total > LIMIT
    with structlog.testing.capture_logs() as logs, pytest.raises(ListTooLargeError) as exc:
        scanner._check_sizes(entries, {I915})
    error = exc.value
    assert isinstance(error, ConfigError)
    assert error.field == "scanners.intel_gpu.shared_dev_num"
    assert f"{gpus} GPUs x {SHARES} ids" in error.message
    assert f"{total:,}-byte" in error.message and I915 in error.message
    suggested = re.search(r"set shared_dev_num to at most (\d+)", error.message)
    assert suggested is not None and 1 <= int(suggested.group(1)) < SHARES
    (event,) = [e for e in logs if e["event"] == "intel_gpu.list_too_large"]
    assert event["log_level"] == "error" and event["field"] == error.field


@pytest.mark.parametrize("shares", [SHARES, 1000])
def test_the_suggested_shared_dev_num_fits(shares: int) -> None:
    gpus = gpus_for(1.0, 2.0, shares)
    scanner, entries = advertised(shares, gpus)
    with pytest.raises(ListTooLargeError) as exc:
        scanner._check_sizes(entries, {I915})
    suggested = re.search(r"at most (\d+)", exc.value.message)
    assert suggested is not None
    fits = int(suggested.group(1))
    assert fits < shares
    smaller, smaller_entries = advertised(fits, gpus)
    assert sum(e.list_bytes for e in smaller_entries.values()) <= LIMIT
    smaller._check_sizes(smaller_entries, {I915})


def test_only_the_named_resources_are_checked() -> None:
    scanner, entries = advertised(SHARES, gpus_for(1.0, 2.0), XE)
    scanner._check_sizes(entries, set())
    scanner._check_sizes(entries, {I915})
    with pytest.raises(ListTooLargeError, match=XE):
        scanner._check_sizes(entries, {I915, XE})


def test_totals_are_per_resource() -> None:
    # Each resource alone is under the limit; together they would not be.
    gpus = gpus_for(0.5, 1.0)
    scanner, i915 = advertised(SHARES, gpus, I915)
    _, xe = advertised(SHARES, gpus, XE)
    entries = {**i915, **{f"xe{path}": entry for path, entry in xe.items()}}
    assert sum(entry.list_bytes for entry in entries.values()) > LIMIT
    with structlog.testing.capture_logs():
        scanner._check_sizes(entries, {I915, XE})


def near_events(logs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [entry for entry in logs if entry["event"] == "intel_gpu.list_near_limit"]


def test_a_list_near_the_limit_warns_once() -> None:
    gpus = gpus_for(WARN_FRACTION, 1.0)
    scanner, entries = advertised(SHARES, gpus)
    total = gpus * gpu_bytes(SHARES)
    with structlog.testing.capture_logs() as logs:
        scanner._check_sizes(entries, {I915})
        scanner._check_sizes(entries, {I915})
    (event,) = near_events(logs)
    assert event["log_level"] == "warning"
    assert event["resource"] == I915 and event["bytes"] == total and event["limit"] == LIMIT
    assert event["hint"] == "lower scanners.intel_gpu.shared_dev_num"


def test_the_near_limit_warning_comes_back_after_the_list_shrank() -> None:
    near = gpus_for(WARN_FRACTION, 1.0)
    scanner, entries = advertised(SHARES, near)
    below = dict(list(entries.items())[: gpus_for(0.0, WARN_FRACTION)])
    with structlog.testing.capture_logs() as logs:
        scanner._check_sizes(entries, {I915})
        scanner._check_sizes(below, {I915})
        scanner._check_sizes(below, {I915})
        scanner._check_sizes(entries, {I915})
    assert len(near_events(logs)) == 2


def test_a_list_below_80_percent_is_quiet() -> None:
    gpus = gpus_for(0.5, WARN_FRACTION)
    scanner, entries = advertised(SHARES, gpus)
    with structlog.testing.capture_logs() as logs:
        scanner._check_sizes(entries, {I915})
    assert logs == []
