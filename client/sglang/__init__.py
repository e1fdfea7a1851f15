"""SGLang's HiCache storage tier on hicache-daemon: one host tier shared by every SGLang
instance on a node (and, through the daemon's third tier, across nodes).

SGLang loads it without a change of its own::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "hicache", "module_path": "hicache.client.sglang",
      "class_name": "HiCacheStore", "interface_v1": 1,
      "hicache_storage_pass_prefix_keys": true, "hicache.endpoint": "ipc://..."}'

Interface: ``HiCacheStore`` (backend.py, imports SGLang), ``StoreSettings`` (settings.py);
``chains.py`` serves the calls that pass prefix keys (a prompt's pages as one tree path),
``page_keys.py`` the rest (a key per page), both built on ``calls.py``; ``pages.py`` holds the
page format, views and keys (torch only), ``pins.py`` the pins between a lookup and its get,
``figures.py`` what SGLang's storage metrics read. Names load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy import lazy_exports

_EXPORTS = {
    "HiCacheStore": "hicache.client.sglang.backend",
    "StoreSettings": "hicache.client.sglang.settings",
    "PageFormat": "hicache.client.sglang.pages",
}
__all__ = ["HiCacheStore", "PageFormat", "StoreSettings"]
__getattr__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:
    from hicache.client.sglang.backend import HiCacheStore
    from hicache.client.sglang.pages import PageFormat
    from hicache.client.sglang.settings import StoreSettings
