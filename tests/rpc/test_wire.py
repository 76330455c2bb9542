"""The sans-IO codec: framing, chunked input, limits, malformed headers."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefs import wire
from cachefs.errors import FrameTooLarge, ProtocolError

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=20),
                    st.binary(max_size=20), st.floats(allow_nan=False))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                      max_leaves=12)
call_ids = st.integers(0, wire.MAX_CALL_ID)
payloads = st.one_of(st.none(), st.binary(min_size=1, max_size=200_000))

events = st.one_of(
    st.builds(wire.Request, call_ids, st.text(min_size=1, max_size=wire.MAX_METHOD_LEN),
              st.dictionaries(st.text(max_size=10), values, max_size=4), st.integers(0, 10**6), payloads),
    st.builds(wire.Response, call_ids, values, payloads),
    st.builds(wire.ErrorReply, call_ids, st.text(max_size=12), st.text(max_size=40),
              st.dictionaries(st.text(max_size=8), scalars, max_size=3)),
    st.builds(wire.Hello, st.integers(0, 100), st.binary(min_size=32, max_size=32), st.booleans()),
    st.builds(wire.Auth, st.binary(min_size=32, max_size=32), st.text(max_size=40), st.binary(max_size=40)),
    st.builds(wire.Welcome, st.binary(max_size=40)),
)


def _drain(decoder: wire.FrameDecoder) -> list[wire.Event]:
    out = []
    while (event := decoder.next_event()) is not None:
        out.append(event)
    return out


def _payload(event: wire.Event) -> bytes | None:
    p = getattr(event, "payload", None)
    return None if p is None else bytes(p)


@settings(max_examples=150, deadline=None)
@given(st.lists(events, max_size=6), st.lists(st.integers(1, 70_000), min_size=1, max_size=20))
def test_any_event_sequence_survives_any_chunking(evs, cuts):
    stream = b"".join(bytes(b) for e in evs for b in wire.encode(e))
    decoder = wire.FrameDecoder(buffer_size=64)
    got: list[wire.Event] = []
    pos, i = 0, 0
    while pos < len(stream):
        n = cuts[i % len(cuts)]
        decoder.receive_data(stream[pos:pos + n])
        pos += n
        i += 1
        got.extend(_drain(decoder))
    assert got == evs
    assert [_payload(e) for e in got] == [_payload(e) for e in evs]


def test_receive_in_place_puts_payload_bytes_straight_into_their_buffer():
    payload = bytes(range(256)) * 4096  # 1 MiB
    stream = b"".join(bytes(b) for b in wire.encode(wire.Response(7, {"ok": 1}, payload)))
    decoder = wire.FrameDecoder(buffer_size=4096)
    pos = 0
    targets = []
    while pos < len(stream):
        buf = decoder.get_buffer()
        targets.append(len(buf))
        n = min(len(buf), len(stream) - pos)
        buf[:n] = stream[pos:pos + n]
        decoder.buffer_updated(n)
        pos += n
        if (event := decoder.next_event()) is not None:
            break
    assert isinstance(event, wire.Response) and bytes(event.payload) == payload
    # After the header, the decoder hands out the rest of the payload as one buffer.
    assert max(targets) >= len(payload) - 4096


def test_a_payload_sink_receives_a_response_payload_in_place_and_it_is_still_authenticated():
    """The client names where a reply's payload goes (a shard's place in its
    block): the bytes land there, the tag is checked over them, and frames
    the sink does not claim (other sizes, requests) get buffers of their own."""
    key = b"k" * 32
    payload = bytes(range(256)) * 1024  # 256 KiB
    block = bytearray(len(payload) + 100)
    place = memoryview(block)[100:]
    asked = []

    def sink(call_id: int, size: int) -> memoryview | None:
        asked.append((call_id, size))
        return place if call_id == 7 and size == len(place) else None

    def decoder() -> wire.FrameDecoder:
        d = wire.FrameDecoder(buffer_size=4096)
        d.mac, d.payload_sink = wire.FrameMac(key), sink
        return d

    sender = wire.FrameMac(key)
    frames = [wire.Response(7, {"ok": 1}, payload), wire.Response(8, None, payload[:1000]),
              wire.Request(7, "get", {}, 0, payload)]
    stream = b"".join(bytes(b) for f in frames for b in wire.encode(f, sender))
    d = decoder()
    d.receive_data(stream)
    got = _drain(d)
    assert got[0].payload is place and bytes(block[100:]) == payload
    assert isinstance(got[1].payload, bytearray) and bytes(got[1].payload) == payload[:1000]
    assert isinstance(got[2].payload, bytearray) and bytes(got[2].payload) == payload
    assert asked == [(7, len(payload)), (8, 1000)]  # never asked about a request
    tampered = bytearray(b"".join(bytes(b) for b in wire.encode(frames[0], wire.FrameMac(key))))
    tampered[-5] ^= 1
    d = decoder()
    d.receive_data(bytes(tampered))
    with pytest.raises(ProtocolError):
        _drain(d)


def test_small_payloads_are_coalesced_large_ones_are_not_copied():
    small = wire.encode(wire.Response(1, None, b"x" * 100))
    big_payload = bytearray(wire.COALESCE_LIMIT + 1)
    big = wire.encode(wire.Response(1, None, big_payload))
    assert len(small) == 1
    assert len(big) == 2 and big[1] is big_payload


@pytest.mark.parametrize("header_len,payload_len,limit", [
    (2**31, 0, "header"), (10, 2**31, "payload"), (0, 0, "header"),
])
def test_oversized_length_prefix_is_refused_before_allocating(header_len, payload_len, limit):
    decoder = wire.FrameDecoder(max_payload=1 << 20)
    decoder.receive_data(wire.PREFIX.pack(header_len, payload_len))
    with pytest.raises(FrameTooLarge, match=limit):
        decoder.next_event()


@pytest.mark.parametrize("header", [
    b"\xc1",                                          # never-used msgpack byte
    msgpack.packb({"not": "a list"}),
    msgpack.packb([0, -1, "m", {}, 0]),               # negative call id
    msgpack.packb([0, 1, "", {}, 0]),                 # empty method
    msgpack.packb([0, 1, "m", {1: 2}, 0]),            # non-string arg key
    msgpack.packb([0, 1, "m", [], 0]),                # args not a map
    msgpack.packb([9, 1]),                            # unknown kind
    msgpack.packb([3, 1, b"short", True]),            # bad nonce
])
def test_malformed_headers_raise_protocol_error(header):
    decoder = wire.FrameDecoder()
    decoder.receive_data(wire.PREFIX.pack(len(header), 0) + header)
    with pytest.raises(ProtocolError):
        decoder.next_event()


def test_proofs_depend_on_both_nonces_the_key_and_the_key_id():
    a, b = b"a" * 32, b"b" * 32
    p = wire.client_proof(b"s", a, b, "client:x:v")
    assert wire.proofs_match(p, wire.client_proof(b"s", a, b, "client:x:v"))
    assert not wire.proofs_match(p, wire.client_proof(b"t", a, b, "client:x:v"))
    assert not wire.proofs_match(p, wire.client_proof(b"s", b, a, "client:x:v"))
    assert not wire.proofs_match(p, wire.client_proof(b"s", a, b, "client:x:w"))
    assert not wire.proofs_match(p, wire.server_proof(b"s", a, b))
