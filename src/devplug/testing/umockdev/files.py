"""Small path, name and file helpers shared by the testbed modules."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Final

# Properties that describe the event, not the device; the kernel never puts them in uevent.
_EVENT_ONLY_KEYS: Final = frozenset({"ACTION", "DEVPATH", "SEQNUM"})
_KEY_RE: Final = re.compile(r"^[A-Za-z0-9_.:-]+\Z")


def _canonical_sys_path(sys_path: str) -> str:
    path = sys_path.strip()
    if path.startswith("/"):
        path = path[1:]
    if not path.startswith("sys/") and path != "sys":
        path = "sys/" + path
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"invalid sys path: {sys_path!r}")
    return "/" + "/".join(parts)


def _dev_relative(path: str) -> str:
    rel = path[len("/dev/") :] if path.startswith("/dev/") else path
    _check_relative(rel, "/dev path")
    return rel


def _check_relative(name: str, what: str) -> None:
    parts = name.split("/")
    if not name or any(part in ("", ".", "..") or part.startswith(".") for part in parts):
        raise ValueError(f"invalid {what} name: {name!r}")


def _check_name(what: str, name: str) -> None:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"invalid {what}: {name!r}")


def _check_property(key: str, value: str, *, allow_event_keys: bool = False) -> None:
    if not _KEY_RE.match(key):
        raise ValueError(f"invalid property name: {key!r}")
    if key in _EVENT_ONLY_KEYS and not allow_event_keys:
        raise ValueError(f"{key} belongs to events, not to the device")
    if "\n" in value or "\0" in value:
        raise ValueError(f"property {key} contains a newline or NUL")


def _format_uevent(properties: Mapping[str, str]) -> str:
    return "".join(f"{key}={value}\n" for key, value in properties.items())


def _parse_uevent(path: str) -> dict[str, str]:
    props: dict[str, str] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            key, sep, value = line.rstrip("\n").partition("=")
            if sep:
                props[key] = value
    return props


def _write(path: str, value: str | bytes) -> None:
    data = value.encode() if isinstance(value, str) else value
    with open(path, "wb") as fh:
        fh.write(data)


def _atomic_write(path: str, value: str | bytes) -> None:
    # Readers (pyudev in this process, or another process) never see a half-written file.
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.devplug-tmp")
    _write(tmp, value)
    os.replace(tmp, path)


def _hex_id(value: str, what: str) -> int:
    try:
        return int(value, 16)
    except ValueError:
        raise ValueError(f"invalid {what}: {value!r}") from None
