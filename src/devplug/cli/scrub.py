"""Scrubbing a capture: :class:`Scrubber` replaces serial numbers and other values that
identify a machine or its owner with placeholders before a record leaves the host.

What counts as identifying: the values of the udev properties and sysfs attribute files that
:mod:`.identifying` names (``ID_SERIAL_SHORT``, ``ID_WWN``, ``serial``, ``subsysnqn``,
``address``), one a line. A value with fewer than two different letters or digits (``0``, an
all-zero MAC address) identifies nothing and stays. ``keep`` names properties and attributes
to leave alone, and their values wherever they appear.

Each value is one identity, written in several forms: as it is (matched in any case), its
bare hex digits when it is hex-shaped (``naa.5000c500a1b2c3d4``, ``0x5000C500A1B2C3D4`` and
``5000c500a1b2c3d4`` are one WWN, so one identity), and the hex of its text (nvme's ``wwid``
spells the serial so; a binary attribute shows as hex). Each identity gets one placeholder
(numbered in the order first found, the order being the record's), shaped like the value so
relations between devices survive: a MAC address gives a MAC address (``02:00:00:00:00:01``),
a UUID a UUID, a WWN a WWN of as many digits with its prefix, text ``scrubbedN``.

The fields the names point at are replaced whole. Every other text of the record (device
paths, node and link names, DEVLINKS, other properties and attributes) has each form of eight
characters or more replaced wherever it appears (glued: ``80868086PHKS7481003Y280AGN``), and
forms of six or seven where they stand as a word; shorter ones, and values of fewer than four
different characters (``00000001``), only as a word or not at all, as they would hit
unrelated text (a serial ``0403`` is also FTDI's vendor id). A binary attribute's bytes (text
that is not UTF-8, or holds a NUL) get the same, each form replaced by as many bytes so its
layout stays, and the value's bytes themselves when it is hex-shaped (a WWN in SCSI VPD data).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from devplug.cli.identifying import (
    hex_digits,
    is_identifying_attribute,
    is_identifying_property,
    is_trivial,
    placeholder_digits,
    reshape,
    values_of,
)
from devplug.scanners.udev.record import RecordedDevice
from devplug.scanners.udev.snapshot import DeviceSnapshot

# Forms this long or longer are replaced wherever they appear; shorter ones down to
# MIN_PROPAGATED where they stand as a word.
MIN_ANYWHERE: Final = 8
MIN_PROPAGATED: Final = 6
# A value made of fewer different characters (00000001) is replaced only as a word.
MIN_DISTINCT_ANYWHERE: Final = 4
# A hex-shaped value's bytes are replaced in binary attributes from this many bytes on.
MIN_RAW_BYTES: Final = 4


@dataclass(slots=True)
class _Identity:
    """One identifying value, in whichever forms it was found."""

    number: int
    digits: str | None  # bare hex digits, lower case; None: text
    first: str  # the first spelling found
    names: set[str] = field(default_factory=set)

    @property
    def strong(self) -> bool:
        key = self.digits if self.digits is not None else self.first.lower()
        return len({c for c in key if c.isalnum()}) >= MIN_DISTINCT_ANYWHERE


@dataclass(frozen=True, slots=True)
class _Form:
    """One spelling to find (lower case) and how to replace what was found; a kept value's
    (identity None) is left as found, and so is any form inside it."""

    identity: _Identity | None
    replace: Callable[[str], str]


class Scrubber:
    """Placeholders for the identifying values of one capture."""

    def __init__(self, keep: Collection[str] = ()) -> None:
        self.keep = frozenset(keep)
        self._identities: dict[str, _Identity] = {}  # identity key -> identity
        self._values: dict[str, _Identity] = {}  # each spelling found -> its identity
        self._kept: set[str] = set()  # the values found under kept names
        self._forms: dict[str, _Form] = {}  # lower-cased form -> how to replace it
        # A form's bytes, lower-cased -> as many bytes (None: a kept value's, left as found)
        self._ascii: dict[bytes, bytes | None] = {}
        self._raw: dict[bytes, bytes] = {}  # a hex-shaped value's bytes -> same length
        self._pattern: re.Pattern[str] | None = None
        self._long_pattern: re.Pattern[str] | None = None
        self._ascii_pattern: re.Pattern[bytes] | None = None
        self._raw_pattern: re.Pattern[bytes] | None = None

    # ------------------------------------------------------------------ finding

    def collect(self, devices: Iterable[DeviceSnapshot]) -> None:
        """Find the identifying values of ``devices`` (in their order) and number them."""
        devices = list(devices)
        self._kept = self._kept_values(devices)
        kept = {_key(value) for value in self._kept}
        for device in devices:
            for key, value in device.properties.items():
                if key not in self.keep and is_identifying_property(key):
                    for found in values_of(value):
                        self._add(found, key, kept)
            for name, raw in device.attributes.items():
                base = name.rsplit("/", 1)[-1]
                if base in self.keep or not is_identifying_attribute(name):
                    continue
                text = _text(raw)
                if text is None:  # binary: its bytes as a hex-shaped value
                    self._add(raw.hex(), base, kept)
                    continue
                for value in values_of(text):
                    self._add(value, base, kept)
        self._build_forms()

    def _kept_values(self, devices: Iterable[DeviceSnapshot]) -> set[str]:
        """Values found under a kept name stay everywhere, whole: a kept serial is also the
        ``serial`` attribute's text, and a placeholder there would break the link; a kept
        ``ID_SERIAL`` of ``3`` and a WWN keeps the WWN inside it."""
        kept: set[str] = set()
        for device in devices:
            for key, value in device.properties.items():
                if key in self.keep:
                    kept.update(values_of(value))
            for name, raw in device.attributes.items():
                text = _text(raw)
                if name.rsplit("/", 1)[-1] in self.keep and text is not None:
                    kept.update(values_of(text))
        return kept

    def _add(self, value: str, name: str, kept: set[str]) -> None:
        key = _key(value)
        if not value or is_trivial(value) or key in kept:
            return
        identity = self._identities.get(key)
        if identity is None:
            number = len(self._identities) + 1
            identity = _Identity(number, hex_digits(value), value)
            self._identities[key] = identity
        identity.names.add(name)
        self._values.setdefault(value, identity)

    @property
    def scrubbed(self) -> int:
        """How many identifying values were found (one WWN in three spellings counts once)."""
        return len(self._identities)

    def placeholder(self, value: str) -> str:
        """What replaces ``value`` (a value found) where it stands whole."""
        identity = self._values[value]
        if identity.digits is None:
            return f"scrubbed{identity.number}"
        return reshape(value, placeholder_digits(identity.digits, identity.number))

    def _build_forms(self) -> None:
        for value in self._kept:  # first: a kept value wins over a form of the same spelling
            self._forms.setdefault(value.lower(), _Form(None, _as_found))
            if value.isascii():
                self._ascii.setdefault(value.lower().encode(), None)
        for value, identity in self._values.items():
            placeholder = self.placeholder(value)
            self._add_form(value.encode().hex(), identity, _cased_hex(placeholder))
            self._ascii_form(value, placeholder)
            if identity.digits is None:
                self._add_form(value, identity, _fixed(placeholder))
                continue
            # Found in any case, with or without its prefix and separators: the
            # placeholder's digits, in the case and shape found.
            digits = placeholder_digits(identity.digits, identity.number)
            self._add_form(value, identity, _reshaped(digits))
            self._add_form(identity.digits, identity, _reshaped(digits))
            self._add_form(identity.digits.encode().hex(), identity, _cased_hex(digits))
            self._ascii_form(identity.digits, digits)
            if len(identity.digits) % 2 == 0 and len(identity.digits) >= 2 * MIN_RAW_BYTES:
                self._raw[bytes.fromhex(identity.digits)] = bytes.fromhex(digits)
        propagated = [f for f in self._forms if len(f) >= MIN_PROPAGATED]
        if propagated:
            self._pattern = re.compile(_alternatives(propagated, self._anywhere), re.IGNORECASE)
        long = [f for f in propagated if self._anywhere(f)]
        if long:
            self._long_pattern = re.compile(_alternatives(long, lambda _f: True), re.IGNORECASE)
        if self._ascii:
            words = _alternatives([f.decode() for f in self._ascii], self._anywhere)
            self._ascii_pattern = re.compile(words.encode(), re.IGNORECASE)
        if self._raw:
            raw = b"|".join(re.escape(f) for f in sorted(self._raw, key=len, reverse=True))
            self._raw_pattern = re.compile(raw)

    def _add_form(self, form: str, identity: _Identity, replace: Callable[[str], str]) -> None:
        self._forms.setdefault(form.lower(), _Form(identity, replace))

    def _ascii_form(self, form: str, placeholder: str) -> None:
        if len(form) >= MIN_PROPAGATED and form.isascii():
            self._ascii.setdefault(form.lower().encode(), _fit(placeholder, form.encode()))

    def _anywhere(self, form: str) -> bool:
        identity = self._forms[form.lower()].identity
        return identity is None or (len(form) >= MIN_ANYWHERE and identity.strong)

    # ------------------------------------------------------------------ replacing

    def text(self, value: str) -> str:
        """``value`` with every form of an identifying value replaced (see the module)."""
        if self._pattern is None:
            return value
        return self._pattern.sub(self._replace, value)

    def _replace(self, match: re.Match[str]) -> str:
        found = match.group(0)
        return self._forms[found.lower()].replace(found)

    def data(self, value: bytes) -> bytes:
        """An attribute's contents: text as :meth:`text`; binary byte for byte."""
        text = _text(value)
        if text is not None:
            return self.text(text).encode()
        if self._ascii_pattern is not None:
            value = self._ascii_pattern.sub(self._replace_bytes, value)
        if self._raw_pattern is not None:
            value = self._raw_pattern.sub(lambda m: self._raw[m.group(0)], value)
        return value

    def _replace_bytes(self, match: re.Match[bytes]) -> bytes:
        found = match.group(0)
        replacement = self._ascii[found.lower()]
        return found if replacement is None else replacement

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

    def _whole(self, text: str) -> str:
        """An identifying field: each value found replaced whole, the rest as other text."""
        lines = text.split("\n")
        for index, line in enumerate(lines):
            (value,) = values_of(line) or ("",)
            if value in self._values:
                lines[index] = line.replace(value, self.placeholder(value))
            else:
                lines[index] = self.text(line)
        return "\n".join(lines)

    def _attribute(self, name: str, raw: bytes) -> bytes:
        base = name.rsplit("/", 1)[-1]
        if base not in self.keep and is_identifying_attribute(name):
            text = _text(raw)
            if text is not None:
                return self._whole(text).encode()
            if raw.hex() in self._values:
                return _fit(self.placeholder(raw.hex()), raw)
        return self.data(raw)

    # ------------------------------------------------------------------ checking

    def appearing_in(self, text: str) -> Mapping[str, set[str]]:
        """The identifying values ``text`` (a scan's output) holds in a form the record
        replaces, with the names they were found under."""
        return self._found(self._pattern, text)

    def leaks(self, record: str) -> Mapping[str, set[str]]:
        """The identifying values a written record still holds in a form of eight characters
        or more (raw or as the hex of an ``H:`` line): none, unless scrubbing has a bug."""
        return self._found(self._long_pattern, record)

    def _found(self, pattern: re.Pattern[str] | None, text: str) -> Mapping[str, set[str]]:
        if pattern is None:
            return {}
        found: dict[str, set[str]] = {}
        for match in pattern.finditer(text):
            identity = self._forms[match.group(0).lower()].identity
            if identity is not None:
                found.setdefault(identity.first, set()).update(identity.names)
        return found


