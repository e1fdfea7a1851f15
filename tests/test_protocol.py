"""The wire schema: round trips, and every malformed header mapped to a stable error code."""

import msgpack
import numpy as np
import pytest

from hicache import HiCacheConfig, HiRadixCache, protocol
from hicache.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    ErrorCode,
    Op,
    ProtocolError,
    Reply,
    Request,
    decode_reply,
    decode_request,
    decode_slots,
    decode_tokens,
    encode_reply,
    encode_request,
    slots_frame,
    split_tokens,
    tokens_frame,
)


def test_request_and_reply_round_trip():
    req = Request(Op.MATCH, 7, 42, 2**62 + 1, {"namespaces": [None, "a"]})
    assert decode_request(encode_request(req)) == req
    reply = Reply(ErrorCode.NOT_OWNED, 7, 123456789, {"message": "slot 5 is not yours"})
    back = decode_reply(encode_reply(reply))
    assert back == reply and not back.ok and back.status is ErrorCode.NOT_OWNED


class _Sneaky(dict):
    """A map whose packing packs another message on the same thread first (as a finalizer
    that sends a goodbye can, when the garbage collector runs inside a pack)."""

    def items(self):
        inner.append(encode_request(Request(Op.GOODBYE, 9, 3, 4, {})))
        return super().items()


inner: list[bytes] = []


def test_a_pack_inside_a_pack_leaves_both_messages_whole():
    inner.clear()
    req = Request(Op.MATCH, 7, 42, 5, _Sneaky(lengths=[5], namespaces=["a"]))
    outer = decode_request(encode_request(req))
    assert outer.op is Op.MATCH and outer.fields == {"lengths": [5], "namespaces": ["a"]}
    assert decode_request(inner[0]) == Request(Op.GOODBYE, 9, 3, 4, {})
    assert decode_request(encode_request(req)).request_id == 7  # and after it, still whole


def test_arrays_travel_as_raw_little_endian_frames():
    tokens = np.array([1, 2, 2**31 - 1], dtype=np.int32)
    frame = tokens_frame(tokens)
    assert bytes(frame) == tokens.astype("<i4").tobytes()
    assert decode_tokens(bytes(frame)).tolist() == tokens.tolist()
    assert decode_slots(bytes(slots_frame([5, 6]))).tolist() == [5, 6]
    assert decode_tokens(b"").tolist() == []


def test_decoded_tokens_take_the_cache_fast_path():
    cache = HiRadixCache(
        HiCacheConfig(num_layers=1, num_kv_heads=1, head_dim=1, device_tokens=16, host_tokens=0)
    )
    wire = decode_tokens(bytes(tokens_frame([3, 4, 5])))
    slots = decode_slots(bytes(slots_frame(cache.alloc(3))))
    assert cache.insert(wire, slots) == 0
    assert cache.match_prefix(wire).device_hit_length == 3


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (b"\xc1garbage", ErrorCode.BAD_FIELD),
        (msgpack.packb({"op": 1}), ErrorCode.BAD_FIELD),
        (msgpack.packb([PROTOCOL_VERSION + 1, 1, 0, 0, 0, {}]), ErrorCode.WRONG_VERSION),
        (msgpack.packb([1, 1, 0, 0, {}]), ErrorCode.WRONG_VERSION),  # a version-1 client
        (msgpack.packb([PROTOCOL_VERSION, 999, 0, 0, 0, {}]), ErrorCode.UNKNOWN_OP),
        (msgpack.packb([PROTOCOL_VERSION, "match", 0, 0, 0, {}]), ErrorCode.BAD_FIELD),
        (msgpack.packb([PROTOCOL_VERSION, 1, 0, 0, 0, [1, 2]]), ErrorCode.BAD_FIELD),
        (msgpack.packb([PROTOCOL_VERSION, 1, True, 0, 0, {}]), ErrorCode.BAD_FIELD),
        (msgpack.packb([PROTOCOL_VERSION, 1, 0, 0, 1.5, {}]), ErrorCode.BAD_FIELD),
        (msgpack.packb([PROTOCOL_VERSION, 1, 0, 0, {}]), ErrorCode.BAD_FIELD),  # no epoch
        (b"\x00" * (2 << 20), ErrorCode.TOO_LARGE),
    ],
)
def test_malformed_headers_get_a_stable_code(frame, code):
    with pytest.raises(ProtocolError) as err:
        decode_request(frame)
    assert err.value.code is code


