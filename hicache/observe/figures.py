"""The daemon's figures, named once: each one's key in the STATS reply, its kind, unit and
help, the ``hicache info`` section that shows it and the Prometheus family it is exported as.

The STATS reply (``daemon/requests/handlers.py``) reports exactly these scalar figures, beside a few
structures listed in ``STRUCTURES``; ``/metrics`` (``daemon/observe/metrics.py``), ``hicache info``
(``client/info_view.py``) and ``hicache top`` read them through this table, so a figure is
named, described and placed in one edit. Pure data; read only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["counter", "gauge", "info"]  # counters only grow; info: a fact, not a number


@dataclass(frozen=True)
class Figure:
    name: str  # its key in the STATS reply (and in ``hicache stats --json``)
    kind: Kind
    unit: str  # tokens, bytes, seconds, objects ... ("": a count of events, or a fact)
    help: str  # one line: what it counts
    section: str = ""  # the ``hicache info`` section that shows it ("": only ``hicache stats``)
    metric: str = ""  # its Prometheus family, without the ``hicache_`` prefix ("": none)
    tier: str = ""  # the family's ``tier`` label value (a family with a figure per tier)
    always: bool = True  # exported as 0 when the reply lacks it (else only when there)


def _pool(tier: str) -> tuple[Figure, ...]:
    """The figures of one of the cache's pools (a daemon for engines has only a host one)."""
    section = f"{tier}_pool"
    return (
        Figure(f"{tier}_capacity_tokens", "gauge", "tokens", f"tokens the {tier} tier holds",
               "memory", "capacity_tokens", tier),
        Figure(f"{tier}_free_tokens", "gauge", "tokens", f"free tokens of the {tier} tier",
               section),
        Figure(f"{tier}_cached_tokens", "gauge", "tokens", f"tokens the tree holds on the "
               f"{tier} tier", section, "cached_tokens", tier),
        Figure(f"{tier}_owned_tokens", "gauge", "tokens", f"{tier} tokens sessions allocated "
               "and have not inserted", section),
        Figure(f"{tier}_protected_tokens", "gauge", "tokens", f"cached {tier} tokens under a "
               "lock", section, "protected_tokens", tier, always=False),
        Figure(f"{tier}_evictable_tokens", "gauge", "tokens", f"cached {tier} tokens with no "
               "lock", section, "evictable_tokens", tier, always=False),
        Figure(f"evicted_{tier}_tokens", "counter", "tokens", f"tokens evicted from the {tier} "
               "tier", section, "evicted_tokens", tier),
        Figure(f"{tier}_huge_page_bytes", "gauge", "bytes", f"bytes of the {tier} pool on huge "
               "pages (the disk tier's direct I/O moves one piece per huge page, not per 4 KiB)",
               section, "huge_page_bytes", tier, always=False),
    )  # fmt: skip


