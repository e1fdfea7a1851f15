"""The backend's settings, read once from SGLang's ``--hicache-storage-backend-extra-config``
(keys ``hicache.*``, named as the vLLM connector's; SGLang's own keys are left to SGLang)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any

from hicache.client.engine_settings import MAX_WAIT_S, read_settings

WHERE = "--hicache-storage-backend-extra-config"


@dataclass(frozen=True)
class StoreSettings:
    endpoint: str  # the daemon's endpoint (default: $HICACHE_ENDPOINT, else the default path)
    timeout_s: float = 2.0  # a daemon call slower than this counts as the daemon being down
    retry_s: float = 5.0  # after the daemon was down, look again this much later
    namespace: str = ""  # kept apart from instances with another namespace (tenants)
    pin_s: float = 10.0  # pages batch_exists found stay pinned this long for the get after it
    daemon_user: str = ""  # the daemon may run as this user too (default: this user or root)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> StoreSettings:
        """ValueError naming the key for an unknown ``hicache.*`` key, a bad value, or a key
        that is one of ours without its prefix or with a misspelt one (``pin_s``,
        ``hicahce.pin_s``: SGLang would pass it by, and the setting would be lost)."""
        names = {f.name for f in fields(cls)}
        for key in extra or {}:
            head, dot, name = str(key).partition(".")
            close = (
                dot
                and head != "hicache"
                and difflib.SequenceMatcher(None, head, "hicache").ratio() > 0.7
            )
            if key in names or close:
                raise ValueError(
                    f"{WHERE}: {key!r} is not read (did you mean 'hicache.{name or key}'?)"
                )
        out = read_settings(cls, extra, WHERE)
        if not 0 < out.pin_s <= MAX_WAIT_S:
            raise ValueError(
                f"{WHERE}: hicache.pin_s={out.pin_s!r} must be in (0, {MAX_WAIT_S:.0f}] seconds"
            )
        return out
