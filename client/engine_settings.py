"""Settings an engine integration reads from its engine's config (keys ``hicache.*``): the
parsing and the checks every integration shares (vLLM's connector, SGLang's backend)."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import TYPE_CHECKING, Any, TypeVar

from hicache.curve import client_keys
from hicache.endpoints import env_endpoint, is_loopback

PREFIX = "hicache."
MAX_WAIT_S = 600.0  # a timeout or retry longer than this is a typo, not a setting
S = TypeVar("S", bound="DataclassInstance")

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def read_settings(cls: type[S], extra: dict[str, Any] | None, where: str) -> S:
    """``cls`` (a dataclass with ``endpoint``, ``timeout_s`` and ``retry_s``) from the
    ``hicache.*`` keys of ``extra`` (other keys are other components'); ValueError naming
    ``where`` and the key for an unknown key, a bad value, or an endpoint not to be trusted."""
    extra = extra or {}
    known = {f.name: f for f in fields(cls)}
    values: dict[str, Any] = {"endpoint": env_endpoint()}
    for key, value in extra.items():
        if not isinstance(key, str) or not key.startswith(PREFIX):
            continue
        name = key[len(PREFIX) :]
        if name not in known:
            raise ValueError(
                f"{where}: unknown key {key!r} (known: {', '.join(PREFIX + n for n in known)})"
            )
        values[name] = _convert(where, key, known[name].type, value)
    out = cls(**values)
    _check_common(out, where)
    return out


def _check_common(out: Any, where: str) -> None:
    if not 0 < out.timeout_s <= MAX_WAIT_S:
        raise ValueError(
            f"{where}: hicache.timeout_s={out.timeout_s!r} must be in (0, {MAX_WAIT_S:.0f}] seconds"
        )
    if not 0 <= out.retry_s <= MAX_WAIT_S:
        raise ValueError(
            f"{where}: hicache.retry_s={out.retry_s!r} must be in [0, {MAX_WAIT_S:.0f}] seconds"
        )
    endpoint = out.endpoint
    if not endpoint.startswith(("ipc://", "tcp://")) or len(endpoint) <= 6:
        raise ValueError(
            f"{where}: hicache.endpoint={endpoint!r} is not ipc://PATH or tcp://HOST:PORT"
        )
    if not is_loopback(endpoint) and client_keys() is None:
        raise ValueError(
            f"{where}: hicache.endpoint={endpoint!r} is another host: without CurveZMQ keys "
            "anyone could answer there (and read every prompt); set HICACHE_CURVE_SERVER_KEY "
            "and HICACHE_CURVE_CLIENT_KEY, as the daemon requires"
        )
    if endpoint.startswith("ipc://@"):
        raise ValueError(
            f"{where}: hicache.endpoint={endpoint!r}: abstract sockets have no owner (anyone "
            "may take the name); use ipc://PATH"
        )


def _convert(where: str, key: str, kind: Any, value: Any) -> Any:
    kind = {"str": str, "float": float, "bool": bool}.get(str(kind), kind)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1", "yes", "false", "0", "no"):
            return str(value).lower() in ("true", "1", "yes")
    elif kind is float and not isinstance(value, bool):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if math.isfinite(number):
            return number
    elif isinstance(value, str):
        return value
    raise ValueError(f"{where}: {key}={value!r} is not a {kind.__name__}")
