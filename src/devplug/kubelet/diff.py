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
        changed=frozenset(name for name in old_names & new_names if _changed(old, new, name)),
    )


def _changed(old: DeviceTree, new: DeviceTree, name: str) -> bool:
    before, after = old[name], new[name]
    if before is after:  # trees share unchanged resources' maps
        return False
    edit = new.edit_since(name, before)
    if edit is None:
        return before != after
    # ``after`` is ``before`` with only these ids taken out or put in (the others are the
    # very same objects): compare those, not every device of the resource.
    if len(before) != len(after):
        return True
    return any(before.get(i) != after.get(i) for i in edit.removed | edit.added)
