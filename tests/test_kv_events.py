"""KV events (daemon/observe/events.py) as a router sees them: the stream decoded with vLLM's own
event classes rebuilds what each tier holds, replay returns every batch, a full dump equals the
stream, a flush clears, and a subscriber that does not read never holds the daemon up."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
import zmq

from tests.optional import require_module

kv_events = require_module("vllm.distributed.kv_events", "vllm", "decoding events as vLLM does")
msgspec = require_module("msgspec", "vllm", "decoding events as vLLM does")

from hicache.client import HiCacheClient  # noqa: E402
from hicache.daemon.observe import END_SEQ  # noqa: E402
from tests.daemon_helpers import serve_chats, start_daemon, stop_daemon, wait_until  # noqa: E402
from tests.event_model import TierModel  # noqa: E402

PS = 4  # the page size of tests.daemon_helpers.SMALL
DECODE = msgspec.msgpack.Decoder(kv_events.KVEventBatch)


def events_daemon(tmp_path, *extra: str):  # noqa: ANN201
    ep = f"ipc://{tmp_path}/ev.sock"
    pub, replay = f"ipc://{tmp_path}/pub.sock", f"ipc://{tmp_path}/replay.sock"
    proc = start_daemon(ep, "--events-endpoint", pub, "--events-replay-endpoint", replay, *extra)
    return ep, pub, replay, proc


def ask(replay: str, request: bytes) -> list[tuple[int, bytes]]:
    """(seq, payload) of every batch a replay or dump request returns, up to the end mark."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(replay)
    try:
        sock.send_multipart([b"", request])
        out = []
        while True:
            _, topic, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close()


def rebuild(batches: list[tuple[int, bytes]]) -> TierModel:
    model = TierModel()
    for _, payload in batches:
        for event in DECODE.decode(payload).events:  # vLLM's BlockStored/BlockRemoved/...
            model.apply(event)
    return model


def chain(tokens: list[int]) -> list[int]:
    """The block hashes of a prompt's full pages (as docs/design.md defines them)."""
    h = xxhash.xxh3_64_intdigest(b"hicache-block-v1" + repr(None).encode())
    out = []
    for i in range(0, len(tokens) // PS * PS, PS):
        h = xxhash.xxh3_64_intdigest(np.array(tokens[i : i + PS], "<i4").tobytes(), seed=h)
        out.append(h)
    return out


def held(hashes: list[int], *tiers: dict) -> int:
    """Tokens of the longest prefix whose blocks the tiers hold."""
    n = 0
    while n < len(hashes) and any(hashes[n] in t for t in tiers):
        n += 1
    return n * PS


def test_the_stream_decoded_by_vllm_rebuilds_each_tier_and_a_dump_equals_it(tmp_path):
    ep, pub, replay, proc = events_daemon(tmp_path)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(pub)
    try:
        prompts = serve_chats(ep, 1, 80) + serve_chats(ep, 2, 40)
        with HiCacheClient(ep, name="check") as hc:
            wait_until(lambda: hc.stats()["inflight_transfers"] == 0, what="copies landed")
            stats = hc.stats()
            batches = ask(replay, (0).to_bytes(8, "big"))
            wait_until(  # the last changes are published within a housekeeping period
                lambda: (
                    len(ask(replay, (0).to_bytes(8, "big"))) == stats["event_batches_published"]
                ),
                what="every batch published",
            )
            batches = ask(replay, (0).to_bytes(8, "big"))
            assert [seq for seq, _ in batches] == list(range(len(batches)))  # from 0, no gap
            model = rebuild(batches)
            gpu, cpu = model.blocks.get("GPU", {}), model.blocks.get("CPU", {})
            assert stats["evicted_device_tokens"] > 0 and stats["load_tokens"] > 0
            assert stats["backup_tokens"] > 0
            # the model holds exactly what the tiers hold, and the hits a match finds
            assert len(gpu) * PS == stats["device_cached_tokens"]
            assert len(cpu) * PS == stats["host_cached_tokens"]
            for prompt in prompts[-30:]:
                m = hc.match_prefix(prompt, lock=False)
                hashes = chain(prompt)
                assert m.device_hit_length == held(hashes, gpu)
                assert m.device_hit_length + m.host_hit_length == held(hashes, gpu, cpu)
            for parent, tokens in gpu.values():
                assert len(tokens) == PS and (parent is None or parent in gpu)  # prefix-closed
            # the live stream carried the same batches (those sent after it joined)
            live = []
            while sub.poll(0):
                _, seq, payload = sub.recv_multipart()
                live.append((int.from_bytes(seq, "big"), payload))
            assert live and live == batches[live[0][0] :]
            # a full dump rebuilds the same model, and says where the stream goes on
            dump = ask(replay, b"dump")
            assert {seq for seq, _ in dump} == {len(batches)}
            assert rebuild(dump).normalized() == model.normalized()
    finally:
        sub.close()
        stop_daemon(proc)


def test_a_flush_ends_with_all_blocks_cleared_and_hashes_survive_a_restart(tmp_path):
    ep, pub, replay, proc = events_daemon(tmp_path)
    prompt = list(range(1, 33))
    try:
        serve_chats(ep, 3, 10)
        with HiCacheClient(ep, name="w") as hc:
            hc.insert(prompt, hc.alloc(len(prompt)))
        with HiCacheClient(ep, name="admin", admin=True) as hc:
            wait_until(lambda: hc.stats()["inflight_transfers"] == 0, what="copies landed")
            hc.flush()
            wait_until(
                lambda: (
                    DECODE.decode(ask(replay, (0).to_bytes(8, "big"))[-1][1])
                    .events[-1]
                    .__class__.__name__
                    == "AllBlocksCleared"
                ),
                what="AllBlocksCleared",
            )
        model = rebuild(ask(replay, (0).to_bytes(8, "big")))
        assert model.normalized() == {}
    finally:
        stop_daemon(proc)
    ep, pub, replay, proc = events_daemon(tmp_path)  # a new daemon names blocks the same
    try:
        with HiCacheClient(ep, name="w") as hc:
            hc.insert(prompt, hc.alloc(len(prompt)))
        wait_until(lambda: ask(replay, (0).to_bytes(8, "big")), what="a batch")
        stored = rebuild(ask(replay, (0).to_bytes(8, "big"))).blocks["GPU"]
        assert set(chain(prompt)) == set(stored)
    finally:
        stop_daemon(proc)


def test_subscribers_that_never_read_do_not_hold_the_daemon_up(tmp_path):
    ep, pub, replay, proc = events_daemon(tmp_path, "--events-buffer", "4")
    ctx = zmq.Context.instance()
    stuck = []
    try:
        for _ in range(3):  # subscribers with tiny queues that never read
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, 1)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(pub)
            stuck.append(sub)
        peer = ctx.socket(zmq.DEALER)  # asks for replays and dumps, never reads the answers
        peer.setsockopt(zmq.LINGER, 0)
        peer.setsockopt(zmq.RCVHWM, 1)
        peer.connect(replay)
        stuck.append(peer)
        for _ in range(50):
            peer.send_multipart([b"", (0).to_bytes(8, "big")])
            peer.send_multipart([b"", b"dump"])
        serve_chats(ep, 4, 60)
        with HiCacheClient(ep, name="check") as hc:
            stats = hc.stats()
            assert stats["event_batches_published"] > 4 and stats["event_batches_dropped"] == 0
        # the replay buffer keeps the last 4 batches, and a reader still gets them
        wait_until(lambda: len(ask(replay, (0).to_bytes(8, "big"))) == 4, what="4 buffered")
    finally:
        for sock in stuck:
            sock.close()
        stop_daemon(proc)


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--events-endpoint", "udp://x:1"], "events_endpoint"),
        (["--events-replay-endpoint", "ipc:///run/x.sock"], "events_replay_endpoint"),
        (["--events-endpoint", "ipc:///run/x.sock", "--events-buffer", "0"], "events_buffer"),
        (["--events-endpoint", "tcp://127.0.0.1:9"], "events_endpoint"),  # no keys: refused
    ],
)
def test_bad_event_settings_name_the_field(argv, field):
    from hicache.daemon.config import build_parser, resolve

    with pytest.raises(ValueError, match=field):
        resolve(build_parser().parse_args(argv), {})


