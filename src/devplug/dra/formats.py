"""The string formats Kubernetes checks names against, with the API server's messages.

From k8s.io/apimachinery ``pkg/api/validate/content`` (``IsDNS1123Label``,
``IsDNS1123Subdomain``, ``IsCIdentifier``, ``RegexError``, ``MaxLenError``) and
``pkg/util/validation`` (``IsQualifiedName``, ``IsValidLabelValue``); the semantic-version
pattern of ``validateDeviceAttributeVersionValue``. Each function returns the messages the Go
one would (empty: the value is fine).
"""

from __future__ import annotations

import re

from devplug.naming import (
    DNS1123_LABEL,
    DNS1123_LABEL_FMT,
    DNS1123_SUBDOMAIN,
    DNS1123_SUBDOMAIN_FMT,
    QUALIFIED_NAME,
    QUALIFIED_NAME_FMT,
)

C_IDENTIFIER_FMT = "[A-Za-z_][A-Za-z0-9_]*"
LABEL_VALUE_FMT = "(" + QUALIFIED_NAME_FMT + ")?"

_C_IDENTIFIER = re.compile(f"^{C_IDENTIFIER_FMT}\\Z")
_LABEL_VALUE = re.compile(f"^{LABEL_VALUE_FMT}\\Z")

_NUMERIC = r"(0|[1-9]\d*)"
_PRE_RELEASE = r"(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)"
_BUILD = r"[0-9a-zA-Z-]+"
SEMVER = re.compile(
    rf"^{_NUMERIC}\.{_NUMERIC}\.{_NUMERIC}(-{_PRE_RELEASE}(\.{_PRE_RELEASE})*)?"
    rf"(\+{_BUILD}(\.{_BUILD})*)?\Z",
    re.ASCII,
)


def regex_error(message: str, fmt: str, *examples: str) -> str:
    shown = "".join(f"{' or ' if i else ''}'{example}', " for i, example in enumerate(examples))
    return f"{message} (e.g. {shown}regex used for validation is '{fmt}')"


def max_len_error(limit: int) -> str:
    return f"must be no more than {limit} characters"


def dns_label(value: str) -> list[str]:
    messages = [max_len_error(63)] if len(value) > 63 else []
    if not DNS1123_LABEL.match(value):
        if DNS1123_SUBDOMAIN.match(value):
            messages.append("must not contain dots")
        else:
            messages.append(
                regex_error(
                    "a lowercase RFC 1123 label must consist of lower case alphanumeric "
                    "characters or '-', and must start and end with an alphanumeric character",
                    DNS1123_LABEL_FMT,
                    "my-name",
                    "123-abc",
                )
            )
    return messages


def dns_subdomain(value: str) -> list[str]:
    messages = [max_len_error(253)] if len(value) > 253 else []
    if not DNS1123_SUBDOMAIN.match(value):
        messages.append(
            regex_error(
                "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                "characters, '-' or '.', and must start and end with an alphanumeric character",
                DNS1123_SUBDOMAIN_FMT,
                "example.com",
            )
        )
    return messages


def c_identifier(value: str) -> list[str]:
    """The format only; the length limit is the caller's (32 for attribute names)."""
    if _C_IDENTIFIER.match(value):
        return []
    return [
        regex_error(
            "a valid C identifier must start with alphabetic character or '_', followed by a "
            "string of alphanumeric characters or '_'",
            C_IDENTIFIER_FMT,
            "my_name",
            "MY_NAME",
            "MyName",
        )
    ]


_QUALIFIED_NAME_MSG = (
    "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with "
    "an alphanumeric character"
)


def qualified_name(value: str) -> list[str]:
    """A label key (and taint key, binding condition): ``[<DNS subdomain>/]<name>``, the name
    at most 63 characters."""
    parts = value.split("/")
    if len(parts) > 2:
        return [
            regex_error(
                "a qualified name " + _QUALIFIED_NAME_MSG,
                QUALIFIED_NAME_FMT,
                "MyName",
                "my.name",
                "123-abc",
            )
            + " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"
        ]
    messages = []
    name = parts[-1]
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            messages.append("prefix part must be non-empty")
        else:
            messages.extend("prefix part " + m for m in dns_subdomain(prefix))
    if not name:
        messages.append("name part must be non-empty")
    elif len(name) > 63:
        messages.append("name part " + max_len_error(63))
    if not QUALIFIED_NAME.match(name):  # an empty name gets both messages, as in Go
        messages.append(
            "name part "
            + regex_error(_QUALIFIED_NAME_MSG, QUALIFIED_NAME_FMT, "MyName", "my.name", "123-abc")
        )
    return messages


def label_value(value: str) -> list[str]:
    messages = [max_len_error(63)] if len(value) > 63 else []
    if not _LABEL_VALUE.match(value):
        messages.append(
            regex_error(
                "a valid label must be an empty string or consist of alphanumeric characters, "
                "'-', '_' or '.', and must start and end with an alphanumeric character",
                LABEL_VALUE_FMT,
                "MyValue",
                "my_value",
                "12345",
            )
        )
    return messages
