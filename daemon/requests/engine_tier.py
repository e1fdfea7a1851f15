"""EngineTier: a daemon for engines that own their device tier (``--device-tier engine``).

vLLM keeps KV in its own blocks and its own prefix cache; such a daemon holds one shared pool
in host memory (the host tier of every engine on the node) and a radix tree over it. It starts
without a KV shape: the first engine to REGISTER its ``EngineLayout`` sizes the pool
(``host_bytes`` or ``host_tokens``) and every later engine must name an equal layout
(``LAYOUT_MISMATCH`` otherwise, naming both), so no engine ever reads another model's KV.
Until then every cache operation answers ``NO_LAYOUT``.

Runs on the control thread only (the handlers call it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from hicache.cache import HiRadixCache
from hicache.config import HiCacheConfig
from hicache.daemon.config import DaemonSettings
from hicache.daemon.sessions import SessionLimits
from hicache.errors import InsufficientMemoryError
from hicache.memory import EngineLayout
from hicache.protocol import ErrorCode, ProtocolError

log = logging.getLogger("hicache.daemon")


class Made(NamedTuple):
    """What the first registration made."""

    cache: HiRadixCache  # over the new pool
    limits: SessionLimits  # per-session limits for its size
    info: dict[str, Any]  # what hello and REGISTER publish from now on: config, pools, layout


MakeCache = Callable[[HiCacheConfig, EngineLayout], tuple[HiRadixCache, dict[str, Any]]]


class EngineTier:
    def __init__(self, settings: DaemonSettings, make_cache: MakeCache):
        self.settings = settings
        self.make_cache = make_cache  # creates the pools and the cache (and their description)
        self.layout: EngineLayout | None = None  # what the first engine registered
        self.registrations = 0  # REGISTER requests accepted (every engine rank sends one)
        self._refused = ""  # the last refusal logged

    def _refuse(self, code: ErrorCode, message: str) -> ProtocolError:
        """The error refusing a registration, logged once per distinct message (an engine
        asks again every few seconds)."""
        if message != self._refused:
            log.warning("an engine's registration refused: %s", message)
            self._refused = message
        return ProtocolError(code, message)

    def register(self, raw: Any) -> tuple[EngineLayout, Made | None]:
        """Check an engine's layout. Returns the served layout and, when this registration made
        the pool, what it made; raises ProtocolError (nothing changed)."""
        try:
            layout = EngineLayout.from_dict(raw)
        except ValueError as exc:
            raise ProtocolError(ErrorCode.BAD_FIELD, str(exc)) from None
        if self.layout is not None:
            message = self.layout.mismatch(layout)
            if message:
                raise self._refuse(ErrorCode.LAYOUT_MISMATCH, message)
            self.registrations += 1
            return self.layout, None
        s = self.settings
        tokens = s.engine_pool_tokens(layout.page_bytes, layout.block_size)
        if tokens < layout.block_size:
            raise self._refuse(
                ErrorCode.OUT_OF_MEMORY,
                f"the host pool ({s.host_bytes or s.engine_tokens}) holds no whole "
                f"block of this layout ({layout.page_bytes} bytes per block)",
            )
        cfg = layout.pool_config(tokens, eviction_policy=s.config.eviction_policy)
        try:
            cache, pools = self.make_cache(cfg, layout)
        except InsufficientMemoryError as exc:
            raise self._refuse(ErrorCode.OUT_OF_MEMORY, f"the engines' pool: {exc}") from None
        self.layout = layout
        self.registrations += 1
        limits = SessionLimits.for_pool(
            cache.device_capacity_pages,
            s.session_owned_fraction,
            s.session_max_locks,
            s.session_max_loads,
            pool="host",
        )
        log.info(limits.describe(s.max_sessions))
        info = {"config": s.as_dict(cfg), "pools": pools, "layout": layout.as_dict()}
        return layout, Made(cache, limits, info)

    @staticmethod
    def refusal() -> ProtocolError:
        """What a daemon that owns its device pool answers a REGISTER."""
        return ProtocolError(
            ErrorCode.LAYOUT_MISMATCH,
            "this daemon owns its device pool (device_tier=daemon): engines that keep their "
            "own blocks (vLLM) need a daemon started with --device-tier engine",
        )


def no_layout() -> ProtocolError:
    """What a cache operation gets before any engine registered a layout."""
    return ProtocolError(
        ErrorCode.NO_LAYOUT,
        "this daemon (device_tier=engine) has no KV layout yet: an engine registers one "
        "first (the vLLM connector does when vLLM starts)",
    )
