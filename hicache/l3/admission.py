"""ReuseAdmission: which pages have earned their write under the selective write policies.

Plain data, used by ``L3Tier`` on the cache's one thread. A page earns its write when it was
hit ``threshold`` times while cached (the tier checks ``node.hit_count``), or when it is
computed again after it left the pool above without being reused there: ``seen`` remembers
the names of the last ``SEEN_PAGES`` such pages.

``write_through_adaptive`` (the disk's default admission) adds one rule. Reuse while cached is
blind to prompts that come back only after the pool above cycled (documents asked about again
later, an agent's earlier turns): each of their pages is computed a second time before it
earns its write. So the tier counts the pages that left the pool unreused (``let_go``, each
once while remembered) and, of those, the ones that came back (``came_back``: computed again,
or read back from the store). While at least ``FIRST_SIGHT_RATE`` of them came back, every
page is written at first sight (as ``write_through`` would); below it, only pages that
earned it. At that rate each page written at first sight that never comes back is paid for
by at least one computation saved. The pages let go most recently have not had the time to
come back: as many as come back typically wait (the mean, in pages let go meanwhile, of
those that came back; at most half of those counted) are left out of the rate. The counts
are halved every ``WINDOW_PAGES`` pages let go, so the rule follows a traffic that changes,
and no verdict is given on fewer than ``MIN_PAGES``.

Mutated by: ``left`` (a page left the pool unreused: into ``seen``, counted) and ``back``
(pages are in the pool again: each one ``seen`` holds counts as come back once).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

SEEN_PAGES = 1 << 18  # names of pages that left the pool unreused, remembered (least recent out)
FIRST_SIGHT_RATE = 0.5  # came back / let go at or above which pages are written at first sight
MIN_PAGES = 64  # pages let go before the rate is trusted
WINDOW_PAGES = 1 << 14  # the counts are halved each time this many more pages were let go


class ReuseAdmission:
    def __init__(self, adaptive: bool):
        self.adaptive = adaptive  # write_through_adaptive: first sight while pages come back
        self.min_pages = MIN_PAGES  # pages let go before the rate is trusted
        # names of pages that left unreused, least recent first -> the page's number among
        # those let go (``let_go_pages`` then), or -1 once it came back (or is not counted)
        self.seen: OrderedDict[int, int] = OrderedDict()
        self.let_go = 0.0  # pages that left unreused, recently (halved per window)
        self.came_back = 0.0  # of those, pages that came back
        self.waited = 0.0  # of those, pages let go between their leaving and return, summed
        self.since_halved = 0  # pages let go since the counts were last halved
        self.let_go_pages = 0  # pages that left unreused, in all
        self.came_back_pages = 0  # of those, pages that came back, in all

    @property
    def first_sight(self) -> bool:
        """Whether a page is written at first sight now (adaptive, enough pages came back)."""
        return (
            self.adaptive
            and self.let_go >= self.min_pages
            and self.came_back >= FIRST_SIGHT_RATE * self.judged()
        )

    def judged(self) -> float:
        """Pages let go recently, but for the latest ones that could not be back yet: as many
        as a page that came back waited, on average (at most half of them)."""
        wait = self.waited / self.came_back if self.came_back else 0.0
        return max(self.let_go - min(wait, self.let_go / 2), self.came_back)

    def rate(self) -> float:
        """came back / let go, recently, of pages that had the time (0 before any left)."""
        judged = self.judged()
        return self.came_back / judged if judged else 0.0

    def left(self, names: Iterable[int], count: bool = True) -> int:
        """Pages named ``names`` left the pool without a reuse there (``count``; False: they
        were reused, but left unwritten): remember them. Returns how many count as let go:
        those not remembered already (a page counts once while remembered, as a first-sight
        write pays off if it comes back at all)."""
        seen = self.seen
        n = 0
        for name in names:
            if name in seen:  # (left before: counted then, once)
                seen.move_to_end(name)
                continue
            seen[name] = self.let_go_pages + n if count else -1
            n += count
        while len(seen) > SEEN_PAGES:
            seen.popitem(last=False)
        if not n:
            return 0
        self.let_go += n
        self.let_go_pages += n
        self.since_halved += n
        if self.since_halved >= WINDOW_PAGES:
            self.let_go /= 2
            self.came_back /= 2
            self.waited /= 2
            self.since_halved = 0
        return n

    def back(self, names: Iterable[int]) -> bool:
        """Pages named ``names`` are in the pool again (computed, or read from the store):
        each that left it unreused counts as come back, once. Returns whether any of them left
        it unreused before (it was reused: it earned its write)."""
        seen = self.seen
        earned = False
        n = 0
        waited = 0
        for name in names:
            number = seen.get(name)
            if number is None:
                continue
            earned = True
            if number >= 0:
                seen[name] = -1
                n += 1
                waited += self.let_go_pages - number
        if n:  # (recent counts: a page let go before a halving is worth half, so at most
            # as many as were let go count, their waits in proportion)
            take = min(n, max(0.0, self.let_go - self.came_back))
            self.came_back += take
            self.waited += waited * take / n
            self.came_back_pages += n
        return earned

    def seen_any(self, names: Iterable[int]) -> bool:
        """Whether any of ``names`` is remembered as having left the pool unreused (whether
        it came back since or not)."""
        seen = self.seen
        return any(name in seen for name in names)
