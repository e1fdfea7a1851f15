"""Chains: SGLang's zero-copy calls that name the whole chain (``prefix_keys``).

With ``"hicache_storage_pass_prefix_keys": true`` in its extra config, SGLang passes every
``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1`` the page hashes before the call's keys,
from the prompt's first page (``extra_info.prefix_keys``). A call then names one path from the
root: the daemon keeps a prompt's pages as one sequence in its radix tree (the key words of
``prefix_keys + keys``, a page's words after its parent's), so

- the index is **prefix-closed by structure**: a page is held only below its whole prefix, and
  eviction takes leaves (a chain's last pages) first, as for token prompts;
- a call is **one tree operation**: one match for a lookup or a get, and for a set a match
  that also allocates the pages the daemon lacks (one round trip) and one insert of them
  (one-page keys take an insert per page).

Since SGLang's page hash is chained, the path to a page is a function of the page's own key:
two calls that end at the same key name the same path, whatever prefix split they use.
A set whose prefix the daemon no longer holds (evicted, or never stored) stores nothing and
answers True, like a page stored and evicted at once: a page is never held without its prefix.

Only the zero-copy path: SGLang's generic calls (``batch_get`` / ``batch_set``) carry no
prefix, so a backend on the generic path keys pages one by one (page_keys.py). Chains live in a
namespace of their own: instances that pass prefix keys share pages with each other, not with
those that do not.

Thread safety: as the backend's (the link, the pins and the figures lock themselves).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from hicache.client.client import HiCacheClient
from hicache.client.connection import DaemonError
from hicache.client.daemon_link import Unavailable
from hicache.client.results import Match
from hicache.client.sglang.calls import KeyCalls, free_quietly
from hicache.client.sglang.pages import copy_pages, daemon_view, key_words

log = logging.getLogger("hicache.sglang")
PIN_TAG = "chain:"  # a chain's pin is keyed by its last page's key, tagged (one-page pins differ)


def prefix_keys(extra_info: Any) -> list[str] | None:
    """SGLang's ``extra_info.prefix_keys`` (None when it passes none); ValueError for a value
    that is not a list of strings."""
    keys = getattr(extra_info, "prefix_keys", None)
    if keys is None:
        return None
    if not isinstance(keys, (list, tuple)):
        raise ValueError(f"prefix_keys must be a list of page hashes, got {type(keys).__name__}")
    return list(keys)


class Chains(KeyCalls):
    """The backend's chain calls. ``bind`` (at host pool registration) gives the page format,
    SGLang's host layout and the chains' namespace; before it every call is a miss."""

    def __init__(self, *parts: Any):
        super().__init__(*parts)
        self.orphans = 0  # pages a set did not store: the daemon no longer held their prefix

    # ---- lookups ------------------------------------------------------------------------------
    def exists(self, keys: list[str], prefix: list[str]) -> int:
        """How many leading pages of ``keys`` (after ``prefix``) the daemon holds: one match of
        the chain, pinned for the get that follows."""
        tokens = self._tokens(prefix, keys)
        if tokens is None:
            return 0
        ns, skip = self.namespace, len(prefix)
        found = self.lookup(lambda c, lock: c.match_prefix(tokens, ns, lock=lock))
        if found is None:
            return 0
        m, generation = found
        hit = self._hit(m, skip, len(keys))
        pinned = generation is not None  # (else answered without a pin: the rank's share)
        if pinned and hit:  # the pin ends at the last page found: a get of it names its path
            self.pins.add([PIN_TAG + keys[hit - 1]], [m], generation, time.monotonic())
        elif pinned and m.lock_id:  # only prefix pages found: they are not kept pinned
            self._release(m, generation)
        self.note(queried=len(keys), hit=hit)
        return hit

    # ---- gets ---------------------------------------------------------------------------------
    def get(
        self, keys: list[str], prefix: list[str], dst: torch.Tensor, dst_pages: np.ndarray
    ) -> int:
        """Pages of ``keys`` copied into ``dst`` at ``dst_pages``, from the first; releases the
        pin (or the match) it used."""
        tokens = self._tokens(prefix, keys)
        if tokens is None:
            return 0
        fmt, ns, skip = self.format, self.namespace, len(prefix)
        assert fmt is not None  # (_tokens: bound)
        generation = self.link.generation
        pinned = self.pins.take([PIN_TAG + keys[-1]], generation)[0]
        start = time.perf_counter()

        def read(c: HiCacheClient) -> int:
            m = pinned
            try:
                if m is not None and m.device_hit_length != len(tokens):
                    c.release(m)  # a pin of another path (a caller's prefix that is not the
                    m = None  # chain's): never read by it, match what the call names
                if m is None:
                    m = c.match_prefix(tokens, ns, lock=True)
                count = self._hit(m, skip, len(keys))
                src = m.device_pages.numpy()[skip : skip + count]
                pool = daemon_view(fmt, self.layout, c.attach().layers)
                copy_pages(pool, dst, src, dst_pages[:count])
                return count
            finally:
                if m is not None and m.lock_id:
                    c.release(m, wait=False)  # (the copy is done: nobody waits on the release)

        return self.run_get(read, generation, start)

    # ---- sets ---------------------------------------------------------------------------------
    def set(
        self, keys: list[str], prefix: list[str], src: torch.Tensor, src_pages: np.ndarray
    ) -> bool:
        """Store the pages of ``keys`` the daemon lacks from ``src`` at ``src_pages``: the
        chain is matched, the pages after what the daemon holds are copied into pages of this
        session and inserted with the chain in one insert.

        The match takes no lock (a lock would charge the whole prefix to the rank's share):
        the insert names the held pages by their slots, and the daemon takes them only where
        they are still the tree's own at their place, so a prefix page evicted meanwhile fails
        the insert (False), never joins it. The one way such a page could pass is as a page
        of this session's own, so every allocation of the backend's (``writing``) is held off
        from the match to the insert."""
        tokens = self._tokens(prefix, keys)
        if tokens is None:
            return False
        fmt, ns, skip = self.format, self.namespace, len(prefix)
        assert fmt is not None  # (_tokens: bound)
        ps, start = fmt.page_size, time.perf_counter()

        def write(c: HiCacheClient) -> int:
            m, slots = c.match_and_alloc(tokens, ns)  # (pages for what the daemon lacks)
            held = m.device_hit_length // ps
            if held < skip:  # the prefix is gone: nothing may hang below it
                free_quietly(c, slots)
                if not self.orphans:
                    log.info(
                        "hicache: a chain set below pages the daemon no longer holds stores "
                        "nothing (a page is never held without its prefix; logged once)"
                    )
                self.orphans += len(keys)
                return 0
            first = held - skip  # the first page the daemon lacks
            if first >= len(keys):
                return 0
            try:
                pages = (slots[::ps] // ps).numpy()
                pool = daemon_view(fmt, self.layout, c.attach().layers)
                copy_pages(src, pool, src_pages[first:], pages)
                c.insert(tokens, torch.cat([m.device_indices[: held * ps], slots]), ns)
            except BaseException:
                free_quietly(c, slots)
                raise
            return len(keys) - first

        return self.run_set(write, start)

    # ---- helpers ------------------------------------------------------------------------------
    def _tokens(self, prefix: list[str], keys: list[str]) -> np.ndarray | None:
        """The chain's tree tokens (``page_size`` words per page), or None (logged) for a key
        that is not a page hash."""
        if self.format is None or not keys:
            return None
        try:
            return key_words([*prefix, *keys], self.format.page_size).reshape(-1)
        except (ValueError, TypeError) as exc:
            self.say("keys", exc)
            return None

    def _release(self, m: Match, generation: int) -> None:
        try:
            self.link.call(lambda c: c.release(m), generation)
        except (Unavailable, DaemonError) as exc:
            self.say("release", exc)

    def _hit(self, m: Match, skip: int, count: int) -> int:
        """Pages of the call's keys the match holds (those of the prefix not counted)."""
        assert self.format is not None  # (after _tokens: bound)
        return min(max(m.device_hit_length // self.format.page_size - skip, 0), count)
