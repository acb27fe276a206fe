"""Foreign text made safe to print on an operator's terminal.

Text devplug did not write (what another vendor's plugin answers, what the kubelet says about
pods, a file name in a shared dir) can carry escape sequences, carriage returns and line
breaks that would move the cursor, recolour, retitle the terminal or forge a line of output.
:func:`escaped` writes every such character as a Python-style escape; printable text, non-ASCII
letters included, is kept as it is. JSON and YAML output escape by themselves.
"""

from __future__ import annotations

# The escapes Python's repr uses for these; other unprintable characters get \\x, \\u or \\U.
_NAMED_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escaped(text: str) -> str:
    """``text`` with every character that is not printable (control characters, line and
    paragraph separators, format characters such as bidi overrides) and the backslash written
    as an escape; printable text, non-ASCII letters included, is kept as it is."""
    if text.isprintable() and "\\" not in text:
        return text
    out: list[str] = []
    for char in text:
        if char in _NAMED_ESCAPES:
            out.append(_NAMED_ESCAPES[char])
        elif char.isprintable():
            out.append(char)
        elif ord(char) < 0x100:
            out.append(f"\\x{ord(char):02x}")
        elif ord(char) < 0x10000:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(f"\\U{ord(char):08x}")
    return "".join(out)
