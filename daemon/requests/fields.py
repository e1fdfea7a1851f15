"""Reading a request's header fields: each helper returns the value or raises BAD_FIELD naming
the field (nothing has changed yet when it does). Pure functions."""

from __future__ import annotations

from typing import Any

from hicache.protocol import ErrorCode, ProtocolError


def int_field(fields: dict, name: str, lo: int = 0, hi: int = 2**62) -> int:
    value = fields.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{name}: expected an int in [{lo}, {hi}]")
    return value


def bool_field(fields: dict, name: str, default: bool) -> bool:
    value = fields.get(name, default)
    if type(value) is not bool:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{name}: expected true or false")
    return value


def namespaces_field(fields: dict, count: int) -> list[Any]:
    """``namespaces``: one per sequence of the request (absent: all None)."""
    spaces = fields.get("namespaces")
    if spaces is None:
        return [None] * count
    if not isinstance(spaces, list) or len(spaces) != count:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"namespaces: expected a list of {count}")
    return spaces
