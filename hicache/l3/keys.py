"""Page keys: one name per full page of KV that means the same bytes on every machine.

``key_0 = sha256(seed ‖ namespace)``, ``key_i = sha256(key_{i-1} ‖ tokens of page i)``, where
the seed hashes everything that makes KV differ for the same tokens: model identity, dtype,
KV format and shape, page size, the pool layout (the value's byte order; with engine-owned
device tiers, the engines' block layout too), the shard (tensor
parallel rank) and a format version. A key therefore names the page's tokens, every token before
them, and the exact bytes that hold their KV: nothing else can ever hit it. Tokens are hashed in
the wire form (int32 little-endian), the same bytes the tree keys on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from hicache.config import HiCacheConfig

FORMAT = 1  # bump when the value's layout or the key derivation changes
PREFIX = "hc1:"


def identity_of(
    config: HiCacheConfig,
    model: str,
    shard: str,
    layout: Mapping[str, object] | None = None,
    under_host: bool = True,
) -> dict[str, object]:
    """What the seed covers, for a cache of ``config`` serving ``model``. ``under_host``:
    values come from the host pool (else from the cache's one pool, in the device layout).
    ``layout``: the engines' layout identity when the store sits under their pool
    (``--device-tier engine``); its own model name is left out (``model`` names the model on
    every machine, where local paths differ), the rest (heads, block shape, backend) is in."""
    heads, dim = config.head_shape
    out: dict[str, object] = {
        "format": FORMAT,
        "model": model,
        "dtype": config.dtype,
        "kv_format": str(config.kv_format),
        "layers": config.num_layers,
        "kv": config.num_kv,
        "heads": heads,
        "head_dim": dim,
        "page_size": config.page_size,
        "host_layout": str(config.host_layout) if under_host else "device",
        "shard": shard,
    }
    if layout is not None:
        out["engine"] = {k: v for k, v in layout.items() if k != "model"}
    return out


class KeyChain:
    """Derives page keys for one seed (identity). Pure and thread-safe."""

    def __init__(self, identity: Mapping[str, object], page_size: int):
        canonical = json.dumps(dict(identity), sort_keys=True, separators=(",", ":"))
        self.seed = hashlib.sha256(canonical.encode()).digest()
        self.page_bytes = page_size * 4  # token ids as int32

    def root(self, namespace: object) -> bytes:
        """key_0 of a namespace (``None`` is the default one)."""
        h = hashlib.sha256(self.seed)
        h.update(b"\0ns\0" + repr(namespace).encode())
        return h.digest()

    def extend(self, prior: bytes, token_bytes: bytes | memoryview) -> list[bytes]:
        """Digests of the full pages of ``token_bytes`` (int32 LE) following digest ``prior``."""
        out, step, view = [], self.page_bytes, memoryview(token_bytes)
        for at in range(0, len(view) - step + 1, step):
            prior = hashlib.sha256(prior + view[at : at + step]).digest()
            out.append(prior)
        return out

    @staticmethod
    def name(digest: bytes) -> str:
        """The store key of a digest."""
        return PREFIX + digest.hex()