FIGURES: tuple[Figure, ...] = (
    # ---- server
    Figure("version", "info", "", "hicache's version", "server"),
    Figure("protocol", "info", "", "the wire protocol's version", "server"),
    Figure("pid", "info", "", "the daemon's process id", "server"),
    Figure("endpoint", "info", "", "where the daemon listens", "server"),
    Figure("boot_epoch", "info", "", "this daemon life's id: requests of another are refused",
           "server"),
    Figure("uptime_s", "gauge", "seconds", "time served since start", "server"),
    Figure("gc_frozen_objects", "gauge", "objects", "objects start-up made, kept out of the "
           "cycle collector's sight", "server", "gc_frozen_objects"),
    Figure("gc_collections", "counter", "", "runs of Python's cycle collector in the daemon",
           "server", "gc_collections"),
    Figure("gc_pause_seconds", "counter", "seconds", "seconds in Python's cycle collector (the "
           "control loop waits meanwhile)", "server", "gc_pause_seconds"),
    Figure("gc_pause_seconds_max", "gauge", "seconds", "the longest run of Python's cycle "
           "collector since start", "server", "gc_pause_seconds_max"),
    # ---- memory and the pools
    Figure("page_size", "info", "tokens", "tokens per page", "memory"),
    Figure("device_tier", "info", "", "who owns the device tier: the daemon, or the engines",
           "memory"),
    Figure("token_bytes", "info", "bytes", "KV bytes of one token in the pool"),
    *_pool("device"),
    *_pool("host"),
    Figure("tree_nodes", "gauge", "", "nodes of the radix tree"),
    # ---- hits
    Figure("hit_device_tokens", "counter", "tokens", "prompt tokens found on the device tier",
           "hits", "hit_tokens", "device"),
    Figure("hit_host_tokens", "counter", "tokens", "prompt tokens found on the host tier",
           "hits", "hit_tokens", "host"),
    Figure("miss_tokens", "counter", "tokens", "prompt tokens not found", "hits"),
    Figure("match_calls", "counter", "", "prompts matched"),
    Figure("insert_calls", "counter", "", "sequences inserted"),
    Figure("load_back_calls", "counter", "", "loads from the host tier to the device tier"),
    # ---- engines (as engines with a prefix cache of their own count)
    Figure("engine_queried_tokens", "counter", "tokens", "tokens engines asked about beyond "
           "their own prefix cache's hit, as they count them", "engines",
           "engine_queried_tokens"),
    Figure("engine_hit_tokens", "counter", "tokens", "of the engines' queried tokens, those "
           "hicache had, as the engines count them", "engines", "engine_hit_tokens"),
    Figure("engine_loaded_tokens", "counter", "tokens", "tokens engines copied from the "
           "daemon's pool into their own device tier", "engines", "engine_loaded_tokens"),
    # ---- transfers
    Figure("backup_tokens", "counter", "tokens", "tokens copied from the device to the host "
           "tier", "transfers", "backup_tokens"),
    Figure("backup_bytes", "counter", "bytes", "bytes copied from the device to the host tier",
           "transfers", "backup_bytes"),
    Figure("load_tokens", "counter", "tokens", "tokens loaded from the host to the device tier",
           "transfers", "load_tokens"),
    Figure("load_bytes", "counter", "bytes", "bytes loaded from the host to the device tier",
           "transfers", "load_bytes"),
    Figure("inflight_transfers", "gauge", "", "copies between tiers running", "transfers",
           "transfers_in_flight"),
    Figure("backup_failed_tokens", "counter", "tokens", "tokens whose backup failed or found "
           "no room", "transfers", "backup_failed_tokens"),
    Figure("transfer_errors", "counter", "", "copies between the tiers that failed",
           "transfers", "transfer_errors"),
    Figure("corrupt_host_tokens", "counter", "tokens", "host tokens whose checksum failed "
           "(--verify-pages): dropped, never served"),
    # ---- sessions and the transport
    Figure("sessions", "gauge", "", "engine sessions", "sessions", "sessions"),
    Figure("sessions_quarantined", "gauge", "", "lapsed sessions whose pages and locks are "
           "held until their quarantine ends", "sessions"),
    Figure("quarantined_tokens", "gauge", "tokens", "device tokens quarantined sessions hold",
           "sessions"),
    Figure("replies_dropped", "counter", "", "replies dropped because a peer did not read",
           "sessions", "replies_dropped"),
    Figure("connections_closed", "counter", "", "tcp connections closed: they sent more than "
           "may be held unread", "sessions", "connections_closed"),
    Figure("match_parts", "counter", "", "batched matches answered in part because other "
           "requests waited", "sessions", "match_parts"),
    Figure("views_refused", "counter", "", "integrity checks and tree views refused: past "
           "their share of the control loop", "sessions", "views_refused"),
    Figure("leases_expired", "counter", "", "engine sessions whose lease ran out",
           metric="leases_expired"),
    Figure("housekeep_errors", "counter", "", "exceptions caught in housekeeping (each one is "
           "a bug)"),
    Figure("busy_poll_watches", "counter", "", "times the loop watched the socket after a "
           "reply"),
    Figure("busy_poll_hits", "counter", "", "of those, times a request came while it watched"),
    Figure("event_batches_published", "counter", "", "KV event batches published",
           metric="event_batches_published"),
    Figure("event_batches_dropped", "counter", "", "KV event batches dropped: publisher behind",
           metric="event_batches_dropped"),
)  # fmt: skip

# the third tier's figures, in the reply's ``l3`` structure (``hicache info``'s l3 section)
L3_FIGURES: tuple[Figure, ...] = (
    Figure("read_bytes", "counter", "bytes", "bytes read from the third tier and verified",
           "l3", "l3_read_bytes"),
    Figure("written_bytes", "counter", "bytes", "bytes written to the third tier", "l3",
           "l3_written_bytes"),
    Figure("lookup_pages", "counter", "pages", "pages asked of the third tier", "l3",
           "l3_lookup_pages"),
    Figure("hit_pages", "counter", "pages", "pages the third tier had", "l3", "l3_hit_pages"),
    Figure("dropped_pages", "counter", "pages", "writes to the third tier dropped: queue full",
           "l3", "l3_dropped_pages"),
    Figure("corrupt_pages", "counter", "pages", "values from the third tier that failed to "
           "verify", "l3", "l3_corrupt_pages"),
    Figure("errors", "counter", "", "third-tier jobs that failed as a whole", "l3",
           "l3_errors"),
    Figure("wait_timeouts", "counter", "", "matches answered at their bound before their "
           "fetch ended", "l3", "l3_wait_timeouts"),
    Figure("queued_pages", "gauge", "pages", "pages waiting to be written", "l3",
           "l3_queued_pages"),
    Figure("no_prefix_writes", "counter", "", "writes not made because the store had let "
           "their prefix go (a disk): made again with it at their next offer", "l3",
           "l3_no_prefix_writes"),
    Figure("let_go_pages", "counter", "pages", "pages that left the pool above the third tier "
           "without a reuse there (selective and adaptive write policies)", "l3",
           "l3_let_go_pages"),
    Figure("came_back_pages", "counter", "pages", "of those, pages computed again or read "
           "back from the third tier since (adaptive writes every page at first sight while "
           "recently at least half came back)", "l3", "l3_came_back_pages"),
    Figure("first_sight", "gauge", "", "write_through_adaptive writes every page at first "
           "sight now (1) or only pages that earned it (0)", "l3", "l3_first_sight"),
)  # fmt: skip


