"""``scanners.intel_gpu``: defaults, every bad setting named with its field, and the check that
refuses a ``shared_dev_num`` the kubelet's 4 MiB list limit cannot take (for one GPU at config
load, for the host at the first scan)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import structlog

from devplug.config import load_settings
from devplug.errors import ConfigError
from devplug.model import DeviceInfo, Health
from devplug.scanners.intel_gpu import IntelGpuScanner, IntelGpuSettings, ListTooLargeError
from devplug.scanners.intel_gpu.entry import GpuEntry, entry_sizes
from devplug.scanners.intel_gpu.settings import (
    ResourceSize,
    max_shares_per_gpu,
    refuse_if_too_big,
    share_bytes,
)
from devplug.scanners.registry import build_scanners
from devplug.sizing import (
    KUBELET_MAX_RECEIVE_BYTES,
    WARN_FRACTION,
    device_entry_bytes,
    most_shares,
    shared_ids_bytes,
)

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


def test_share_bytes_is_the_shared_sizing_bound() -> None:
    """The Intel bound is devplug.sizing's, for the longest real address with a NUMA node."""
    for shares in (1, 2, 999, 20_000):
        assert share_bytes(shares) == shared_ids_bytes("ffff:ff:1f.7", shares, (255,))
    for gpus in (1, 2, 7):
        assert max_shares_per_gpu(gpus) == most_shares(gpus, "ffff:ff:1f.7", (255,))
    assert most_shares(1, "x", limit=10) == 0  # not even one id fits


def test_one_gpu_at_the_maximum_passes_the_start_up_check() -> None:
    most = max_shares_per_gpu()
    scanner = IntelGpuScanner(settings(shared_dev_num=most))
    sick = DeviceInfo(health=Health.UNHEALTHY, numa_nodes=(255,))
    entry = scanner._entry(I915, "ffff:ff:1f.7", sick, frozenset())
    (size,) = entry_sizes([entry]).values()
    assert len(entry.ids) == most and size.bytes <= LIMIT
    check({"gpu": entry}, most)  # no ListTooLargeError


# ---------------------------------------------------------------------- start-up check

SHARES = 20_000


def address(index: int) -> str:
    return f"0000:{index + 1:02x}:00.0"  # same length for every index below 255


def gpu_bytes(shares: int) -> int:
    """What one GPU without NUMA information is counted for: its ids as if Unhealthy (the
    longer word), so that a change of health never decides whether a list fits."""
    ids = [address(0)] if shares == 1 else [f"{address(0)}-{i}" for i in range(shares)]
    return sum(device_entry_bytes(i, "Unhealthy") for i in ids)


def advertised(shares: int, gpus: int, resource: str = I915) -> dict[str, GpuEntry]:
    scanner = IntelGpuScanner(settings(shared_dev_num=shares))
    entries: dict[str, GpuEntry] = {}
    for index in range(gpus):
        info = DeviceInfo(sources=(f"/sys/devices/pci0000:00/{address(index)}",))
        entries[f"/sys/devices/pci0000:00/{address(index)}"] = scanner._entry(
            resource, address(index), info, frozenset()
        )
    return entries


def check(entries: Mapping[str, GpuEntry], shares: int = SHARES) -> None:
    """The check the scanner's first scan makes."""
    refuse_if_too_big(FIELD, shares, entry_sizes(entries.values()))


def gpus_for(low: float, high: float, shares: int = SHARES) -> int:
    """A GPU count whose total lands in [low * LIMIT, high * LIMIT)."""
    per_gpu = gpu_bytes(shares)
    for gpus in range(1, LIMIT // per_gpu + 3):
        if low * LIMIT <= gpus * per_gpu < high * LIMIT:
            return gpus
    raise AssertionError(f"no GPU count lands in [{low}, {high}) x {LIMIT}")


def test_entries_are_sized_as_the_list_limit_counts_them() -> None:
    entries = advertised(SHARES, 3)
    assert entry_sizes(entries.values()) == {I915: (3 * gpu_bytes(SHARES), 3)}
    (entry,) = advertised(1, 1).values()
    assert entry.ids == (address(0),)
    assert entry_sizes([entry])[I915] == ResourceSize(gpu_bytes(1), 1)
    # NUMA nodes are part of each id's entry; health is not: a healthy GPU is counted at the
    # unhealthy size, so that turning unhealthy cannot push a list over the limit.
    scanner = IntelGpuScanner(settings(shared_dev_num=3))
    sick = DeviceInfo(health=Health.UNHEALTHY, numa_nodes=(1,))
    well = DeviceInfo(numa_nodes=(1,))
    entry = scanner._entry(I915, address(0), sick, frozenset())
    assert entry.ids == tuple(f"{address(0)}-{i}" for i in range(3))
    sized = entry_sizes([entry])[I915].bytes
    assert sized == sum(device_entry_bytes(i, "Unhealthy", (1,)) for i in entry.ids)
    assert entry_sizes([scanner._entry(I915, address(0), well, frozenset())])[I915].bytes == sized
    assert sized > sum(device_entry_bytes(i, "Healthy", (1,)) for i in entry.ids)
    # Its shares carry one DeviceInfo object: the list limit holds them back as one unit.
    assert entry.info is sick


def test_a_list_over_4_mib_is_refused_with_a_smaller_shared_dev_num() -> None:
    gpus = gpus_for(1.0, 2.0)
    entries = advertised(SHARES, gpus)
    total = gpus * gpu_bytes(SHARES)
    assert total > LIMIT
    with structlog.testing.capture_logs() as logs, pytest.raises(ListTooLargeError) as exc:
        check(entries)
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
    with pytest.raises(ListTooLargeError) as exc:
        check(advertised(shares, gpus), shares)
    suggested = re.search(r"at most (\d+)", exc.value.message)
    assert suggested is not None
    fits = int(suggested.group(1))
    assert fits < shares
    smaller = advertised(fits, gpus)
    assert entry_sizes(smaller.values())[I915].bytes <= LIMIT
    check(smaller, fits)


def test_every_resource_is_checked_and_the_first_over_is_named() -> None:
    over = {
        f"xe{path}": entry for path, entry in advertised(SHARES, gpus_for(1.0, 2.0), XE).items()
    }
    check(advertised(SHARES, 1))  # i915 alone fits
    with pytest.raises(ListTooLargeError, match=XE):
        check({**advertised(SHARES, 1), **over})
    i915_over = advertised(SHARES, gpus_for(1.0, 2.0))
    with pytest.raises(ListTooLargeError, match=I915):  # both over: by name, i915 first
        check({**i915_over, **over})


def test_totals_are_per_resource() -> None:
    # Each resource alone is under the limit; together they would not be.
    gpus = gpus_for(0.5, 1.0)
    i915 = advertised(SHARES, gpus, I915)
    xe = {f"xe{path}": entry for path, entry in advertised(SHARES, gpus, XE).items()}
    entries = {**i915, **xe}
    assert sum(size.bytes for size in entry_sizes(entries.values()).values()) > LIMIT
    with structlog.testing.capture_logs() as logs:
        check(entries)
    assert logs == []


def test_a_list_near_the_limit_is_left_to_the_list_limit() -> None:
    """The start-up check only refuses; warnings near the limit are the daemon's list limit's
    (list_limit.near, for every scanner: tests/hotplug/test_list_limit.py)."""
    with structlog.testing.capture_logs() as logs:
        check(advertised(SHARES, gpus_for(WARN_FRACTION, 1.0)))
    assert logs == []
