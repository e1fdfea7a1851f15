"""The daemon's settings: flags, HICACHE_* variables, a TOML file and the embedded default, merged
and checked; the third tier's settings.

Names are imported on first use; nothing outside this package imports its modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy import lazy_exports

_EXPORTS = {
    "DAEMON_FIELDS": "hicache.daemon.config.fields",
    "DaemonSettings": "hicache.daemon.config.settings",
    "build_parser": "hicache.daemon.config.settings",
    "parse_bytes": "hicache.daemon.config.fields",
    "resolve": "hicache.daemon.config.settings",
}
__all__ = ["DAEMON_FIELDS", "DaemonSettings", "build_parser", "parse_bytes", "resolve"]
__getattr__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:
    from hicache.daemon.config.fields import DAEMON_FIELDS, parse_bytes
    from hicache.daemon.config.settings import DaemonSettings, build_parser, resolve
