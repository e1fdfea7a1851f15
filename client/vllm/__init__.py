"""hicache for vLLM: ``HiCacheConnector``, a v1 KV connector (``kv_connector_module_path``
``hicache.client.vllm``) that makes hicache-daemon vLLM's shared host KV tier.

vLLM is imported on first use of the connector only (``pip install 'hicache[vllm]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy import lazy_exports

_EXPORTS = {
    "HiCacheConnector": "hicache.client.vllm.connector",
    "ConnectorSettings": "hicache.client.vllm.settings",
}
__all__ = ["ConnectorSettings", "HiCacheConnector"]

if TYPE_CHECKING:
    from hicache.client.vllm.connector import HiCacheConnector
    from hicache.client.vllm.settings import ConnectorSettings

__getattr__ = lazy_exports("hicache.client.vllm", _EXPORTS, globals())
