"""TierNames: what the daemon calls its cache's two pools when it reports to operators.

The cache (hicache.HiRadixCache) always has a ``device`` pool and, optionally, a ``host`` pool.
A daemon that owns its device tier (``--device-tier daemon``) reports them as they are. A daemon
for engines that keep their own device tier (``--device-tier engine``: vLLM) has one pool, in
host memory, which is the **host tier** of every engine on the node; the engines' device tier
is their own blocks, which the daemon never holds. So everything such a daemon reports (the
stats, hence ``hicache info``/``top`` and /metrics, the capacity estimate, the tree, KV events)
names that pool ``host``, and its device tier's figures are zeros. vLLM counts the same hits
as ``source="host"``. The wire fields of the cache operations (``device_hit_length``, slots) do
not change: they are the client library's view of the pool it maps.

One object per daemon, chosen once at start; stateless and pure.
"""

from __future__ import annotations

from typing import Any

_SWAP = {"device": "host", "host": "device"}
# keys that name something other than one of the cache's pools ("device_tier" is a setting;
# a daemon for engines has no host pool of the cache's to verify: it reports 0 under the name)
_KEEP = frozenset({"device_tier", "corrupt_host_tokens"})


class TierNames:
    """``engine=False``: names as they are; ``engine=True``: the cache's device pool is the
    engines' host tier (and its host pool, which such a daemon never has, would be named
    device)."""

    def __init__(self, engine: bool):
        self.engine = engine
        self.pool = "host" if engine else "device"  # the tier the cache's device pool is

    def key(self, name: str) -> str:
        """A field name as reported: ``hit_device_tokens`` -> ``hit_host_tokens`` (engine)."""
        if not self.engine or name in _KEEP:
            return name
        return "_".join(_SWAP.get(word, word) for word in name.split("_"))

    def fields(self, values: dict[str, Any]) -> dict[str, Any]:
        """A flat dict of figures with its tier words renamed (a new dict)."""
        if not self.engine:
            return values
        return {self.key(k): v for k, v in values.items()}

    def rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return rows if not self.engine else [self.fields(r) for r in rows]

    def letters(self, tiers: str) -> str:
        """A tree view's tier letters (``D``, ``H``, ``DH``; ``S``: stored below the pool)
        as reported."""
        if not self.engine:
            return tiers
        swapped = ("D" if "H" in tiers else "") + ("H" if "D" in tiers else "")
        return swapped + ("S" if "S" in tiers else "")

    def request(self, fields: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
        """An operator's request fields in the cache's terms (EVICT's ``host_tokens`` is the
        pool of an engine daemon): only ``names`` are looked at."""
        if not self.engine:
            return fields
        return {self.key(k): fields[k] for k in names if k in fields}
