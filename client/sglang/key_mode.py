"""Which kind of keys a backend uses, read once from SGLang's configuration, never per call.

SGLang's ``hicache_storage_pass_prefix_keys`` (in ``--hicache-storage-backend-extra-config``)
makes its zero-copy calls name the page hashes before their own keys. What a call passes does
not tell the two modes apart: SGLang 0.5.23's served server (its unified radix cache) passes
``prefix_keys=None`` to ``batch_exists`` when nothing precedes the keys but ``[]`` to the get
and the set of the same pages, and without the setting it passes ``None`` to all three. A
backend that took ``None`` for one-page keys looked up in one namespace what it had stored in
the other: chains were stored and never found. So the mode is the configuration's:

- chains (``chains.py``): the setting is on and SGLang calls the zero-copy path
  (``interface_v1``); a call's missing prefix is the empty one (the prompt's start);
- one-page keys (``page_keys.py``): otherwise; any prefix a call passes is not used.

Either way every exists, get and set of one backend names pages the same way. SGLang's server
removes the setting from the extra config before it builds the backend (its controller reads
it), so it is read where SGLang keeps the server's own (``runtime_context``); SGLang's cache
controller as a library passes it through. A backend attached at run time (SGLang's HTTP
attach) reads the server's start-up configuration.
"""

from __future__ import annotations

import json
import logging
from enum import Enum
from typing import Any

log = logging.getLogger("hicache.sglang")
SETTING = "hicache_storage_pass_prefix_keys"


class KeyMode(Enum):
    CHAINS = "chains"  # a call names every page hash from the prompt's start
    PAGE_KEYS = "one-page keys"  # each page is a key of its own


def key_mode(extra: dict[str, Any] | None) -> tuple[KeyMode, str]:
    """The mode a backend built with ``extra`` (its ``storage_config.extra_config``) uses, and
    where the setting was read (for the log)."""
    extra = extra or {}
    if not extra.get("interface_v1", 0):
        return KeyMode.PAGE_KEYS, "the generic calls (no interface_v1) carry no prefix"
    if SETTING in extra:
        on, where = extra[SETTING], "the backend's extra config"
    else:
        on, where = _server_setting()
    if not isinstance(on, bool):
        raise ValueError(f"{SETTING} must be true or false, got {on!r}")
    return (KeyMode.CHAINS if on else KeyMode.PAGE_KEYS), f"{SETTING}={str(on).lower()} ({where})"


def _server_setting() -> tuple[Any, str]:
    """The setting in the server's own ``--hicache-storage-backend-extra-config`` (False where
    none is published: SGLang's classes used as a library)."""
    try:
        from sglang.srt.runtime_context import get_memory

        raw = get_memory().hicache_storage_backend_extra_config
    except Exception:  # noqa: BLE001 (no server in this process, or another SGLang)
        return False, "no server configuration in this process"
    if not raw:
        return False, "the server's configuration"
    try:
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
        )

        return HybridCacheController.parse_storage_backend_extra_config(raw)[4], (
            "the server's --hicache-storage-backend-extra-config"
        )
    except ImportError:  # (another SGLang: the JSON form only)
        return json.loads(raw).get(SETTING, False), "the server's extra config"
