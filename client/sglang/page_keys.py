"""PageKeys: SGLang's calls without a prefix, every page a key of its own.

SGLang starts a lookup at its own host hit, in the middle of a chain, and says nothing of the
pages before (unless it passes prefix keys: chains.py); its generic gets and sets never do. So
every page is a one-page key of the daemon's tree here:

- ``exists``: one batched MATCH of one-page keys per MAX_BATCH of them; the leading pages found
  stay pinned (locked) for the get that follows.
- ``get``: the pinned pages (or a MATCH for keys nobody pinned), copied, then released in one
  RELEASE; the leading run copied counts.
- ``set``: a MATCH that also allocates a page for each key the daemon lacks (one round trip),
  the copy, an INSERT in the keys' order; pages the daemon holds already are not copied again.

Keys are matched and inserted last first: the daemon's LRU clock ticks per key, so a chain's
first pages are its most recent and are evicted last (a chain that lost its head is lost whole
to SGLang's lookups, one that lost its tail keeps its head).

Thread safety: as the backend's (the link, the pins and the figures lock themselves; sets
allocate under the backend's ``writing`` lock, see chains.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hicache.client.client import HiCacheClient
from hicache.client.connection import DaemonError
from hicache.client.results import Match
from hicache.client.sglang.calls import KeyCalls, free_quietly
from hicache.client.sglang.pages import copy_pages, daemon_view, key_words
from hicache.protocol import MAX_BATCH


class PageKeys(KeyCalls):
    """The backend's one-page-key calls. ``bind`` (at host pool registration) gives the page
    format, SGLang's host layout and the namespace; before it every call is a miss."""

    # ---- lookups ------------------------------------------------------------------------------
    def exists(self, keys: list[str]) -> int:
        """How many leading pages of ``keys`` the daemon holds, pinned for the get."""
        words = self.words(keys)
        if words is None or not len(keys):
            return 0
        found = self.lookup(lambda c, lock: self._match(c, words, lock=lock))
        if found is None:
            return 0
        matches, generation = found
        assert self.format is not None  # (words: bound)
        hit = _leading(matches, self.format.page_size)
        if generation is not None:  # (pinned)
            self.pins.add(keys[:hit], matches, generation, time.monotonic())
        self.note(queried=len(keys), hit=hit)
        return hit

    # ---- gets ---------------------------------------------------------------------------------
    def get(self, keys: list[str], dst: Any, dst_pages: np.ndarray | None) -> int:
        """Pages copied, from the first: into ``dst`` (one view, at ``dst_pages``) or into
        each of the views ``dst`` lists. Releases every pin it used."""
        words = self.words(keys)
        if words is None:
            return 0
        generation = self.link.generation
        pinned = self.pins.take(keys, generation)
        fmt = self.format
        assert fmt is not None  # (words: bound)
        start = time.perf_counter()

        def read(c: HiCacheClient) -> int:
            matches = list(pinned)
            missing = [i for i, m in enumerate(matches) if m is None]
            found: Sequence[Match | None]
            try:
                if missing:
                    try:  # (refused, e.g. the session's share: the pinned run still serves)
                        found = self._match(c, words[missing], lock=True)
                    except DaemonError as exc:
                        self.say("get", exc)
                        found = [None] * len(missing)
                    for i, m in zip(missing, found, strict=True):
                        matches[i] = m
                count = _leading(matches, fmt.page_size)
                # (ignore: _leading counted matches, none None)
                src = np.array([int(m.device_pages[0]) for m in matches[:count]], np.int64)  # type: ignore[union-attr]
                pool = daemon_view(fmt, self.layout, c.attach().layers)
                if dst_pages is not None:
                    copy_pages(pool, dst, src, dst_pages[:count])
                else:
                    for page, view in zip(src, dst[:count], strict=True):
                        copy_pages(pool, view, np.array([page]), np.zeros(1, np.int64))
                return count
            finally:  # (the copy is done: nobody waits on the release)
                c.release(*(m for m in matches if m is not None and m.lock_id), wait=False)

        return self.run_get(read, generation, start)

    # ---- sets ---------------------------------------------------------------------------------
    def set(self, keys: list[str], src: Any, src_pages: np.ndarray | None) -> bool:
        """Store the pages of ``keys`` the daemon lacks, from ``src`` (one view, at
        ``src_pages``, or a view per key), inserted last key first."""
        words = self.words(keys)
        if words is None:
            return False
        fmt, ns, start = self.format, self.namespace, time.perf_counter()
        assert fmt is not None  # (words: bound)

        def write(c: HiCacheClient) -> int:
            have = self._match_and_alloc(c, words)  # (a page for each key the daemon lacks)
            lacking = [i for i, (m, _) in enumerate(have) if m.device_hit_length < fmt.page_size]
            if not lacking:
                return 0
            slots = torch.cat([have[i][1] for i in lacking])
            try:
                pages = (slots[:: fmt.page_size] // fmt.page_size).numpy()
                pool = daemon_view(fmt, self.layout, c.attach().layers)
                if src_pages is not None:
                    copy_pages(src, pool, src_pages[lacking], pages)
                else:
                    for i, page in zip(lacking, pages, strict=True):
                        copy_pages(src[i], pool, np.zeros(1, np.int64), np.array([page]))
                pairs = [
                    (words[i], slots[j * fmt.page_size : (j + 1) * fmt.page_size])
                    for j, i in enumerate(lacking)
                ]
                pairs.reverse()  # last key first, as _match: the head is evicted last
                for at in range(0, len(pairs), MAX_BATCH):
                    part = pairs[at : at + MAX_BATCH]
                    c.insert_batch(part, [ns] * len(part))
            except BaseException:
                free_quietly(c, slots)
                raise
            return len(lacking)

        return self.run_set(write, start)

    # ---- helpers ------------------------------------------------------------------------------
    def words(self, keys: list[str]) -> np.ndarray | None:
        """``[len(keys), page_size]`` tree tokens, or None (logged) for a key that is not a
        page hash."""
        if self.format is None or not isinstance(keys, (list, tuple)):
            return None
        try:
            return key_words(keys, self.format.page_size)
        except (ValueError, TypeError) as exc:
            self.say("keys", exc)
            return None

    def _match(self, c: HiCacheClient, words: np.ndarray, lock: bool) -> list[Match]:
        """One batched MATCH of one-page keys per MAX_BATCH of them (SGLang sends 128), last
        key first: the daemon's LRU clock ticks per key, so a chain's first pages become the
        most recent and are evicted last (SGLang's lookups start at the first page it lacks:
        a chain that lost its head is lost whole, one that lost its tail keeps its head)."""
        out: list[Match] = []
        for end in range(len(words), 0, -MAX_BATCH):
            part = list(words[max(0, end - MAX_BATCH) : end][::-1])
            out += c.match_batch(part, [self.namespace] * len(part), lock=lock)
        return out[::-1]

    def _match_and_alloc(self, c: HiCacheClient, words: np.ndarray) -> list[tuple[Match, Any]]:
        """``_match`` without a lock, each key's page allocated in the same round trip where
        the daemon lacks it (last key first, as ``_match``)."""
        out: list[tuple[Match, Any]] = []
        try:
            for end in range(len(words), 0, -MAX_BATCH):
                part = list(words[max(0, end - MAX_BATCH) : end][::-1])
                out += c.match_and_alloc_batch(part, [self.namespace] * len(part))
        except BaseException:  # (the parts before hold pages of this session's)
            got = [slots for _, slots in out if len(slots)]
            if got:
                free_quietly(c, torch.cat(got))
            raise
        return out[::-1]


def _leading(matches: Sequence[Match | None], page_size: int) -> int:
    """How many matches from the first found their whole page."""
    count = 0
    for m in matches:
        if m is None or m.device_hit_length < page_size:
            break
        count += 1
    return count
