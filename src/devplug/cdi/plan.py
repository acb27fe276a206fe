"""The CDI sync's records: one pass's plan, and what each job came to (no I/O here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from devplug.cdi.build import SpecRenderer
from devplug.cdi.catalog import CdiResource
from devplug.cdi.stamps import FileStamp
from devplug.model import DeviceInfo, MapEdit


@dataclass(slots=True)
class WrittenSpec:
    devices: Mapping[str, DeviceInfo] | None  # the device map last turned into this file
    data: bytes
    entry: CdiResource
    stamp: FileStamp | None  # the file as written, to recognise it without reading it


@dataclass(frozen=True, slots=True)
class Write:
    renderer: SpecRenderer
    file_name: str
    devices: Mapping[str, DeviceInfo]  # the resource's devices now
    # How ``devices`` was made from the map the renderer rendered last, if the tree knows.
    edit: MapEdit | None = None


@dataclass(frozen=True, slots=True)
class Removal:
    file_name: str
    stamp: FileStamp | None  # the file as this daemon wrote it


@dataclass(frozen=True, slots=True)
class Check:
    """A spec written before and unchanged since: still there as written, or written again."""

    file_name: str
    stamp: FileStamp | None
    data: bytes


@dataclass(slots=True)
class Plan:
    """One pass: specs to write, check or remove, decided on the loop (resource -> job)."""

    write: dict[str, Write] = field(default_factory=dict)
    remove: dict[str, Removal] = field(default_factory=dict)
    forget: set[str] = field(default_factory=set)  # resources whose file another one took
    verify: dict[str, Check] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Done:
    data: bytes  # the spec's bytes (empty: the resource has no spec)
    entry: CdiResource | None  # what it defines (None: unchanged, for a check)
    wrote: bool  # whether the file was written now
    stamp: FileStamp | None


# A job's outcome: done, removed (None), or why it failed.
Outcome = Done | Exception | None