def test_a_stopped_daemon_leaves_no_event_socket_files(tmp_path):
    pub, replay = tmp_path / "pub.sock", tmp_path / "replay.sock"
    proc = start_daemon(
        f"ipc://{tmp_path}/d.sock",
        "--events-endpoint",
        f"ipc://{pub}",
        "--events-replay-endpoint",
        f"ipc://{replay}",
    )
    assert pub.exists() and replay.exists()
    stop_daemon(proc)
    assert not pub.exists() and not replay.exists()


def test_the_disk_is_announced_on_storage_as_it_keeps_and_evicts_pages(tmp_path):
    """With a disk under the host pool, what the events say is on vLLM's STORAGE medium is what
    the disk holds, as the disk writes and evicts pages on its own (it is too small for the
    traffic), each block under its parent; a dump says the same, and a flush of the disk
    removes all of it."""
    disk = ["--disk", f"{tmp_path}/disk", "--disk-bytes", "320KiB", "--disk-admission", "all"]
    disk += ["--disk-write-budget", "64MiB", "--l3-model", "tiny@test"]
    ep, pub, replay, proc = events_daemon(tmp_path, *disk)
    try:
        serve_chats(ep, 4, 60)
        with HiCacheClient(ep, name="admin", admin=True) as hc:

            def settled() -> bool:
                s = hc.stats()
                idle = s["inflight_transfers"] == 0 and s["l3"]["queued_pages"] == 0
                published = len(ask(replay, (0).to_bytes(8, "big")))
                return idle and published == hc.stats()["event_batches_published"]

            wait_until(settled, what="the disk's writes announced")
            l3 = hc.stats()["l3"]
            model = rebuild(ask(replay, (0).to_bytes(8, "big")))
            storage = model.blocks.get(kv_events.MEDIUM_STORAGE, {})
            assert l3["store_disk_evicted_values"] > 0  # (the disk made room on its own)
            assert len(storage) == l3["store_disk_held_values"] > 0
            for parent, tokens in storage.values():  # (a page is on the disk with its prefix)
                assert len(tokens) == PS and (parent is None or parent in storage)
            assert rebuild(ask(replay, b"dump")).normalized() == model.normalized()
            hc.flush(disk=True)
            wait_until(
                lambda: not rebuild(ask(replay, (0).to_bytes(8, "big"))).normalized(),
                what="everything removed",
            )
    finally:
        stop_daemon(proc)
