"""Scrubbing a capture: :class:`Scrubber` replaces serial numbers and other values that
identify a machine or its owner with placeholders before a record leaves the host.

What counts as identifying: the value of a udev property whose name has one of the words
SERIAL, UUID, GUID, WWN, WWID, EUI, LABEL, MAC, HOSTNAME or NODENAME (``ID_SERIAL_SHORT``,
``ID_FS_UUID``, ``ID_NET_NAME_MAC``), and the text of a sysfs attribute file named
``address``, ``perm_addr``, ``mac_address``, ``hostname``, ``unique_id`` or ``phys_port_id``,
or whose name ends in serial, uuid, guid, nguid, wwid, wwn, eui, eui64, serial_number or
asset_tag (``serial``, ``board_serial``, ``product_uuid``). A value with fewer than two
different letters or digits (``0``, an all-zero MAC address) identifies nothing and stays.
``keep`` names properties and attributes to leave alone.

Each value is replaced by one placeholder wherever it is found, so relations between
devices survive: the same input gives the same placeholder (numbered in the order first found,
the order being the record's), a MAC address gives a MAC address (``02:00:00:00:00:01``, also
without colons where the address appears so), a UUID a UUID. Besides the identifying fields
themselves, a value of six characters or more is also replaced inside every other text of the
record (device paths, node and link names, DEVLINKS, other properties and attributes) where it
stands as a word of its own; shorter ones would hit unrelated text (a serial ``0403`` is also
FTDI's vendor id).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from typing import Final

from devplug.scanners.udev.snapshot import DeviceSnapshot
from devplug.testing.umockdev.record import RecordedDevice

IDENTIFYING_PROPERTY_WORDS: Final = frozenset(
    {"SERIAL", "UUID", "GUID", "WWN", "WWID", "EUI", "LABEL", "MAC", "HOSTNAME", "NODENAME"}
)
# Attribute files by name, and by the last word of their name (``board_serial``,
# ``product_uuid``): not every word will do, ``addr_len`` and ``addr_assign_type`` are no
# address.
IDENTIFYING_ATTRIBUTES: Final = frozenset(
    {"address", "perm_addr", "mac_address", "hostname", "unique_id", "phys_port_id"}
)
IDENTIFYING_ATTRIBUTE_ENDINGS: Final = frozenset(
    {"serial", "uuid", "guid", "nguid", "wwid", "wwn", "eui", "eui64", "number", "tag"}
)
# ``serial_number``, ``board_asset_tag``: the ending alone (``number``, ``tag``) is too wide.
_ENDING_NEEDS: Final = {"number": "serial_number", "tag": "asset_tag"}
# Values this long or longer are also replaced where they stand as a word in other text.
MIN_PROPAGATED: Final = 6
_WORD_SPLIT: Final = re.compile(r"[^A-Za-z0-9]+")
_MAC: Final = re.compile(r"[0-9A-Fa-f]{2}(?::[0-9A-Fa-f]{2}){5}")
_BARE_MAC: Final = re.compile(r"[0-9A-Fa-f]{12}")
_UUID: Final = re.compile(
    r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}"
)


def is_identifying_property(key: str) -> bool:
    return any(word in IDENTIFYING_PROPERTY_WORDS for word in _WORD_SPLIT.split(key.upper()))


def is_identifying_attribute(name: str) -> bool:
    base = name.rsplit("/", 1)[-1].lower()
    if base in IDENTIFYING_ATTRIBUTES:
        return True
    ending = _WORD_SPLIT.split(base)[-1]
    if ending not in IDENTIFYING_ATTRIBUTE_ENDINGS:
        return False
    return ending not in _ENDING_NEEDS or base.endswith(_ENDING_NEEDS[ending])


def is_trivial(value: str) -> bool:
    """A value that identifies nothing: fewer than two different letters or digits
    (``0``, ``00:00:00:00:00:00``, ``ff:ff:ff:ff:ff:ff``)."""
    return len({c for c in value.lower() if c.isalnum()}) < 2


class Scrubber:
    """Placeholders for the identifying values of one capture."""

    def __init__(self, keep: Collection[str] = ()) -> None:
        self.keep = frozenset(keep)
        #: identifying value -> its placeholder
        self.placeholders: dict[str, str] = {}
        #: identifying value -> the property and attribute names it was found under
        self.found_under: dict[str, set[str]] = {}
        # The colon-less spellings of MAC addresses: placeholders, but not values found.
        self._spellings: set[str] = set()
        self._pattern: re.Pattern[str] | None = None
        self._bytes_pattern: re.Pattern[bytes] | None = None

    # ------------------------------------------------------------------ finding

    def collect(self, devices: Iterable[DeviceSnapshot]) -> None:
        """Find the identifying values of ``devices`` (in their order) and number them."""
        devices = list(devices)
        kept = self._kept_values(devices)
        for device in devices:
            for key, value in device.properties.items():
                if key not in self.keep and is_identifying_property(key):
                    self._add(value, key, kept)
            for name, raw in device.attributes.items():
                base = name.rsplit("/", 1)[-1]
                if base in self.keep or not is_identifying_attribute(name):
                    continue
                text = _text(raw)
                if text is not None:
                    self._add(text.strip(), base, kept)
        propagated = sorted(
            (v for v in self.placeholders if len(v) >= MIN_PROPAGATED), key=len, reverse=True
        )
        if propagated:
            words = "|".join(_word(value) for value in propagated)
            self._pattern = re.compile(words)
            self._bytes_pattern = re.compile(words.encode())

    def _kept_values(self, devices: Iterable[DeviceSnapshot]) -> set[str]:
        """Values found under a kept name stay everywhere: a kept serial is also the
        ``serial`` attribute's text, and a placeholder there would break the link."""
        kept: set[str] = set()
        for device in devices:
            kept.update(v for k, v in device.properties.items() if k in self.keep)
            for name, raw in device.attributes.items():
                text = _text(raw)
                if name.rsplit("/", 1)[-1] in self.keep and text is not None:
                    kept.add(text.strip())
        return kept

    def _add(self, value: str, name: str, kept: set[str]) -> None:
        if is_trivial(value) or value in kept:
            return
        self.found_under.setdefault(value, set()).add(name)
        if value in self.placeholders:
            return
        number = len(self.placeholders) + 1
        self.placeholders[value] = _placeholder(value, number)
        if _MAC.fullmatch(value):
            bare = value.replace(":", "").lower()
            if bare not in kept and bare not in self.placeholders:
                self.placeholders[bare] = self.placeholders[value].replace(":", "")
                self.found_under.setdefault(bare, set()).add(name)
                self._spellings.add(bare)

    @property
    def scrubbed(self) -> int:
        """How many identifying values were found (a MAC address counts once)."""
        return len(self.placeholders) - len(self._spellings)

    # ------------------------------------------------------------------ replacing

    def text(self, value: str) -> str:
        """``value`` with every identifying value of six characters or more that stands as a
        word in it replaced."""
        if self._pattern is None:
            return value
        return self._pattern.sub(lambda m: self.placeholders[m.group(0)], value)

    def data(self, value: bytes) -> bytes:
        if self._bytes_pattern is None:
            return value
        return self._bytes_pattern.sub(
            lambda m: self.placeholders[m.group(0).decode()].encode(), value
        )

    def device(self, device: DeviceSnapshot) -> RecordedDevice:
        """``device``, scrubbed, as a record's device."""
        properties = {
            key: self._whole(value) if self._scrubs_property(key) else self.text(value)
            for key, value in device.properties.items()
        }
        attributes = {
            self.text(name): self._attribute(name, raw) for name, raw in device.attributes.items()
        }
        return RecordedDevice(
            sys_path=self.text(device.sys_path),
            properties=properties,
            attributes=attributes,
            links={self.text(name): self.text(target) for name, target in device.links.items()},
            node=None if device.node is None else self.text(device.node),
            devlinks=tuple(self.text(link) for link in device.devlinks),
        )

    def _scrubs_property(self, key: str) -> bool:
        return key not in self.keep and is_identifying_property(key)

    def _whole(self, value: str) -> str:
        return self.placeholders.get(value, value)

    def _attribute(self, name: str, raw: bytes) -> bytes:
        base = name.rsplit("/", 1)[-1]
        if base not in self.keep and is_identifying_attribute(name):
            text = _text(raw)
            if text is not None and text.strip() in self.placeholders:
                stripped = text.strip()
                return text.replace(stripped, self.placeholders[stripped]).encode()
        return self.data(raw)

    def appearing_in(self, text: str) -> Mapping[str, set[str]]:
        """The identifying values that stand as a word in ``text`` (a scan's output), with
        the names they were found under."""
        return {
            value: names
            for value, names in self.found_under.items()
            if re.search(_word(value), text) is not None
        }


def _word(value: str) -> str:
    """A pattern for ``value`` standing as a word (no letter or digit right beside it). A MAC
    address without colons is matched anywhere: interface names put letters before it
    (``enx001122334455``)."""
    escaped = re.escape(value)
    if _BARE_MAC.fullmatch(value):
        return escaped
    return rf"(?<![A-Za-z0-9]){escaped}(?![A-Za-z0-9])"


def _placeholder(value: str, number: int) -> str:
    if _MAC.fullmatch(value):
        low = f"{number:06x}"[-6:]
        return f"02:00:00:{low[0:2]}:{low[2:4]}:{low[4:6]}"
    if _BARE_MAC.fullmatch(value):
        return f"020000{number:06x}"[-12:].rjust(12, "0")
    if _UUID.fullmatch(value):
        made = f"00000000-0000-4000-8000-{number:012x}"
        return made.upper() if value.isupper() else made
    return f"scrubbed{number}"


def _text(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
