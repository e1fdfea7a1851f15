"""The connector's settings, read once from ``kv_connector_extra_config`` (keys ``hicache.*``),
and the identity of the KV this engine computes (model, LoRA, cache salt)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields
from typing import Any

from hicache.client.curve import client_keys
from hicache.endpoints import env_endpoint, is_loopback

PREFIX = "hicache."
MAX_WAIT_S = 600.0  # a timeout or retry longer than this is a typo, not a setting


@dataclass(frozen=True)
class ConnectorSettings:
    endpoint: str  # the daemon's endpoint (default: $HICACHE_ENDPOINT, else the default path)
    timeout_s: float = 2.0  # a daemon call slower than this counts as the daemon being down
    retry_s: float = 5.0  # after the daemon was down, look again this much later
    store: bool = True  # publish computed blocks to the daemon (False: load only)
    store_generated: bool = True  # also blocks of generated tokens (the next chat turn's prefix)
    namespace: str = ""  # kept apart from engines with another namespace (tenants)
    layerwise: str = "auto"  # load one layer ahead of the forward pass: auto (CUDA), on, off
    l3_wait_s: float = 1.0  # a prefix coming from the daemon's third tier: wait this long at most
    daemon_user: str = ""  # the daemon may run as this user too (default: this user or root)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """ValueError naming the key for an unknown ``hicache.*`` key or a bad value."""
        extra = extra or {}
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {"endpoint": env_endpoint()}
        for key, value in extra.items():
            if not key.startswith(PREFIX):
                continue  # another connector's (MultiConnector) settings
            name = key[len(PREFIX) :]
            if name not in known:
                raise ValueError(
                    f"kv_connector_extra_config: unknown key {key!r} (known: "
                    f"{', '.join(PREFIX + n for n in known)})"
                )
            values[name] = _convert(key, known[name].type, value)
        out = cls(**values)
        if not 0 < out.timeout_s <= MAX_WAIT_S:
            raise ValueError(
                f"kv_connector_extra_config: hicache.timeout_s={out.timeout_s!r} must be in "
                f"(0, {MAX_WAIT_S:.0f}] seconds"
            )
        if not 0 <= out.retry_s <= MAX_WAIT_S:
            raise ValueError(
                f"kv_connector_extra_config: hicache.retry_s={out.retry_s!r} must be in "
                f"[0, {MAX_WAIT_S:.0f}] seconds"
            )
        if not 0 <= out.l3_wait_s <= MAX_WAIT_S:
            raise ValueError(
                f"kv_connector_extra_config: hicache.l3_wait_s={out.l3_wait_s!r} must be in "
                f"[0, {MAX_WAIT_S:.0f}] seconds"
            )
        if out.layerwise not in ("auto", "on", "off"):
            raise ValueError(
                f"kv_connector_extra_config: hicache.layerwise={out.layerwise!r} is not one of "
                "auto, on, off"
            )
        if not out.endpoint.startswith(("ipc://", "tcp://")) or len(out.endpoint) <= 6:
            raise ValueError(
                f"kv_connector_extra_config: hicache.endpoint={out.endpoint!r} is not "
                "ipc://PATH or tcp://HOST:PORT"
            )
        if not is_loopback(out.endpoint) and client_keys() is None:
            raise ValueError(
                f"kv_connector_extra_config: hicache.endpoint={out.endpoint!r} is another host: "
                "without CurveZMQ keys anyone could answer there (and read every prompt); set "
                "HICACHE_CURVE_SERVER_KEY and HICACHE_CURVE_CLIENT_KEY, as the daemon requires"
            )
        if out.endpoint.startswith("ipc://@"):
            raise ValueError(
                f"kv_connector_extra_config: hicache.endpoint={out.endpoint!r}: abstract sockets "
                "have no owner (anyone may take the name); use ipc://PATH"
            )
        return out


def _convert(key: str, kind: Any, value: Any) -> Any:
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
    raise ValueError(f"kv_connector_extra_config: {key}={value!r} is not a {kind.__name__}")


def model_identity(vllm_config: Any) -> str:
    """What makes this engine's KV this model's: the model (path or name), its revision and
    quantization. Part of the layout and of every namespace."""
    mc = vllm_config.model_config
    parts = [str(mc.model), str(getattr(mc, "revision", None) or "")]
    parts.append(str(getattr(mc, "quantization", None) or ""))
    return "|".join(parts)


def request_namespace(base: str, request: Any) -> str:
    """The tree namespace of a request: KV is shared only between requests of the same model,
    LoRA adapter, cache salt and connector namespace (hashed: a bounded, opaque key)."""
    lora = getattr(request, "lora_request", None)
    lora_id = "" if lora is None else f"{lora.lora_name}|{getattr(lora, 'lora_path', '')}"
    salt = getattr(request, "cache_salt", None) or ""
    digest = hashlib.blake2b(f"{base}\0{lora_id}\0{salt}".encode(), digest_size=16)
    return "vllm:" + digest.hexdigest()
