"""Rendering a DeviceTree for people and programs (``devplug scan``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import yaml

from devplug.model import DeviceInfo, DeviceTree
from devplug.naming import natural_key


def device_dict(device_id: str, info: DeviceInfo) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": device_id,
        "health": str(info.health),
        "device_nodes": [
            {
                "host_path": n.host_path,
                "container_path": n.container_path,
                "permissions": n.permissions,
            }
            for n in info.nodes
        ],
        "mounts": [
            {"host_path": m.host_path, "container_path": m.container_path, "read_only": m.read_only}
            for m in info.mounts
        ],
        "env": dict(info.env),
        "annotations": dict(info.annotations),
        "numa_nodes": list(info.numa_nodes),
        "sources": list(info.sources),
    }
    if info.health_reason:
        out["health_reason"] = info.health_reason
    return out


def tree_dict(tree: DeviceTree) -> dict[str, Any]:
    """The documented scan document: {"resources": {name: [device, ...]}}, sorted."""
    return {
        "resources": {
            name: [
                device_dict(device_id, tree[name][device_id])
                for device_id in sorted(tree[name], key=natural_key)
            ]
            for name in sorted(tree)
        }
    }


def render(tree: DeviceTree, output: str, extras: Mapping[str, object] | None = None) -> str:
    """``extras`` (scanners' reports) go beside ``"resources"``, never inside it."""
    document = {**tree_dict(tree), **(extras or {})}
    if output == "json":
        return json.dumps(document, indent=2) + "\n"
    if output == "yaml":
        return yaml.safe_dump(document, sort_keys=False)
    table, notes = render_table(tree), render_notes(extras or {})
    return table + notes if table else notes.lstrip("\n")


def render_notes(extras: Mapping[str, object]) -> str:
    """Reported items that carry a ``reason``, one line each, under the table."""
    lines = []
    for section, items in sorted(extras.items()):
        if not isinstance(items, list):
            continue
        for item in items:
            if isinstance(item, dict) and "reason" in item:
                what = item.get("summary") or item.get("id") or "?"
                lines.append(f"{section}: {what}: {item['reason']}")
    return ("\n" + "\n".join(lines) + "\n") if lines else ""


def render_table(tree: DeviceTree) -> str:
    """One row per device under a header; nothing at all for an empty tree (whether that
    means "no devices found" is the caller's to say: a scanner may have failed)."""
    rows = [("RESOURCE", "ID", "HEALTH", "NUMA", "DEVICE NODES")]
    for name in sorted(tree):
        for device_id in sorted(tree[name], key=natural_key):
            info = tree[name][device_id]
            numa = ",".join(map(str, info.numa_nodes)) or "-"
            nodes = " ".join(n.host_path for n in info.nodes) or "-"
            rows.append((name, device_id, str(info.health), numa, nodes))
    if len(rows) == 1:
        return ""
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True))
        + "  "
        + row[4]
        for row in rows
    ]
    return "\n".join(line.rstrip() for line in lines) + "\n"