def _disk(name: str, kind: Kind, unit: str, help_: str, metric: str) -> Figure:
    return Figure(f"store_disk_{name}", kind, unit, help_, "disk", f"disk_{metric}", always=False)


# the disk tier's figures (--disk, or --l3 disk://), in the reply's ``l3`` structure, where the
# store's own figures are ``store_*`` (``hicache info``'s disk section; ``hicache_disk_*``)
DISK_FIGURES: tuple[Figure, ...] = (
    Figure("store_disk_direct_io", "info", "", "the disk is read and written with O_DIRECT "
           "(false: buffered, its file system refused it)", "disk", always=False),
    _disk("slots", "gauge", "pages", "slots of the disk tier (a page each)", "slots"),
    _disk("slot_bytes", "gauge", "bytes", "bytes of one slot (a header block and the padded "
          "page)", "slot_bytes"),
    _disk("capacity_bytes", "gauge", "bytes", "the disk tier's size", "capacity_bytes"),
    _disk("held_bytes", "gauge", "bytes", "bytes the disk tier holds", "held_bytes"),
    _disk("held_values", "gauge", "pages", "pages the disk tier holds", "held_pages"),
    _disk("hits", "counter", "pages", "pages read from the disk", "hit_pages"),
    _disk("misses", "counter", "pages", "pages asked of the disk it lacked or could not read",
          "miss_pages"),
    _disk("read_bytes", "counter", "bytes", "bytes read from the disk", "read_bytes"),
    _disk("written_values", "counter", "pages", "pages written to the disk", "written_pages"),
    _disk("written_bytes", "counter", "bytes", "bytes written to the disk", "written_bytes"),
    _disk("evicted_values", "counter", "pages", "pages evicted from the disk", "evicted_pages"),
    _disk("cleared_values", "counter", "pages", "pages an operator's flush of the disk let go",
          "cleared_pages"),
    _disk("budget_bytes_per_day", "gauge", "bytes", "bytes the disk may write in any 24 hours",
          "budget_bytes"),
    _disk("budget_left_bytes", "gauge", "bytes", "bytes the disk may still write in the last "
          "24 hours' budget", "budget_left_bytes"),
    _disk("budget_refused_writes", "counter", "", "writes refused past the budget",
          "budget_refused_writes"),
    _disk("read_errors", "counter", "", "reads the drive failed (misses)", "read_errors"),
    _disk("write_errors", "counter", "", "writes the drive failed (skipped)", "write_errors"),
    _disk("space_refusals", "counter", "", "writes the drive refused for space (ENOSPC)",
          "space_refusals"),
    _disk("bad_slots", "counter", "", "slots read back that did not hold their page (torn, "
          "overwritten): misses", "bad_slots"),
    _disk("refused_no_prefix", "counter", "pages", "pages not written: their prefix is not "
          "on the disk (a page goes only with its prefix)", "refused_no_prefix_pages"),
    _disk("refused_no_room", "counter", "pages", "pages not written: the disk held only the "
          "write's own prefixes to evict", "refused_no_room_pages"),
    _disk("recovered_values", "gauge", "pages", "pages found on the disk at start",
          "recovered_pages"),
    _disk("scan_seconds", "gauge", "seconds", "time the start's scan of the disk took",
          "scan_seconds"),
    Figure("store_disk_from_checkpoint", "info", "", "the disk's index came from its checkpoint "
           "and journal (false: from a scan of its slots)", "disk", always=False),
    _disk("replayed_records", "gauge", "", "journal records replayed over the checkpoint at "
          "start (changes since the last checkpoint: a crash's)", "replayed_records"),
)  # fmt: skip

# what the reply holds beside the figures: structures each reader renders its own way
STRUCTURES = {
    "config": "the settings in use",
    "layout": "the KV layout engines registered (a daemon for engines; else null)",
    "l3": "the third tier's settings and figures (L3_FIGURES; a disk's: DISK_FIGURES); absent "
    "without one",
    "op_latency": "time to handle a request, per op (histograms)",
    "errors_by_code": "error replies, per error code",
    "transfer_seconds": "submit to ack of a copy, per direction (histograms)",
    "transfer_bytes": "bytes of a copy, per direction (histograms)",
    "capacity_points": "the estimated hit ratios at other tier sizes",
    "session_list": "the sessions (at most 1000), each with its own figures",
    "integrity": "the integrity check's verdict (a STATS request with check=true)",
}

BY_NAME = {f.name: f for f in FIGURES}


def shown(stats: dict[str, Any], section: str) -> dict[str, Any]:
    """The figures of ``section`` that ``stats`` holds, in the table's order."""
    return {f.name: stats[f.name] for f in FIGURES if f.section == section and f.name in stats}
