"""Break the rules that matter, one at a time, and see which tests notice.

Each mutation below replaces one exact piece of source (it must occur exactly once) in a
temporary copy of the repository laid out as installed (``hicache/`` with ``daemon/``,
``client/`` and ``kernels/`` inside it, the built C helpers copied along), then runs the tests
named for it there. A mutation no test catches is a rule no test guards: add a test, then the
mutation here. Whoever changes a rule: add its mutation. (The bare-name guard of the top-level
folders, kernels/shadowing.py, exists only in the repository's own layout: its test is
tests/test_shadowing.py, run from the repository.)

    .venv/bin/python -m scripts.mutations              # every mutation (about 20 minutes)
    .venv/bin/python -m scripts.mutations quarantine   # those whose name contains a word
    .venv/bin/python -m scripts.mutations --no-control # CI, right after the whole suite passed
    .venv/bin/python -m scripts.mutations --jobs 2     # two at a time, each in its own copy
                                                       # (those of ALONE's tests: one at a time)

First runs each mutation's tests on the copy as it is (they must pass: a test that fails anyway
would catch everything; ``--no-control`` skips that where the suite just passed on the same
tree). Every process the tests start imports the copy (PYTHONPATH), the reaper too. Prints one
line per mutation (caught or SURVIVED, the time), then one JSON object; exits 1 when any
survived.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# tests of what a crashed daemon leaves and who gives it back: any other daemon of this user
# that starts meanwhile clears a dead one's leftovers too, so their mutations run alone
ALONE = frozenset(("tests/test_kept.py", "tests/test_keep_host.py", "tests/test_planted_files.py"))


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # in the repository
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments that must fail


MUTATIONS = [
    Mutation(
        "memory-imports-the-tree",
        "hicache/memory/allocator.py",
        "import hicache._native as _native\n",
        "import hicache._native as _native\nfrom hicache.tree import fastpath  # noqa: F401\n",
        ("tests/test_layering.py",),
    ),
    Mutation(
        "a-page-insert-reads-one-page-too-few-per-sequence",
        "daemon/requests/cache_ops.py",
        "counts = [-(-n // ps) for n in lengths]",
        "counts = [n // ps for n in lengths]",
        ("tests/test_daemon.py::test_pages_instead_of_slots_cache_what_slots_would",),
    ),
    Mutation(
        "alloc-in-pages-answers-slots",
        "daemon/requests/cache_ops.py",
        "slots_frame(slots[:: self.cache.page_size] // self.cache.page_size)",
        "slots_frame(slots[: -(-len(slots) // self.cache.page_size)])",
        ("tests/test_daemon.py::test_pages_instead_of_slots_cache_what_slots_would",),
    ),
    Mutation(
        "top-shows-only-the-third-tier-s-counters",
        "client/top.py",
        'for section, table in ((None, FIGURES), ("l3", L3_FIGURES), ("l3", DISK_FIGURES))',
        'for section, table in (("l3", L3_FIGURES),)',
        ("tests/test_live_view.py::test_rates_are_the_interval_not_the_lifetime",),
    ),
    Mutation(
        "tp-publish-on-any-rank",
        "client/vllm/scheduler.py",
        "ok = step == rep.step and rep.ranks >= self.world",
        "ok = step == rep.step and rep.ranks >= 1",
        ("tests/test_vllm_sides.py",),
    ),
    Mutation(
        "a-split-leaves-the-upper-half-unlocked",
        "hicache/tree/radix_tree.py",
        "for field in TreeNode.SHARED:",
        "for field in TreeNode.SHARED[1:]:",
        ("tests/test_tree.py", "-k", "split"),
    ),
    Mutation(
        "a-third-tier-setting-loses-its-help",
        "daemon/config/l3.py",
        'help_ = f.metadata["help"]',
        'help_ = ""',
        ("tests/test_review_gaps.py", "-k", "help_shows_every_setting"),
    ),
    Mutation(
        "the-daemon-imports-the-client",
        "daemon/config/settings.py",
        "from hicache.curve import load_secret\n",
        "from hicache.client.connection import client_keys as load_secret\n",
        ("tests/test_layering.py",),
    ),
    Mutation(
        "a-figure-reported-under-a-name-the-table-lacks",
        "daemon/requests/handlers.py",
        'out["views_refused"] = self.views.refused',
        'out["refused_views"] = self.views.refused',
        ("tests/test_figures.py",),
    ),
    Mutation(
        "page-slots-without-c-count-elements-not-bytes",
        "hicache/tree/fastpath.py",
        "    nbytes = pages.nbytes if isinstance(pages, np.ndarray) else len(pages)",
        "    nbytes = len(pages)",
        ("tests/test_fastpath.py", "-k", "page_slots"),
    ),
    Mutation(
        "daemon-ignores-namespaces",
        "hicache/protocol/messages.py",
        "    if spaces is None:\n        return [None] * count",
        "    if True:\n        return [None] * count",
        ("tests/test_daemon.py", "-k", "namespaces"),
    ),
    Mutation(
        "host-eviction-ignores-loads",
        "hicache/tiering.py",
        "and node.host_ref == 0",
        "and True",
        ("tests/test_pitfalls.py", "tests/test_stateful.py"),
    ),
    Mutation(
        "failed-load-keeps-device-pages",
        "hicache/transfers/book.py",
        '            assert node.lock_ref == 0, f"{node}: locked below a failed load"\n'
        "            self.tiering.drop_device(node)",
        '            assert node.lock_ref == 0, f"{node}: locked below a failed load"',
        ("tests/test_failed_copies.py", "tests/test_stateful.py"),
    ),
    Mutation(
        "no-quarantine",
        "daemon/sessions/table.py",
        "session.release_at = session.expires + self.quarantine_s",
        "session.release_at = session.expires",
        ("tests/test_daemon_stateful.py", "tests/test_daemon.py", "-k", "stalls or killed"),
    ),
    Mutation(
        "busy-polling-off",
        "daemon/transport/busy_poll.py",
        "self.spin = busy_poll_us / 1e6",
        "self.spin = 0.0",
        ("tests/test_busy_poll.py",),
    ),
    Mutation(
        "locks-pin-for-free",
        "daemon/requests/cache_ops.py",
        "pinned = max(made, inserted)",
        "pinned = 0",
        ("tests/test_sessions.py",),
    ),
    Mutation(
        "sessions-per-connection-unbounded",
        "daemon/sessions/table.py",
        "if peer and self._per_peer[peer] >= MAX_SESSIONS_PER_PEER:",
        "if False:",
        ("tests/test_sessions.py",),
    ),
    Mutation(
        "engine-trusts-any-listener",
        "client/trust.py",
        "    uid = peer_uid(path)\n    if uid not in trusted:",
        "    uid = peer_uid(path)\n    if False:",
        ("tests/test_trust.py",),
    ),
    Mutation(
        "pool-mapped-through-links",
        "hicache/memory/backing.py",
        "os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC",
        "os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC",
        ("tests/test_trust.py",),
    ),
    Mutation(
        "keep-marker-written-through-links",
        "hicache/memory/kept.py",
        '    with open(os.open(tmp, flags, 0o600), "w") as fh:\n',
        "    tmp = path\n    with open(os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600), "
        '"w") as fh:\n',
        ("tests/test_planted_files.py",),
    ),
    Mutation(
        "kept-pools-never-freed",
        "daemon/keep/reaper.py",
        "        if expired(marker) or not names_snapshot(marker):",
        "        if False:",
        ("tests/test_kept.py",),
    ),
    Mutation(
        "engine-pool-named-device",
        "daemon/requests/handlers.py",
        "        self.tiers = TierNames(engine_tier is not None)",
        "        self.tiers = TierNames(False)",
        ("tests/test_engine_tier.py",),
    ),
    Mutation(
        "preempted-lookups-counted",
        "client/vllm/scheduler.py",
        'if own is None or client is None or getattr(request, "num_preemptions", 0):',
        "if own is None or client is None:",
        ("tests/test_vllm_sides.py",),
    ),
    Mutation(
        "failed-loads-counted-as-loaded",
        "client/vllm/scheduler.py",
        "        loaded = planned - min(planned, rep.failed_loads * self.block_size)",
        "        loaded = planned",
        ("tests/test_vllm_sides.py",),
    ),
    Mutation(
        "stopping-goodbye-frees-at-once",
        "daemon/requests/handlers.py",
        "        if report.stopping:",
        "        if False:",
        ("tests/test_vllm_sides.py",),
    ),
    Mutation(
        "expired-kept-pool-claimed",
        "daemon/keep/snapshot.py",
        "        if expired(marker):",
        "        if False:",
        ("tests/test_kept.py",),
    ),
    Mutation(
        "reaper-imports-from-the-working-folder",
        "daemon/keep/reaper.py",
        '[sys.executable, "-P", "-m", "hicache.daemon.keep.reaper", lock_path, instance],\n'
        '        cwd="/",',
        '[sys.executable, "-m", "hicache.daemon.keep.reaper", lock_path, instance],',
        ("tests/test_kept.py",),
    ),
    Mutation(
        "engine-totals-unbounded",
        "daemon/sessions/engine_counts.py",
        "        self.loaded = min(SATURATED, self.loaded + other.loaded)",
        "        self.loaded = self.loaded + other.loaded",
        (
            "tests/test_vllm_sides.py::test_engine_totals_saturate_and_a_bad_goodbye_still_ends_the_session",
        ),
    ),
    Mutation(
        "engine-hits-beyond-queries-accepted",
        "hicache/protocol/messages.py",
        "        if hit > queried:",
        "        if False:",
        (
            "tests/test_vllm_sides.py::"
            "test_engine_figures_that_are_not_counts_are_refused_and_change_nothing",
        ),
    ),
    Mutation(
        "a-refused-request-adds-its-engine-counts",
        "daemon/requests/handlers.py",
        "            if self.cache is None and req.op not in NO_CACHE_OPS:\n"
        "                raise no_layout()\n",
        "            if counts is not None and session is not None:\n"
        "                session.engine.add(counts)\n"
        "                self.engine_counts.add(counts)\n"
        "                counts = None\n"
        "            if self.cache is None and req.op not in NO_CACHE_OPS:\n"
        "                raise no_layout()\n",
        ("tests/test_wire_refusals.py", "-k", "refused_request_adds"),
    ),
    Mutation(
        "engine-counts-without-a-session-dropped",
        "daemon/requests/handlers.py",
        "            if counts is not None and session is None:",
        "            if False:",
        ("tests/test_wire_refusals.py", "-k", "without_a_session"),
    ),
    Mutation(
        "a-huge-page-id-wraps-into-the-pool",
        "daemon/requests/cache_ops.py",
        "        if len(pages) and (int(pages.min()) < 0 or int(pages.max()) >= top):",
        "        if False:",
        ("tests/test_wire_refusals.py", "-k", "huge_page_id"),
    ),
    Mutation(
        "release-all-takes-any-value",
        "hicache/protocol/messages.py",
        '        return cls(fields.get("lock_ids"), bool_field(fields, "all", False))',
        '        return cls(fields.get("lock_ids"), fields.get("all") is True)',
        ("tests/test_wire_refusals.py", "-k", "release_all"),
    ),
    Mutation(
        "disk-write-budget-ignored",
        "hicache/disk/store.py",
        "            elif self.budget.take(self.files.slot_bytes):",
        "            elif True:",
        ("tests/test_disk_store.py", "-k", "budget_is_never"),
    ),
    Mutation(
        "disk-header-checksum-skipped",
        "hicache/disk/slots.py",
        "        if SUM.unpack_from(block, end)[0] != xxhash.xxh3_64_intdigest(body):",
        "        if False:",
        ("tests/test_disk_store.py", "-k", "corrupted"),
    ),
    Mutation(
        "disk-full-refuses-instead-of-evicting",
        "hicache/disk/store.py",
        "            if not self._index or next(iter(self._index)) in keep:\n"
        "                return None\n            self.evict(1)\n",
        "            return None\n",
        ("tests/test_disk_store.py", "-k", "full_tier"),
    ),
    Mutation(
        "disk-eviction-takes-a-prefix-before-its-tail",
        "hicache/disk/store.py",
        "                at = parent_of[at]\n",
        "                at = None\n",
        ("tests/test_disk_store.py", "-k", "leaves_before"),
    ),
    Mutation(
        "disk-restart-orders-by-write-not-by-use-of-the-tail",
        "hicache/disk/recovery.py",
        "    return sorted(found, key=lambda k: (newest[k], -depth[k]))",
        "    return sorted(found, key=lambda k: found[k][0])",
        ("tests/test_disk_store.py", "-k", "leaves_before"),
    ),
    Mutation(
        "disk-writes-a-page-without-its-prefix",
        "hicache/disk/store.py",
        "            elif parent is not None and parent not in self._index and parent not in "
        "taking:",
        "            elif False:",
        ("tests/test_disk_store.py", "-k", "only_with_its_prefix"),
    ),
    Mutation(
        "disk-keeps-a-tail-whose-prefix-write-failed",
        "hicache/disk/store.py",
        "            if error is None and (header.parent is None or header.parent in self._index):",
        "            if error is None:",
        ("tests/test_disk_store.py", "-k", "only_with_its_prefix"),
    ),
    Mutation(
        "disk-evicts-a-writes-own-prefix-for-it",
        "hicache/disk/store.py",
        "            if not self._index or next(iter(self._index)) in keep:",
        "            if not self._index:",
        ("tests/test_disk_store.py", "-k", "only_with_its_prefix"),
    ),
    Mutation(
        "the-tier-never-writes-again-a-prefix-the-disk-let-go",
        "hicache/l3/tier.py",
        "                while up is not None and up.l3 is True:",
        "                while False:",
        ("tests/test_disk_store.py", "-k", "let_go"),
    ),
    Mutation(
        "selective-forgets-pages-computed-again-after-they-left",
        "hicache/l3/tier.py",
        "                back = bool(admission.seen) and admission.back("
        "self._page_names(node).tolist())",
        "                back = False",
        ("tests/test_l3_tier.py", "-k", "computed_again"),
    ),
    Mutation(
        "selective-takes-a-flush-for-a-reuse",
        "hicache/l3/tier.py",
        "        if self.selective and to_l3 and (unreused or job is None):",
        "        if self.selective and (unreused or job is None):",
        ("tests/test_l3_tier.py", "-k", "computed_again"),
    ),
    Mutation(
        "a-disk-flush-comes-back-after-a-restart",
        "hicache/disk/recovery.py",
        "header.value_len <= files.value_bytes and header.seq > floor:",
        "header.value_len <= files.value_bytes and True:",
        ("tests/test_disk_store.py", "-k", "flushed_page_never_comes_back"),
    ),
    Mutation(
        "after-a-disk-flush-the-tree-still-takes-its-nodes-as-written",
        "hicache/l3/tier.py",
        "            if node.l3 is True:\n                node.l3 = None\n",
        "            pass\n",
        ("tests/test_disk_store.py", "-k", "tree_writes_its_prompts_again"),
    ),
    Mutation(
        "a-disk-flush-on-a-daemon-without-a-disk-flushes-the-pools",
        "daemon/requests/admin_ops.py",
        "        if req.disk and (l3 is None or not l3.store.clears):",
        "        if False:",
        ("tests/test_l3_daemons.py", "-k", "flush_of_the_disk"),
    ),
    Mutation(
        "a-restart-resets-the-disks-write-budget",
        "hicache/disk/store.py",
        "                self.budget.load(record)\n",
        "                pass\n",
        ("tests/test_disk_store.py", "-k", "outlives_a_restart"),
    ),
    Mutation(
        "a-page-that-leaves-the-disk-leaves-its-tail-alone",
        "hicache/disk/store.py",
        "            stack.extend(self._kids.pop(at, ()))\n",
        "            self._kids.pop(at, ())\n",
        ("tests/test_disk_store.py", "-k", "takes_its_tail_along"),
    ),
    Mutation(
        "a-restart-keeps-a-tail-whose-prefix-was-lost",
        "hicache/disk/store.py",
        " never a tail alone)\n            self._drop(key)\n",
        " never a tail alone)\n            pass\n",
        ("tests/test_disk_store.py", "-k", "takes_its_tail_along"),
    ),
    Mutation(
        "a-zero-copy-read-serves-a-slot-holding-another-key",
        "hicache/disk/slots.py",
        "        if header is None or header.key != key:\n            return None\n        _same",
        "        if header is None:\n            return None\n        _same",
        ("tests/test_disk_store.py", "-k", "straight_between"),
    ),
    Mutation(
        "a-clean-stop-leaves-admitted-pages-the-queue-dropped",
        "hicache/l3/tier.py",
        "        if self.config.close_drain_s > 0 and self.breaker.allow():",
        "        if False:",
        ("tests/test_l3_daemons.py", "-k", "queue_dropped"),
    ),
    Mutation(
        "a-disk-checkpoint-without-its-journal-is-trusted",
        "hicache/disk/recovery.py",
        "        records = journal.read(folders[0].path, token, files.count, size)\n",
        "        records = journal.read(folders[0].path, token, files.count, size) or []\n",
        ("tests/test_disk_store.py", "-k", "crash_finds_the_index"),
    ),
    Mutation(
        "a-disk-checkpoint-of-another-geometry-is-trusted",
        "hicache/disk/checkpoint.py",
        '        if head != {"magic": MAGIC, **geometry} or not tokens_ok:',
        '        if head.get("magic") != MAGIC:',
        ("tests/test_disk_store.py", "-k", "checkpoint_is_read_and_only"),
    ),
    Mutation(
        "a-damaged-budget-record-stops-the-disk",
        "hicache/disk/budget.py",
        "        except Exception as exc:  # (any shape",
        "        except (TypeError, ValueError) as exc:  # (any shape",
        ("tests/test_disk_store.py", "-k", "damaged_folder"),
    ),
    Mutation(
        "a-crashs-temporary-files-stay-in-the-disk-folder",
        "hicache/disk/store.py",
        "                remove_stale_temporaries(folder.path)\n",
        "                pass\n",
        ("tests/test_disk_store.py", "-k", "damaged_folder"),
    ),
    Mutation(
        "a-checkpoint-listing-a-parent-first-is-trusted",
        "hicache/disk/checkpoint.py",
        "    if any(e[3] is not None and at.get(e[3], n + 1) <= n for n, e in enumerate(entries)):",
        "    if False:",
        ("tests/test_disk_store.py", "-k", "damaged_folder"),
    ),
    Mutation(
        "a-floor-beyond-any-sequence-is-used",
        "hicache/disk/folder.py",
        "    if floor > MAX_FLOOR:\n",
        "    if False:\n",
        ("tests/test_disk_store.py", "-k", "damaged_folder"),
    ),
    Mutation(
        "disk-parts-counted-in-items-not-bytes",
        "hicache/disk/slots.py",
        '    return view if view.format == "B" and view.ndim == 1 else view.cast("B")',
        "    return view",
        ("tests/test_disk_store.py", "-k", "whatever_view"),
    ),
    Mutation(
        "an-idle-io-thread-never-ticks-its-store",
        "hicache/l3/worker.py",
        "                    self._tick()\n",
        "                    pass  # (not journaled)\n",
        ("tests/test_l3_tier.py", "-k", "ticks"),
    ),
    Mutation(
        "disk-over-a-store-never-reads-the-disk",
        "hicache/l3/disk_store.py",
        "        got: list[Got] = list(self.disk.get(keys, pages))",
        "        got: list[Got] = [None] * len(keys)",
        ("tests/test_disk_store.py", "-k", "disk_over_a_remote"),
    ),
    Mutation(
        "disk-admits-pages-never-reused",
        "daemon/config/l3.py",
        '    "reused": {"write_policy": "write_through_adaptive", "write_threshold": 2},',
        '    "reused": {"write_policy": "write_through"},',
        ("tests/test_l3_daemons.py", "-k", "earned_it"),
    ),
    Mutation(
        "a-stop-drops-the-disks-queued-writes",
        "hicache/l3/worker.py",
        "            if drain_s <= 0:\n                queues += (self.writes,)",
        "            if True:\n                queues += (self.writes,)",
        ("tests/test_disk_store.py", "-k", "drains"),
    ),
    Mutation(
        "a-load-without-room-leaves-its-chain-out-of-the-host-heap",
        "hicache/transfers/book.py",
        "                n.host_ref -= 1\n                self.tiering.push_host(n)\n",
        "                n.host_ref -= 1\n",
        ("tests/test_failed_copies.py", "-k", "no_device_room"),
    ),
    Mutation(
        "stopped-link-reopens",
        "client/daemon_link.py",
        '        self.stopped, self.down_until = True, float("inf")',
        '        self.down_until = float("inf")',
        ("tests/test_vllm_sides.py::test_a_stopped_link_stays_stopped",),
    ),
    Mutation(
        "reserve-kept-while-the-daemon-drains",
        "client/vllm/scheduler.py",
        "        link.on_draining = self._give_back_reserve\n",
        "",
        (
            "tests/test_vllm_sides.py::test_a_draining_daemon_gets_the_engines_reserve_back_and_stops_without_waiting",
        ),
    ),
    Mutation(
        "planted-files-count-as-ours",
        "daemon/keep/segments.py",
        "if len(parts) == 3 and _is_own(os.path.join(directory, name)):",
        "if len(parts) == 3:",
        ("tests/test_planted_files.py",),
    ),
    Mutation(
        "client-names-raw",
        "daemon/requests/handlers.py",
        "        client = printable(req.client)",
        "        client = req.client",
        ("tests/test_daemon.py", "-k", "escaped"),
    ),
    Mutation(
        "sglang-pins-kept-after-the-get",
        "client/sglang/page_keys.py",
        "                c.release(*(m for m in matches if m is not None and m.lock_id), "
        "wait=False)",
        "                pass",
        ("tests/test_sglang.py::test_exists_pins_pages_until_the_get_and_releases_the_rest",),
    ),
    Mutation(
        "sglang-every-mla-rank-writes",
        "client/sglang/backend.py",
        "        if not self.writer:  # an MLA rank other than the writer: rank 0 stores the page",
        "        if False:",
        ("tests/test_sglang.py::test_mla_ranks_share_one_page_and_only_the_writer_stores",),
    ),
    Mutation(
        "sglang-ranks-share-one-namespace",
        "client/sglang/backend.py",
        'shard = "mla" if self.mla else f"tp{self.tp_rank}/{self.tp_size}"',
        'shard = "mla" if self.mla else "tp"',
        (
            "tests/test_sglang.py::"
            "test_a_second_writer_stores_only_what_the_daemon_lacks_and_tp_ranks_stay_apart",
        ),
    ),
    Mutation(
        "sglang-set-stores-what-the-daemon-has",
        "client/sglang/page_keys.py",
        "lacking = [i for i, (m, _) in enumerate(have) if m.device_hit_length < fmt.page_size]",
        "lacking = list(range(len(have)))",
        (
            "tests/test_sglang.py::"
            "test_a_second_writer_stores_only_what_the_daemon_lacks_and_tp_ranks_stay_apart",
        ),
    ),
    Mutation(
        "sglang-chain-set-copies-what-the-daemon-has",
        "client/sglang/chains.py",
        "first = held - skip  # the first page the daemon lacks",
        "first = 0",
        (
            "tests/test_sglang_chains.py::"
            "test_a_chain_is_found_whatever_split_the_calls_use_and_sets_store_what_lacks",
        ),
    ),
    Mutation(
        "sglang-chain-stored-below-a-missing-prefix",
        "client/sglang/chains.py",
        "if held < skip:  # the prefix is gone: nothing may hang below it",
        "if False:",
        ("tests/test_sglang_chains.py::test_a_set_below_a_prefix_the_daemon_lacks_stores_nothing",),
    ),
    Mutation(
        "sglang-chain-pin-kept-after-the-get",
        "client/sglang/chains.py",
        "                if m is not None and m.lock_id:\n"
        "                    c.release(m, wait=False)",
        "                pass",
        ("tests/test_sglang_chains.py::test_a_lookup_pins_its_chain_until_the_get",),
    ),
    Mutation(
        "sglang-chains-and-page-keys-share-a-namespace",
        "client/sglang/backend.py",
        '_namespace(self.model, shard, self.settings.namespace, "chain")',
        '_namespace(self.model, shard, self.settings.namespace, "")',
        (
            "tests/test_sglang_chains.py::"
            "test_chains_written_by_one_controller_are_prefetched_mid_chain_by_another_process",
            "-k",
            "mha",
        ),
    ),
    Mutation(
        "third-tier-lookups-take-no-turns",
        "daemon/requests/cache_ops.py",
        "            if i and time.perf_counter() > turn_ends and self.others_waiting():",
        "            if False:",
        ("tests/test_fair_turns.py::test_the_third_tiers_lookups_take_turns_too",),
    ),
    Mutation(
        "client-key-holds-a-share-per-session",
        "daemon/sessions/limits.py",
        "        if len(session.fellows) > 1:",
        "        if False:",
        (
            "tests/test_sessions.py::"
            "test_one_client_key_holds_at_most_one_share_of_the_pool_over_its_sessions",
        ),
    ),
    Mutation(
        "sglang-chain-pin-read-at-another-depth",
        "client/sglang/chains.py",
        "                if m is not None and m.device_hit_length != len(tokens):",
        "                if False:",
        ("tests/test_sglang_chains.py::test_a_pin_is_used_only_by_a_get_of_its_own_path",),
    ),
    Mutation(
        "sglang-chain-set-locks-its-prefix",
        "client/client.py",
        "        matches = self._match_parts(batch, namespaces, False, rests)",
        "        matches = self._match_parts(batch, namespaces, True, rests)",
        (
            "tests/test_sglang_chains.py::"
            "test_a_long_chain_is_stored_in_batches_without_its_prefix_charged_to_the_rank",
        ),
    ),
    Mutation(
        "sglang-allocations-within-a-chain-set",
        "client/sglang/calls.py",
        "            with self.writing:\n                stored = self.link.call(write)",
        "            stored = self.link.call(write)",
        (
            "tests/test_sglang_chains.py::"
            "test_no_allocation_of_the_backend_falls_between_a_chain_sets_match_and_insert",
        ),
    ),
    Mutation(
        "empty-match-locks",
        "daemon/requests/cache_ops.py",
        "if lock and found else 0",
        "if lock else 0",
        ("tests/test_sglang.py::test_a_lookup_that_finds_nothing_holds_nothing",),
    ),
    Mutation(
        "sglang-pins-take-the-generation-after-the-call",
        "client/sglang/calls.py",
        "            return self.link.call_at(lambda c: match(c, True))",
        "            return self.link.call(lambda c: match(c, True)), self.link.generation",
        ("tests/test_sglang.py::test_pins_of_a_session_another_thread_renewed_are_never_used",),
    ),
    Mutation(
        "sglang-a-refused-match-fails-the-whole-get",
        "client/sglang/page_keys.py",
        "                        found = [None] * len(missing)",
        "                        raise",
        (
            "tests/test_sglang.py::"
            "test_a_get_refused_room_for_unpinned_keys_serves_the_pinned_run_and_releases_it",
        ),
    ),
    Mutation(
        "sglang-host-indices-checked-by-their-first-only",
        "client/sglang/pages.py",
        "rows, firsts[:, None] + torch.arange(page_size)",
        "rows, rows",
        ("tests/test_sglang.py::test_hostile_input_is_a_miss_or_false_and_changes_nothing",),
    ),
    Mutation(
        "sglang-chains-touched-head-first",
        "client/sglang/page_keys.py",
        "            part = list(words[max(0, end - MAX_BATCH) : end][::-1])\n"
        "            out += c.match_batch(part, [self.namespace] * len(part), lock=lock)\n"
        "        return out[::-1]",
        "            part = list(words[max(0, end - MAX_BATCH) : end])\n"
        "            out = c.match_batch(part, [self.namespace] * len(part), lock=lock) + out\n"
        "        return out",
        ("tests/test_sglang.py::test_under_pressure_a_chain_loses_its_tail_first",),
    ),
    Mutation(
        "reaper-leaves-half-written-files",
        "daemon/keep/reaper.py",
        "        if name.startswith(prefix) and name not in spare:",
        '        if name.startswith(prefix) and name not in spare and not name.endswith(".tmp"):',
        ("tests/test_kept.py::test_the_reaper_removes_a_dead_instances_half_written_files",),
    ),
    Mutation(
        "batched-match-never-yields",
        "daemon/requests/cache_ops.py",
        "                or (time.perf_counter() > turn_ends and self.others_waiting())",
        "                or False",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "own-requests-end-the-turn",
        "daemon/transport/inbox.py",
        "            if frames[0] != serving:",
        "            if True:",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "others-request-queued-behind",
        "daemon/transport/inbox.py",
        "                ahead.appendleft((frames, first))",
        "                ahead.append((frames, first))",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "read-ahead-unbounded",
        "daemon/transport/inbox.py",
        "        return len(ahead) >= READ_AHEAD",
        "        return False",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "read-ahead-loses-its-first-part",
        "daemon/transport/inbox.py",
        "            return self._serve(*ahead.popleft())",
        "            return ahead.popleft()[0]",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "long-turn-never-yields",
        "daemon/transport/inbox.py",
        "            yield_cpu()\n            if self.watch",
        "            pass\n            if self.watch",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "curve-framing-miscounted",
        "daemon/transport/wire_watch.py",
        "CURVE_BYTES = 33",
        "CURVE_BYTES = 32",
        ("tests/test_wire_watch.py",),
    ),
    Mutation(
        "short-frame-header-edge",
        "daemon/transport/wire_watch.py",
        "    return size + (2 if size <= 255 else 9)",
        "    return size + (2 if size < 255 else 9)",
        ("tests/test_wire_watch.py",),
    ),
    Mutation(
        "no-bound-for-all-connections",
        "daemon/transport/wire_watch.py",
        "            if held[fd] <= self.per_connection and total <= self.in_all:",
        "            if held[fd] <= self.per_connection:",
        ("tests/test_wire_watch.py",),
    ),
    Mutation(
        "smallest-connection-closed-first",
        "daemon/transport/wire_watch.py",
        "key=held.__getitem__, reverse=True)",
        "key=held.__getitem__)",
        ("tests/test_wire_watch.py",),
    ),
    Mutation(
        "connections-unbounded",
        "daemon/transport/wire_watch.py",
        "        if len(self._connections) >= self.max_connections:",
        "        if False:",
        ("tests/test_wire_watch.py",),
    ),
    Mutation(
        "unwatchable-connection-kept",
        "daemon/transport/wire_watch.py",
        '                self._reset_unwatched(fd, port, "no descriptor left to watch it")',
        "                pass",
        ("tests/test_wire_watch.py",),
    ),
    Mutation(
        "checks-whatever-they-cost",
        "daemon/transport/wire_watch.py",
        "max(CHECK_EVERY_S, spent / CHECK_SHARE)",
        "CHECK_EVERY_S",
        ("tests/test_wire_watch.py",),
    ),
    Mutation(
        "event-asks-any-size",
        "daemon/observe/events.py",
        "                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_ASK_BYTES)\n",
        "",
        ("tests/test_wire_watch.py",),
    ),
    Mutation(
        "long-turn-yields-every-ask",
        "daemon/transport/inbox.py",
        "            self._yield_after = now + YIELD_EVERY_S",
        "            self._yield_after = now",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "read-ahead-replaces-the-served-first-part",
        "daemon/transport/inbox.py",
        "            frames, first = self._read()\n            if frames[0] == self.wake_id:",
        "            frames, first = self._read()\n            self._first = first\n"
        "            if frames[0] == self.wake_id:",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "read-ahead-ahead-of-the-socket",
        "daemon/transport/inbox.py",
        "            if ahead[0][0][0] == self.serving and queued(self.sock):",
        "            if False:",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "a-reused-pid-is-the-same-process",
        "daemon/transport/inbox.py",
        '    return f"{pid}@{start}"',
        '    return f"{pid}"',
        ("tests/test_sessions.py",),
    ),
    Mutation(
        "served-request-keeps-a-resumed-sender",
        "daemon/server.py",
        "        peer = self.inbox.serving = bytes(identity)",
        "        peer = bytes(identity)",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "process-sessions-unbounded",
        "daemon/sessions/table.py",
        '            (process, self._per_process, f"this process (pid {process_pid(process)})"),',
        '            ("", self._per_process, "this process"),',
        ("tests/test_sessions.py",),
    ),
    Mutation(
        "process-taken-from-the-hello",
        "daemon/transport/inbox.py",
        "        pid = peer_pid(address)",
        "        pid = 0",
        ("tests/test_sessions.py",),
    ),
    Mutation(
        "ended-session-keeps-its-process-place",
        "daemon/sessions/table.py",
        "            (self._per_process, session.process),\n",
        "",
        ("tests/test_sessions.py",),
    ),
    Mutation(
        "match-part-shared-head-dropped",
        "client/client.py",
        "part = arrays[start][: shared[start]].tobytes() + frame[pos:]",
        "part = frame[pos:]",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "match-batch-keeps-locks-of-a-failed-batch",
        "client/client.py",
        "                self.release(*[m for m in matches if m.lock_id])",
        "                pass",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "views-never-refused",
        "daemon/requests/view_budget.py",
        "        if over > 0:",
        "        if False:",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "views-of-admins-refused-too",
        "daemon/requests/handlers.py",
        "        if session is not None and session.admin:\n            return run()",
        "        if False:\n            return run()",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "sessions-per-client-key-unbounded",
        "daemon/sessions/table.py",
        "            (user, self._per_user, key_or_uid),",
        '            ("", self._per_user, key_or_uid),',
        (
            "tests/test_sessions.py::"
            "test_one_client_key_cannot_take_every_session_over_many_connections",
        ),
    ),
    Mutation(
        "third-tier-wake-counts-as-a-request",
        "daemon/transport/inbox.py",
        "            if frames[0] == self.wake_id:\n"
        "                self.woken = True  # (answered after this request)\n"
        "                continue\n",
        "",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "match-batch-mixes-two-sessions",
        "client/client.py",
        "if matches and got and got[0].generation != matches[0].generation:",
        "if False:",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "token-batch-block-head-dropped",
        "hicache/protocol/frames.py",
        "            head = prev[: 4 * shared[i]]",
        '            head = b""',
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "housekeeping-estimates-while-others-wait",
        "daemon/server.py",
        "        self.handlers.housekeep(estimate=not waiting)",
        "        self.handlers.housekeep()",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "housekeeping-trims-while-others-wait",
        "daemon/server.py",
        "            self._optional_ran = now\n            self._trim.maybe()",
        "            self._optional_ran = now\n        if True:\n            self._trim.maybe()",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "housekeeping-optional-parts-deferred-forever",
        "daemon/server.py",
        "now < self._optional_ran + DEFER_AT_MOST_S and self.inbox.others_waiting(False)",
        "self.inbox.others_waiting(False)",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "housekeeping-gives-the-core-away",
        "daemon/server.py",
        "and self.inbox.others_waiting(False)",
        "and self.inbox.others_waiting()",
        ("tests/test_fair_turns.py",),
    ),
    Mutation(
        "local-users-not-told-apart-without-keys",
        "daemon/server.py",
        "            user = inbox.local_user\n",
        "            user = str\n",
        ("tests/test_trust.py",),
    ),
    Mutation(
        "one-local-user-keeps-every-connection",
        "daemon/transport/wire_watch.py",
        "        elif counted is not None and self._per_uid[counted] >= self.max_per_user:",
        "        elif False:",
        ("tests/test_wire_watch.py",),
    ),
    Mutation(
        "a-closed-connection-keeps-its-users-place",
        "daemon/transport/wire_watch.py",
        "            self._per_uid[conn.counted] -= 1\n",
        "            pass\n",
        ("tests/test_wire_watch.py",),
    ),
    Mutation(
        "the-daemons-own-user-held-to-a-share-of-sessions",
        "daemon/transport/inbox.py",
        '        return "" if uid in self.watch.trusted else f"{LOCAL_USER}{uid}"',
        '        return f"{LOCAL_USER}{uid}"',
        ("tests/test_trust.py",),
    ),
    Mutation(
        "the-daemons-own-user-held-to-a-share-of-connections",
        "daemon/transport/wire_watch.py",
        "        counted = None if uid in self.trusted else uid",
        "        counted = uid",
        ("tests/test_wire_watch.py",),
    ),
    Mutation(
        "a-closed-sockets-owner-read-as-root",
        "hicache/local_tcp.py",
        "    if state == _TIME_WAIT or inode == 0:",
        "    if False:",
        ("tests/test_trust.py",),
    ),
    Mutation(
        "a-reused-descriptor-keeps-its-old-user",
        "daemon/transport/wire_watch.py",
        "        return conn.uid if same else None",
        "        return conn.uid",
        ("tests/test_wire_watch.py",),
    ),
    Mutation(
        "a-crash-holds-its-device-pool-with-a-kept-one",
        "daemon/keep/reaper.py",
        "    _remove_leftovers(directory, instance, spare)\n",
        "",
        ("tests/test_kept.py", "-k", "at_once_what_cannot"),
    ),
    Mutation(
        "a-marker-without-its-snapshot-keeps-the-pool",
        "hicache/memory/kept.py",
        "    try:\n        st = os.lstat(marker.snapshot)",
        "    return True\n    try:\n        st = os.lstat(marker.snapshot)",
        ("tests/test_kept.py", "-k", "snapshot"),
    ),
    Mutation(
        "a-chain-lookup-without-a-prefix-takes-one-page-keys",
        "client/sglang/backend.py",
        "        return [] if keys is None else keys",
        "        return keys",
        ("tests/test_sglang_chains.py", "-k", "prompts_start"),
    ),
    Mutation(
        "a-release-after-a-lapse-not-waited-for",
        "client/client.py",
        "        if ids and (wait or not self._link.lease_holds()):",
        "        if ids and wait:",
        ("tests/test_store_calls.py", "-k", "lapse"),
    ),
    Mutation(
        "a-batch-of-inserts-takes-another-sessions-pages",
        "daemon/requests/cache_ops.py",
        "        if not session.owns_all(mine.tolist()) or not (kinds[kinds != _OWNED] == _TREE)"
        ".all():",
        "        if False:",
        ("tests/test_store_calls.py", "-k", "fails_where"),
    ),
    Mutation(
        "a-store-match-allocates-under-a-lock",
        "hicache/protocol/messages.py",
        "        if rest and lock:",
        "        if False:",
        ("tests/test_store_calls.py", "-k", "holds_nothing"),
    ),
    Mutation(
        "any-admin-token-accepted",
        "daemon/requests/handlers.py",
        "                or not hmac.compare_digest(\n"
        '                    token.encode("utf-8", "surrogatepass"), self.admin_token.encode()\n'
        "                )\n",
        "",
        ("tests/test_auth.py", "-k", "any_token"),
    ),
    Mutation(
        "an-engine-killed-waits-out-its-lease",
        "daemon/requests/handlers.py",
        "            if now - self._processes_seen >= PROCESS_CHECK_S:",
        "            if False:",
        ("tests/test_daemon.py", "-k", "noticed"),
    ),
    Mutation(
        "a-reused-pid-keeps-a-session-alive",
        "daemon/transport/inbox.py",
        '        return fields[0] not in (b"Z", b"X") and fields[19].decode() == start',
        '        return fields[0] not in (b"Z", b"X")',
        ("tests/test_sessions.py", "-k", "ended_go_to"),
    ),
    Mutation(
        "a-zombie-engine-keeps-its-session",
        "daemon/transport/inbox.py",
        '        return fields[0] not in (b"Z", b"X") and fields[19].decode() == start\n',
        "        return fields[19].decode() == start\n",
        ("tests/test_sessions.py", "-k", "not_waited_for"),
    ),
    Mutation(
        "sglang-pool-made-in-the-first-request",
        "client/sglang/backend.py",
        "        warm.join(WARM_WAIT_S)\n",
        "",
        ("tests/test_sglang.py", "-k", "mapped_while"),
    ),
    Mutation(
        "start-up-objects-not-frozen",
        "daemon/observe/gc_pauses.py",
        "        gc.freeze()\n",
        "        pass\n",
        ("tests/test_gc_pauses.py", "tests/test_metrics.py"),
    ),
    Mutation(
        "frozen-objects-kept-at-stop",
        "daemon/observe/gc_pauses.py",
        "            gc.unfreeze()\n",
        "            pass\n",
        ("tests/test_gc_pauses.py",),
    ),
    Mutation(
        "storage-events-miss-what-the-disk-let-go",
        "hicache/l3/worker.py",
        "        if gone and self.storage is not None:\n",
        "        if False:\n",
        (
            "tests/test_kv_events.py::test_the_disk_is_announced_on_storage_as_it_keeps_and_evicts_pages",
        ),
    ),
    Mutation(
        "storage-events-name-the-parents-hash-for-a-page",
        "hicache/observe/storage_events.py",
        "    return Held(names, [chain[c] for c in pages],",
        "    return Held(names, [chain[max(c - 1, 0)] for c in pages],",
        ("tests/test_disk_stateful.py",),
    ),
    Mutation(
        "storage-events-keep-pages-at-a-flush",
        "hicache/l3/worker.py",
        "            self.storage.append(Forgot())\n",
        "            self.storage.append(Let([]))\n",
        ("tests/test_disk_stateful.py",),
    ),
    Mutation(
        "storage-events-remove-a-page-let-go-and-held-again",
        "hicache/observe/storage_events.py",
        "                del gone[h]\n",
        "                pass\n",
        ("tests/test_storage_events.py",),
    ),
    Mutation(
        "storage-events-skip-pages-read-back-from-the-disk",
        "hicache/l3/worker.py",
        "        self._held(job, names, list(range(job.arrived)))\n",
        "",
        ("tests/test_disk_stateful.py",),
    ),
    Mutation(
        "disk-evict-rounds-its-tokens-down",
        "daemon/requests/admin_ops.py",
        "evict=-(-req.disk_tokens // page_size))",
        "evict=req.disk_tokens // page_size)",
        (
            "tests/test_l3_daemons.py::test_evicting_part_of_the_disk_takes_its_least_recently_used_tails",
        ),
    ),
    Mutation(
        "disk-evict-forgets-everything",
        "hicache/l3/worker.py",
        "            job.cleared = self.store.evict(job.evict)",
        "            job.cleared = self.store.clear()",
        (
            "tests/test_l3_daemons.py::test_evicting_part_of_the_disk_takes_its_least_recently_used_tails",
        ),
    ),
    Mutation(
        "tree-never-shows-the-stored-tier",
        "hicache/observe/tree_view.py",
        '        + ("S" if node.l3 is True else "")',
        '        + ""',
        (
            "tests/test_l3_daemons.py::test_evicting_part_of_the_disk_takes_its_least_recently_used_tails",
        ),
    ),
    Mutation(
        "a-write-reads-pages-a-backup-still-copies-into",
        "hicache/l3/sides.py",
        "        return node.host_pages is not None and node.io is not IO_BACKUP\n",
        "        return node.host_pages is not None\n",
        ("tests/test_l3_tier.py", "-k", "backup_still_copies"),
    ),
    Mutation(
        "a-stop-writes-before-its-backups-land",
        "hicache/cache.py",
        "                self.book.settle()  # copied, never pages a copy still fills)\n",
        "                pass\n",
        ("tests/test_l3_tier.py", "-k", "backup_still_copies"),
    ),
    Mutation(
        "a-failed-disk-flush-keeps-the-floors-it-raised",
        "hicache/disk/store.py",
        "                    write_floor(path, before)\n",
        "                    pass  # (not journaled)\n",
        ("tests/test_disk_store.py", "-k", "fails_on_one_drive"),
    ),
    Mutation(
        "an-operators-failed-flush-opens-the-breaker",
        "hicache/l3/worker.py",
        "                if not isinstance(job, Clear):  # (an operator's retries never open it)\n",
        "                if True:\n",
        ("tests/test_l3_tier.py", "-k", "never_opens_the_breaker"),
    ),
    Mutation(
        "capacity-recommends-on-cold-misses",
        "daemon/requests/capacity_feed.py",
        "warm = est.accesses >= host > 0",
        "warm = est.accesses > 0",
        (
            "tests/test_capacity_daemon.py::"
            "test_no_recommendation_before_the_traffic_could_fill_the_host_pool",
        ),
    ),
    Mutation(
        "top-has-no-disk-line",
        "client/top.py",
        '    if l3 and "store_disk_capacity_bytes" in l3:\n',
        "    if False:\n",
        ("tests/test_disk_store.py::test_the_disks_figures_reach_info_top_and_metrics",),
    ),
    Mutation(
        "demo-takes-any-loads-as-the-engine-s",
        "scripts/demo.py",
        'if r.stats.get("load_tokens", 0) != r.loaded:',
        "if False:",
        ("tests/test_demo.py::test_a_run_whose_daemon_counts_other_loads_than_the_engine_fails",),
    ),
    Mutation(
        "the-journal-forgets-uses",
        "hicache/disk/store.py",
        '            self._log.add(("t", list(keys)))\n',
        "            pass\n",
        (
            "tests/test_disk_store.py::test_a_crash_finds_the_index_again_from_the_journal_without_a_scan",
        ),
    ),
    Mutation(
        "the-journal-forgets-evictions",
        "hicache/disk/store.py",
        '            self._log.add(("d", key))\n',
        "",
        (
            "tests/test_disk_store.py::test_a_crash_finds_the_index_again_from_the_journal_without_a_scan",
        ),
    ),
    Mutation(
        "the-journal-forgets-writes",
        "hicache/disk/store.py",
        '                self._log.add(("w", slot, header.seq, header.key, header.parent))\n',
        "                pass  # (not journaled)\n",
        (
            "tests/test_disk_store.py::"
            "test_a_sigkill_mid_write_loses_nothing_written_and_serves_nothing_torn",
        ),
    ),
    Mutation(
        "a-journal-after-another-checkpoint-is-replayed",
        "hicache/disk/journal.py",
        '    if head != {"magic": MAGIC, "checkpoint": token}:\n',
        '    if not isinstance(head, dict) or head.get("magic") != MAGIC:\n',
        (
            "tests/test_disk_store.py::test_a_crash_finds_the_index_again_from_the_journal_without_a_scan",
        ),
    ),
    Mutation(
        "the-disk-journal-grows-past-its-bound",
        "hicache/disk/index_log.py",
        "        if self._journal.bytes + len(data) >= journal.bound(self.checkpoint_bytes):",
        "        if False:",
        ("tests/test_disk_store.py", "-k", "stays_under_its_bound"),
    ),
    Mutation(
        "a-disk-journal-that-failed-stays-to-be-replayed",
        "hicache/disk/index_log.py",
        "            os.unlink(os.path.join(self.folder, journal.NAME))\n            return\n",
        "            return\n",
        ("tests/test_disk_store.py", "-k", "stays_under_its_bound"),
    ),
    Mutation(
        "replay-takes-a-slot-for-the-key-last-written-there",
        "hicache/disk/store.py",
        "                    or (holder is not None and self._index.get(holder) == slot)\n",
        "                    or holder in self._index\n",
        ("tests/test_disk_store.py", "-k", "every_prefix_of_a_journal"),
    ),
    Mutation(
        "replay-takes-a-write-whose-parent-is-not-held",
        "hicache/disk/store.py",
        "                    or (parent is not None and parent not in self._index)\n",
        "",
        ("tests/test_disk_store.py", "-k", "damaged_or_planted"),
    ),
    Mutation(
        "a-replayed-write-is-no-use-of-its-prefix",
        "hicache/disk/store.py",
        '            if record[0] != "w" and run:\n                self._touch(run)\n',
        "            if False:\n                self._touch(run)\n",
        ("tests/test_disk_store.py", "-k", "crash_finds_the_index"),
    ),
    Mutation(
        "a-journal-of-any-length-is-read",
        "hicache/disk/journal.py",
        "    data = read_file(path, bound(checkpoint_bytes) - 1)\n",
        "    data = read_file(path, 1 << 62)\n",
        ("tests/test_disk_store.py", "-k", "damaged_or_planted"),
    ),
    Mutation(
        "a-journal-record-of-any-sequence-is-taken",
        "hicache/disk/journal.py",
        "        if not (ints and 0 <= slot < slots and 0 < seq <= MAX_SEQ):\n",
        "        if not (ints and 0 <= slot < slots and 0 < seq):\n",
        ("tests/test_disk_store.py", "-k", "damaged_or_planted"),
    ),
    Mutation(
        "a-journal-nested-past-the-parser-stops-the-disk",
        "hicache/disk/journal.py",
        "        except (ValueError, TypeError, UnicodeDecodeError, RecursionError):\n",
        "        except (ValueError, TypeError, UnicodeDecodeError):\n",
        ("tests/test_disk_store.py", "-k", "damaged_or_planted"),
    ),
    Mutation(
        "a-checkpoint-nested-past-the-parser-stops-the-disk",
        "hicache/disk/checkpoint.py",
        "    except (ValueError, TypeError, RecursionError) as exc:\n",
        "    except (ValueError, TypeError) as exc:\n",
        ("tests/test_disk_store.py", "-k", "damaged_or_planted"),
    ),
    Mutation(
        "a-checkpoint-is-not-trusted-with-the-journal-it-replaced",
        "hicache/disk/recovery.py",
        "        if records is None and replaces and journal.follows(folders[0].path) == replaces:",
        "        if False:",
        ("tests/test_disk_store.py", "-k", "between_a_checkpoint"),
    ),
    Mutation(
        "a-checkpoint-stands-in-for-any-journal",
        "hicache/disk/recovery.py",
        "        if records is None and replaces and journal.follows(folders[0].path) == replaces:",
        "        if records is None:",
        ("tests/test_disk_store.py", "-k", "crash_finds_the_index"),
    ),
    Mutation(
        "a-scanned-header-of-any-sequence-is-taken",
        "hicache/disk/recovery.py",
        "        if header is not None and header.seq > MAX_SEQ:\n",
        "        if False:\n",
        ("tests/test_disk_store.py", "-k", "sequence_past_any"),
    ),
    Mutation(
        "a-journal-that-cannot-be-removed-keeps-its-checkpoint",
        "hicache/disk/index_log.py",
        "            os.unlink(os.path.join(self.folder, checkpoint.NAME))\n",
        "            pass\n",
        ("tests/test_disk_store.py", "-k", "cannot_be_removed"),
    ),
    Mutation(
        "replay-uses-each-write-alone",
        "hicache/disk/store.py",
        "                run.append(key)\n",
        "                self._touch([key])\n",
        ("tests/test_disk_store.py", "-k", "long_chain_replays"),
    ),
    Mutation(
        "latency-bench-evicts-only-the-prompts-length",
        "scripts/disk_latency.py",
        "            hc.evict(host_tokens=ALL)\n",
        "            hc.evict(host_tokens=len(tokens))\n",
        ("tests/test_disk_latency.py",),
    ),
    Mutation(
        "huge-pages-counted-of-every-mapping",
        "hicache/memory/huge_pages.py",
        "                    inside = start < end and address < stop\n",
        "                    inside = True\n",
        ("tests/test_huge_pages.py", "-k", "only_the_mappings"),
    ),
    Mutation(
        "a-disk-daemon-never-says-whether-its-pool-has-huge-pages",
        "daemon/server.py",
        '        if l3 is None or not (l3.url.startswith("disk://") or "disk" in l3.options):\n',
        "        if True:\n",
        ("tests/test_huge_pages.py", "-k", "says_at_start"),
    ),
    Mutation(
        "an-engine-daemons-pool-huge-pages-named-device",
        "daemon/server.py",
        '                names.key(f"{tier}_huge_page_bytes"): pool.huge_page_bytes()\n',
        '                f"{tier}_huge_page_bytes": pool.huge_page_bytes()\n',
        ("tests/test_huge_pages.py", "-k", "engines_names"),
    ),
    Mutation(
        "adaptive-writes-at-first-sight-below-half",
        "hicache/l3/admission.py",
        "            and self.came_back >= FIRST_SIGHT_RATE * self.judged()",
        "            and self.came_back >= 0",
        ("tests/test_l3_admission.py", "-k", "half"),
    ),
    Mutation(
        "adaptive-ignores-pages-read-back-from-the-store",
        "hicache/l3/tier.py",
        "                if self.admission.seen:  # (pages that left unreused may be back now)",
        "                if False:",
        ("tests/test_l3_tier.py", "-k", "first_sight_while"),
    ),
    Mutation(
        "adaptive-counts-reused-pages-as-let-go",
        "hicache/l3/tier.py",
        "        unreused = node.hit_count < self.config.write_threshold",
        "        unreused = True",
        ("tests/test_l3_tier.py", "-k", "stays_selective"),
    ),
    Mutation(
        "a-page-counts-as-let-go-each-time-it-leaves",
        "hicache/l3/admission.py",
        "            if name in seen:  # (left before: counted then, once)",
        "            if False:",
        ("tests/test_l3_admission.py", "-k", "earns"),
    ),
    Mutation(
        "the-disks-default-admission-is-strict",
        "daemon/config/l3.py",
        '    "reused": {"write_policy": "write_through_adaptive", "write_threshold": 2},',
        '    "reused": {"write_policy": "write_through_selective", "write_threshold": 2},',
        ("tests/test_disk_store.py", "-k", "admission_is_the_tiers"),
    ),
    Mutation(
        "a-read-at-once-reads-every-page-it-set-aside",
        "hicache/l3/worker.py",
        "        pages = job.pages[: job.hits].tolist()",
        "        pages = job.pages.tolist()",
        ("tests/test_disk_store.py", "-k", "one_turn"),
    ),
    Mutation(
        "a-fetch-at-once-takes-pages-free-or-not",
        "hicache/l3/tier.py",
        "            if self.side.alloc.free_pages >= 2 * want + aside:",
        "            if True:",
        ("tests/test_disk_store.py", "-k", "one_turn"),
    ),
    Mutation(
        "adaptive-judges-pages-too-recent-to-be-back",
        "hicache/l3/admission.py",
        "        return max(self.let_go - min(wait, self.let_go / 2), self.came_back)",
        "        return max(self.let_go, self.came_back)",
        ("tests/test_l3_admission.py", "-k", "too_recent"),
    ),
    Mutation(
        "a-page-hit-before-its-backup-never-counts-as-back",
        "hicache/l3/tier.py",
        "                back = bool(admission.seen) and admission.back(",
        "                back = node.hit_count < self.config.write_threshold and admission.back(",
        ("tests/test_l3_tier.py", "-k", "hit_before_its_backup"),
    ),
    Mutation(
        "a-failed-one-turn-read-forgets-the-disks-hits",
        "hicache/l3/tier.py",
        '        if fetch.stage in ("exists", "read"):  # (the store said it',
        '        if not fetch.error and fetch.stage in ("exists", "read"):  # (the store said it',
        ("tests/test_disk_store.py", "-k", "one_turn"),
    ),
    Mutation(
        "the-read-rate-counts-the-asking",
        "hicache/l3/tier.py",
        "        read_s = fetch.io_s - fetch.ask_s",
        "        read_s = fetch.io_s",
        ("tests/test_disk_store.py", "-k", "one_turn"),
    ),
    Mutation(
        "lookups-in-flight-set-aside-all-free-pages",
        "hicache/l3/tier.py",
        "            if self.side.alloc.free_pages >= 2 * want + aside:",
        "            if self.side.alloc.free_pages >= 2 * want:",
        ("tests/test_disk_store.py", "-k", "one_turn"),
    ),
    Mutation(
        "a-fetchs-pages-taken-as-owned-by-no-session",
        "daemon/requests/integrity.py",
        '        owned -= cache.l3.owned_by_fetches("device")',
        "        owned -= 0",
        ("tests/test_l3_only_pool.py", "-k", "daemons_check"),
    ),
    Mutation(
        "returns-past-the-recent-count-add-all-their-waits",
        "hicache/l3/admission.py",
        "            self.waited += waited * take / n",
        "            self.waited += waited",
        ("tests/test_l3_admission.py", "-k", "in_proportion"),
    ),
]


def installed_copy(dest: Path) -> None:
    """The repository as installed: hicache/ with daemon/, client/, kernels/ inside, the built
    C helpers, tests/, scripts/ and pyproject.toml beside it."""
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    built = [str(p.relative_to(ROOT)) for p in (ROOT / "hicache").glob("_*.so")]
    for rel in files + built:
        top, _, rest = rel.partition("/")
        if top in ("daemon", "client", "kernels"):
            target = dest / "hicache" / top / rest
        elif top in ("hicache", "tests", "scripts") or rel == "pyproject.toml":
            target = dest / rel
        else:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)


def _count(path: Path, text: str) -> int:
    """How often ``text`` stands in ``path`` (0: no such file, the rule moved)."""
    return path.read_text().count(text) if path.exists() else 0


def installed_path(path: str) -> str:
    top, _, rest = path.partition("/")
    return f"hicache/{top}/{rest}" if top in ("daemon", "client", "kernels") else path


def run(mutation: Mutation | None, tests: tuple[str, ...], base: Path) -> tuple[bool, float, str]:
    """Run ``tests`` in a fresh copy of ``base`` with ``mutation`` applied (None: as it is);
    (whether they failed, seconds, the last output line)."""
    work = Path(tempfile.mkdtemp(prefix="hicache-mutant-"))
    try:
        shutil.copytree(base, work, dirs_exist_ok=True)
        if mutation is not None:
            target = work / installed_path(mutation.path)
            source = target.read_text()
            if source.count(mutation.old) != 1:
                raise SystemExit(f"{mutation.name}: the text to replace is not in "
                                 f"{mutation.path} exactly once (the rule moved: update this "
                                 "mutation)")  # fmt: skip
            target.write_text(source.replace(mutation.old, mutation.new))
        started = time.monotonic()
        done = subprocess.run(
            # (--basetemp in the copy: a failing test's folders go with it, not to /tmp)
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
             f"--basetemp={work / 'pt'}", *tests],
            cwd=work, capture_output=True, text=True, timeout=1800,
            # the copy first for every process the tests start, wherever it runs (the reaper
            # runs in / with -P, out of reach of the working folder)
            env={**os.environ, "PYTHONPATH": str(work)},
        )  # fmt: skip
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        return done.returncode != 0, time.monotonic() - started, (lines or [""])[-1]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    args = sys.argv[1:]
    control = "--no-control" not in args  # (CI: the whole suite just passed on this tree)
    jobs = 1
    if "--jobs" in args:
        at = args.index("--jobs")
        jobs = max(1, int(args[at + 1]))
        del args[at : at + 2]
    words = [a for a in args if a != "--no-control"]
    chosen = [m for m in MUTATIONS if not words or any(w in m.name for w in words)]
    base = Path(tempfile.mkdtemp(prefix="hicache-mutations-"))
    results = {}
    try:
        installed_copy(base)
        stale = [m for m in chosen if _count(base / installed_path(m.path), m.old) != 1]
        for m in stale:  # (all of them said before anything runs)
            print(f"{m.name}: the text to replace is not in {m.path} exactly once (the rule "
                  "moved: update this mutation)")  # fmt: skip
        if stale:
            return 2
        for tests in dict.fromkeys(m.tests for m in chosen if control):  # they pass unmutated
            failed, seconds, last = run(None, tests, base)
            if failed:
                print(f"the tests {' '.join(tests)} fail without a mutation: {last}")
                return 2

        def report(name: str, caught: bool, seconds: float, last: str) -> None:
            results[name] = caught
            verdict = "caught  " if caught else "SURVIVED"
            print(f"{verdict} {name:38} {seconds:6.1f} s  {last[:70]}", flush=True)

        alone = [m for m in chosen if ALONE.intersection(m.tests)]
        with ThreadPoolExecutor(jobs) as pool:  # (each run copies the tree: none share files)
            runs = {pool.submit(run, m, m.tests, base): m for m in chosen if m not in alone}
            for done in as_completed(runs):
                report(runs[done].name, *done.result())
        for m in alone:
            report(m.name, *run(m, m.tests, base))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    survived = [name for name, caught in results.items() if not caught]
    print(json.dumps({"mutations": len(results), "caught": len(results) - len(survived),
                      "survived": survived}))  # fmt: skip
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