def _key(value: str) -> str:
    """The identity a value spells: its hex digits, or its text in any case."""
    digits = hex_digits(value)
    return f"hex:{digits}" if digits is not None else f"text:{value.lower()}"


def _as_found(found: str) -> str:
    return found


def _fixed(text: str) -> Callable[[str], str]:
    """A replacement: ``text``, whatever was found."""
    return lambda _found: text


def _reshaped(digits: str) -> Callable[[str], str]:
    """A replacement for a hex-shaped form: what was found, its digits replaced by
    ``digits`` in the case found."""
    return lambda found: reshape(found, digits)


def _cased_hex(text: str) -> Callable[[str], str]:
    """A replacement for the hex spelling of a form: ``text`` spelled in hex, in the case
    found."""
    spelled = text.encode().hex()
    return lambda found: spelled.upper() if any(c in "ABCDEF" for c in found) else spelled


def _alternatives(forms: Iterable[str], anywhere: Callable[[str], bool]) -> str:
    """One pattern for ``forms``, longest first; those not ``anywhere`` only as a word (no
    letter or digit right beside them)."""
    parts = []
    for form in sorted(forms, key=len, reverse=True):
        escaped = re.escape(form)
        parts.append(escaped if anywhere(form) else rf"(?<![A-Za-z0-9]){escaped}(?![A-Za-z0-9])")
    return "|".join(parts)


def _fit(placeholder: str, raw: bytes) -> bytes:
    """``placeholder`` as bytes as many as ``raw``'s, so a binary layout stays: a hex-shaped
    one as the bytes its digits spell, text cut or padded."""
    if hex_digits(placeholder) is not None and len(placeholder) == 2 * len(raw):
        return bytes.fromhex(placeholder)
    return (placeholder.encode() + b"_" * len(raw))[: len(raw)]


def _text(raw: bytes) -> str | None:
    """An attribute's text, or None when it is binary (not UTF-8, or holds a NUL inside)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if "\0" in text.rstrip("\0") else text
