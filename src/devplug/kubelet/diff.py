"""The pure diff between two device trees: which resources appeared, vanished or changed."""

from __future__ import annotations

from dataclasses import dataclass

from devplug.model import DeviceTree


@dataclass(frozen=True, slots=True)
class TreeDiff:
    added: frozenset[str] = frozenset()
    removed: frozenset[str] = frozenset()
    changed: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)


def diff(old: DeviceTree, new: DeviceTree) -> TreeDiff:
    """Compare resource by resource; a resource is changed when any device differs."""
    old_names, new_names = set(old), set(new)
    return TreeDiff(
        added=frozenset(new_names - old_names),
        removed=frozenset(old_names - new_names),
        changed=frozenset(name for name in old_names & new_names if old[name] != new[name]),
    )