def test_malformed_array_frames():
    with pytest.raises(ProtocolError) as err:
        decode_tokens(b"\x01\x02\x03")
    assert err.value.code is ErrorCode.BAD_FIELD
    with pytest.raises(ProtocolError) as err:
        decode_slots(memoryview(bytearray(MAX_FRAME_BYTES + 8)))
    assert err.value.code is ErrorCode.TOO_LARGE


def test_split_tokens_rebuilds_sequences_that_share_a_prefix():
    seqs = [np.arange(1, 9), np.r_[np.arange(1, 6), [70, 71]], np.arange(1, 4), [9, 9]]
    seqs = [np.asarray(s, dtype=np.int32) for s in seqs]
    shared = [0, 5, 3, 0]
    frame = np.concatenate([s[k:] for s, k in zip(seqs, shared, strict=True)]).tobytes()
    keys = split_tokens(frame, [len(s) for s in seqs], shared)
    assert keys == [s.tobytes() for s in seqs]
    plain = [frame[:32], frame[32:40], b"", frame[40:44], frame[44:48], b""]
    assert split_tokens(frame, [8, 2, 0, 1, 1, 0], None) == plain


@pytest.mark.parametrize(
    ("lengths", "shared"),
    [
        ([8, 7], [1, 5]),  # the first sequence has nothing before it
        ([8, 7], [0, 8]),  # more than the sequence holds
        ([3, 7], [0, 4]),  # more than the previous sequence holds
        ([8, 7], [0]),  # not one per sequence
        ([8, 7], [0, -1]),
        ([8, 7], [0, 2.0]),
        ([8, 8], [0, 0]),  # lengths do not add up to the frame
        ("8", None),
    ],
)
def test_split_tokens_refuses_inconsistent_sharing(lengths, shared):
    frame = np.arange(15, dtype=np.int32).tobytes()
    with pytest.raises(ProtocolError) as err:
        split_tokens(frame, lengths, shared)
    assert err.value.code == ErrorCode.BAD_FIELD


def test_a_match_reply_travels_as_its_types_say():
    """MatchReply and MatchEntry are the wire's own form: encoded and decoded they read back
    equal, an entry travels as an array in its field order, and a malformed reply is refused."""
    from hicache.protocol import ErrorCode as Code
    from hicache.protocol import MatchEntry, MatchReply, ProtocolError, Reply

    sent = MatchReply([MatchEntry(32, 16, 7, [0, 1]), MatchEntry(0, 0, 0, [])], [2, 3], [1])
    wire = decode_reply(encode_reply(Reply(Code.OK, 1, 5, sent.fields())))
    assert wire.fields["results"][0] == [32, 16, 7, [0, 1]]  # (an array, in field order)
    got = MatchReply.read(wire.fields)
    assert got == sent and got.results[0].lock_id == 7 and got.rest_pages is None
    assert "l3_pending" not in MatchReply([], []).fields()  # (absent when none)
    for bad in ({"results": [[1, 2]]}, {"chunk_pages": []}, {"results": 3, "chunk_pages": []}):
        with pytest.raises(ProtocolError, match="malformed match reply"):
            MatchReply.read(bad)


@pytest.mark.parametrize(
    "sent",
    [
        protocol.LoadReply(0, 0),
        protocol.LoadReply(48, 3, [b"h1", b"h2"]),
        protocol.LoadReply(0, 0, failed=True),
        protocol.InsertReply([0, 16]),
        protocol.LockReply(9),
        protocol.HoldingsReply([4, 5], 2),
    ],
    ids=repr,
)
def test_the_other_typed_replies_read_back_what_was_sent(sent):
    """LOAD_BACK, INSERT, LOCK and HOLDINGS replies through the wire read back equal; a
    reply that lacks a required field is refused by name, and optional ones default."""
    wire = decode_reply(encode_reply(protocol.Reply(protocol.ErrorCode.OK, 1, 5, sent.fields())))
    assert type(sent).read(wire.fields) == sent
    name = {"LoadReply": "load_back"}.get(type(sent).__name__, type(sent).__name__[:-5].lower())
    with pytest.raises(protocol.ProtocolError, match=f"malformed {name} reply"):
        type(sent).read({})
