"""The connector's settings, read once from ``kv_connector_extra_config`` (keys ``hicache.*``),
and the identity of the KV this engine computes (model, LoRA, cache salt)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from hicache.client.engine_settings import MAX_WAIT_S, read_settings

WHERE = "kv_connector_extra_config"


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
        out = read_settings(cls, extra, WHERE)
        if not 0 <= out.l3_wait_s <= MAX_WAIT_S:
            raise ValueError(
                f"{WHERE}: hicache.l3_wait_s={out.l3_wait_s!r} must be in "
                f"[0, {MAX_WAIT_S:.0f}] seconds"
            )
        if out.layerwise not in ("auto", "on", "off"):
            raise ValueError(
                f"{WHERE}: hicache.layerwise={out.layerwise!r} is not one of auto, on, off"
            )
        return out


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
