"""ReuseAdmission (hicache/l3/admission.py), the rule of the selective write policies alone:
which pages earned their write, and when ``write_through_adaptive`` writes at first sight."""

from __future__ import annotations

from hicache.l3.admission import FIRST_SIGHT_RATE, MIN_PAGES, WINDOW_PAGES, ReuseAdmission


def test_a_page_that_left_unreused_earns_its_write_when_it_is_back():
    adm = ReuseAdmission(adaptive=False)
    assert not adm.back([1, 2])  # (never left: not reused)
    adm.left([1, 2, 3])
    assert adm.seen_any([9, 3]) and not adm.seen_any([9])
    assert adm.back([3, 9])  # computed again: earned
    assert adm.back([3])  # (still earned, but counted back once)
    assert (adm.let_go_pages, adm.came_back_pages) == (3, 1)
    adm.left([3, 4])  # 3 left again, and back again: each page counts once while remembered
    adm.back([3, 4])
    assert (adm.let_go_pages, adm.came_back_pages) == (4, 2)


def test_pages_that_left_reused_are_remembered_but_not_counted():
    adm = ReuseAdmission(adaptive=True)
    adm.left(range(MIN_PAGES), count=False)  # (reused, their write dropped)
    assert adm.back(range(MIN_PAGES))  # earned
    assert (adm.let_go, adm.came_back, adm.came_back_pages) == (0, 0, 0)
    assert not adm.first_sight


def test_first_sight_needs_enough_pages_and_half_of_them_back():
    adm = ReuseAdmission(adaptive=True)
    for name in range(MIN_PAGES - 2):  # each back at once (it waited for one page: itself)
        adm.left([name])
        adm.back([name])
    assert adm.rate() == 1.0 and not adm.first_sight  # (too few to trust)
    adm.left([1000, 1001])
    assert adm.first_sight  # 62 of 63 judged
    adm.left(range(2000, 2000 + MIN_PAGES))  # 62 of 127 judged: just under half
    assert adm.rate() < FIRST_SIGHT_RATE and not adm.first_sight
    adm.back([2000, 2001])  # 64 of about 125
    assert adm.first_sight
    assert not ReuseAdmission(adaptive=False).first_sight


def test_pages_too_recent_to_be_back_are_not_judged_yet():
    """Pages that come back three batches after they left: the latest batches could not be
    back yet. Counting them would put the rate at 1/4 when the first batch is back; leaving out
    as many as a page waited (at most half) puts it at one half, and first sight turns on."""
    adm = ReuseAdmission(adaptive=True)
    batch = [list(range(b * 100, b * 100 + 100)) for b in range(8)]
    for t in range(4):
        adm.left(batch[t])
    adm.back(batch[0])  # (each page waited for the 300 to 399 pages let go after it)
    assert adm.came_back / adm.let_go == 0.25
    assert adm.rate() == FIRST_SIGHT_RATE and adm.first_sight
    adm.left(batch[4])
    adm.back(batch[1])
    assert adm.came_back / adm.let_go == 0.4 and adm.rate() > FIRST_SIGHT_RATE


def test_the_rate_follows_a_traffic_that_changes():
    """Past each window of pages let go, the counts are halved: a traffic whose pages stopped
    coming back turns first sight off within about a window."""
    adm = ReuseAdmission(adaptive=True)
    names = iter(range(10**9))
    for _ in range(WINDOW_PAGES // 128):  # everything comes back
        batch = [next(names) for _ in range(128)]
        adm.left(batch)
        adm.back(batch)
    assert adm.first_sight and adm.rate() == 1.0
    left = 0
    while adm.first_sight:  # then nothing does
        adm.left([next(names) for _ in range(128)])
        left += 128
        assert left <= 2 * WINDOW_PAGES
    assert adm.came_back_pages == WINDOW_PAGES  # (the totals are not halved)
    assert adm.let_go_pages == WINDOW_PAGES + left


def test_seen_is_bounded_least_recent_out(monkeypatch):
    import hicache.l3.admission as admission

    monkeypatch.setattr(admission, "SEEN_PAGES", 4)
    adm = ReuseAdmission(adaptive=False)
    adm.left([1, 2, 3])
    adm.left([4, 1, 5])  # (1 is recent again; 2 is the least recent)
    assert list(adm.seen) == [3, 4, 1, 5]
    assert not adm.back([2])


def test_returns_past_the_recent_count_add_their_waits_in_proportion(monkeypatch):
    """After a halving, pages let go before it can come back more than the recent count of
    pages let go: only as many count as come back, and only their share of the waits, so
    the mean wait (what ``judged`` leaves out) stays a wait some page had."""
    monkeypatch.setattr("hicache.l3.admission.WINDOW_PAGES", 100)
    adm = ReuseAdmission(adaptive=True)
    adm.left(range(100))  # halved at once: 50 let go, recently
    assert adm.let_go == 50
    adm.back(range(100))  # each waited 100 - its number: 5050 in all, for 100 pages
    assert adm.came_back == 50 and adm.came_back_pages == 100
    assert adm.waited == 5050 / 2  # (half of them count: half of their waits)
    assert adm.waited / adm.came_back == 5050 / 100  # the mean wait of the pages back
