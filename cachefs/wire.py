"""The wire protocol, sans-IO: frame encoding and an incremental decoder.

Theory of operation
-------------------
Every message is one frame::

    +----------------+-----------------+------------------+-------------------+
    | header_len u32 | payload_len u32 | header (msgpack) | payload (raw)     |
    +----------------+-----------------+------------------+-------------------+

The header is a small msgpack array whose first element says what it is
(:class:`Request`, :class:`Response`, :class:`ErrorReply`, and the three
handshake messages). The payload is bulk data (a block, a shard) that msgpack
never sees: the sender hands it to the socket as a separate buffer, and the
receiver's :class:`FrameDecoder` points the socket straight at a buffer of the
payload's size, so bulk bytes are copied once, from the kernel into their
final buffer, on either side.

The decoder follows asyncio's BufferedProtocol shape: the driver asks
:meth:`FrameDecoder.get_buffer` where the next bytes should land, receives
into it, reports the count with :meth:`FrameDecoder.buffer_updated`, then
drains :meth:`FrameDecoder.next_event`. Limits are checked on the length
prefix, before anything is allocated: until the handshake is done a server
reads with :data:`HANDSHAKE_MAX_FRAME` (and no payload), so a peer that has
not authenticated cannot make it allocate more than that. A server may also
take each payload's allocation into its own hands (``defer_payload``): the
decoder then stops at :attr:`FrameDecoder.wanted` until the driver has
reserved the bytes and calls :meth:`FrameDecoder.accept_payload`. A client
may name where a response's payload goes (``payload_sink``, see
:meth:`FrameDecoder.response_target`): a shard lands in its place in the
block being read, so the block is never joined from pieces.

Handshake (mutual HMAC challenge-response, before any other frame), with
the peer's credential: a key id and its key ``K`` (see
:mod:`cachefs.credentials`; the server derives ``K`` from the key id)::

    server -> Hello(version, nonce_s, auth_required)
    client -> Auth(nonce_c, key_id, HMAC(K, "cachefs-client" | nonce_s | nonce_c | key_id))
    server -> Welcome(HMAC(K, "cachefs-server" | nonce_c | nonce_s))

A fresh ``nonce_s`` per connection makes a recorded ``Auth`` useless later.

Frame MACs (plain TCP; TLS protects its own records): after the handshake
every frame carries a 16-byte tag over its prefix and header, and a second
one over its payload if it has one, between header and payload::

    | prefix | header | tag(prefix+header) | [tag(payload)] | payload |

A tag is AES-GCM's over an empty plaintext with the bytes as associated data
(GMAC: several GB/s with AES-NI), under a key per direction derived from
``K`` and both nonces, with the frame's counter in that direction as the
nonce. So a changed, dropped, replayed or reordered frame fails its tag, and
a header is checked before it is parsed.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from cachefs.errors import FrameTooLarge, ProtocolError

PROTOCOL_VERSION = 2
NONCE_SIZE = 32

PREFIX = struct.Struct(">II")
DEFAULT_MAX_HEADER = 1 << 20
DEFAULT_MAX_PAYLOAD = 64 << 20
# Every frame before authentication (Hello, Auth, Welcome, an error) is far
# smaller than this; nothing larger is read from a peer not yet known.
HANDSHAKE_MAX_FRAME = 4096
MAX_METHOD_LEN = 64
MAX_CALL_ID = (1 << 63) - 1

# Payloads up to this size are joined with their header into one buffer: one
# small copy is cheaper than a second iovec and syscall bookkeeping.
COALESCE_LIMIT = 64 * 1024

_REQUEST, _RESPONSE, _ERROR, _HELLO, _AUTH, _WELCOME = range(6)

Payload = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class Request:
    call_id: int
    method: str
    args: dict[str, Any]
    timeout_ms: int = 0
    payload: Payload | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Response:
    call_id: int
    result: Any
    payload: Payload | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class ErrorReply:
    call_id: int
    code: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Hello:
    version: int
    nonce: bytes
    auth_required: bool


@dataclass(frozen=True, slots=True)
class Auth:
    nonce: bytes
    key_id: str
    proof: bytes


@dataclass(frozen=True, slots=True)
class Welcome:
    proof: bytes


Event = Request | Response | ErrorReply | Hello | Auth | Welcome


# ---------------------------------------------------------------- encoding

def _header_of(event: Event) -> list[Any]:
    match event:
        case Request(call_id, method, args, timeout_ms):
            return [_REQUEST, call_id, method, args, timeout_ms]
        case Response(call_id, result):
            return [_RESPONSE, call_id, result]
        case ErrorReply(call_id, code, message, details):
            return [_ERROR, call_id, code, message, details]
        case Hello(version, nonce, auth_required):
            return [_HELLO, version, nonce, auth_required]
        case Auth(nonce, key_id, proof):
            return [_AUTH, nonce, key_id, proof]
        case Welcome(proof):
            return [_WELCOME, proof]
    raise TypeError(f"not a wire event: {event!r}")


def encode(event: Event, mac: FrameMac | None = None) -> list[Payload]:
    """Encode one frame as a list of buffers to send in order (sealed with
    the next tags of ``mac`` when given).

    Raises:
        TypeError: the header holds something msgpack cannot encode.
    """
    header = msgpack.packb(_header_of(event), use_bin_type=True)
    payload = getattr(event, "payload", None)
    size = 0 if payload is None else len(payload)
    head = PREFIX.pack(len(header), size) + header
    if mac is not None:
        head += mac.seal(head, payload if size else None)
    if not size:
        return [head]
    if size <= COALESCE_LIMIT:
        return [head + bytes(payload)]
    return [head, payload]


# ---------------------------------------------------------------- decoding

def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ProtocolError(f"malformed frame: {what}")


def _is_id(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_CALL_ID


def _event_of(header: Any, payload: bytearray | memoryview | None) -> Event:
    _check(isinstance(header, list) and header and type(header[0]) is int, "header is not a tagged array")
    kind = header[0]
    # The two hot kinds first, their checks inline (this runs for every call).
    if kind == _RESPONSE:
        _check(len(header) == 3 and _is_id(header[1]), "response")
        return Response(header[1], header[2], payload)
    if kind == _REQUEST:
        _check(len(header) == 5, "request needs 4 fields")
        _, call_id, method, args, timeout_ms = header
        if not (type(call_id) is int and 0 <= call_id <= MAX_CALL_ID):
            raise ProtocolError("malformed frame: call id")
        if not (type(method) is str and 0 < len(method) <= MAX_METHOD_LEN):
            raise ProtocolError("malformed frame: method name")
        if type(args) is not dict:
            raise ProtocolError("malformed frame: args must be a map with string keys")
        for k in args:
            if type(k) is not str:
                raise ProtocolError("malformed frame: args must be a map with string keys")
        if not (type(timeout_ms) is int and timeout_ms >= 0):
            raise ProtocolError("malformed frame: timeout")
        return Request(call_id, method, args, timeout_ms, payload)
    rest = header[1:]
    if kind == _ERROR:
        _check(len(rest) == 4 and _is_id(rest[0]), "error reply")
        call_id, code, message, details = rest
        _check(isinstance(code, str) and isinstance(message, str) and isinstance(details, dict), "error fields")
        return ErrorReply(call_id, code, message, details)
    if kind == _HELLO:
        _check(len(rest) == 3 and type(rest[0]) is int and isinstance(rest[1], bytes)
               and len(rest[1]) == NONCE_SIZE and isinstance(rest[2], bool), "hello")
        return Hello(rest[0], rest[1], rest[2])
    if kind == _AUTH:
        _check(len(rest) == 3 and isinstance(rest[0], bytes) and len(rest[0]) == NONCE_SIZE
               and isinstance(rest[1], str) and isinstance(rest[2], bytes), "auth")
        return Auth(rest[0], rest[1], rest[2])
    if kind == _WELCOME:
        _check(len(rest) == 1 and isinstance(rest[0], bytes), "welcome")
        return Welcome(rest[0])
    raise ProtocolError(f"malformed frame: unknown kind {kind}")


# ---------------------------------------------------------------- frame MACs

TAG_SIZE = 16
_NONCE = struct.Struct(">QI")  # frame counter, part (0: prefix+header, 1: payload)


class FrameMac:
    """One direction's frame tags: a key and the counter of frames so far.

    Both ends count the frames they seal or open, so the counter never
    travels; a frame out of place fails its tag like a changed one.
    """

    def __init__(self, key: bytes) -> None:
        self._gcm = AESGCM(key)
        self.counter = 0

    @staticmethod
    def tag_size(payload_len: int) -> int:
        return 2 * TAG_SIZE if payload_len else TAG_SIZE

    def seal(self, head: Payload, payload: Payload | None) -> bytes:
        counter = self.counter
        self.counter += 1
        tag = self._gcm.encrypt(_NONCE.pack(counter, 0), b"", head)
        if payload is not None:
            tag += self._gcm.encrypt(_NONCE.pack(counter, 1), b"", payload)
        return tag

    def open_head(self, head: memoryview, tag: memoryview) -> int:
        """Check a frame's head; its counter, for :meth:`open_payload`.

        Raises:
            ProtocolError: the tag does not match.
        """
        counter = self.counter
        self._open(_NONCE.pack(counter, 0), bytes(tag), head)
        self.counter += 1
        return counter

    def open_payload(self, counter: int, payload: bytearray | memoryview, tag: bytes) -> None:
        self._open(_NONCE.pack(counter, 1), tag, payload)

    def _open(self, nonce: bytes, tag: bytes, data: Payload) -> None:
        try:
            self._gcm.decrypt(nonce, tag, data)  # an empty plaintext: this only checks the tag
        except InvalidTag:
            raise ProtocolError("frame authentication failed (changed, replayed or out of order)") from None


class FrameDecoder:
    """Incremental frame decoder that lets the driver receive in place.

    Invariant: bytes ``_buf[_start:_end]`` are received but not yet parsed;
    when ``_payload`` is set, a header has been parsed and its payload is
    being filled up to ``_filled``; when ``wanted`` is non-zero, a header has
    been parsed and its payload of that size waits for :meth:`accept_payload`.
    """

    def __init__(self, *, max_header: int = DEFAULT_MAX_HEADER,
                 max_payload: int = DEFAULT_MAX_PAYLOAD, buffer_size: int = 256 * 1024,
                 defer_payload: bool = False) -> None:
        self.max_header = max_header
        self.max_payload = max_payload
        self.defer_payload = defer_payload
        self.wanted = 0
        self.mac: FrameMac | None = None  # set once the handshake made the keys
        self._payload_tag: tuple[int, bytes] | None = None  # (frame counter, tag) to check
        self._buf = bytearray(buffer_size)
        self._start = 0
        self._end = 0
        self._header: Any = None
        self._payload: bytearray | memoryview | None = None
        self._filled = 0
        # Where a response's payload should land: called with the call id
        # and the payload's size, it returns a buffer of exactly that size
        # (the payload is received into it) or None (a new bytearray).
        self.payload_sink: Callable[[int, int], memoryview | None] | None = None
        # Where other payloads land: a bytearray of the size asked, its old
        # contents overwritten before the frame completes.
        self.allocate: Callable[[int], bytearray] = bytearray

    def set_limits(self, *, max_header: int, max_payload: int, buffer_size: int = 0) -> None:
        """New limits for the frames still to come (after the handshake);
        ``buffer_size`` grows the receive buffer to at least that."""
        self.max_header = max_header
        self.max_payload = max_payload
        if buffer_size > len(self._buf):
            self._make_room(buffer_size - (self._end - self._start))

    def accept_payload(self) -> None:
        """Allocate the payload :attr:`wanted` names (the driver reserved it)."""
        if not self.wanted:
            raise RuntimeError("no payload is waiting to be accepted")
        size, self.wanted = self.wanted, 0
        payload = bytearray(size)
        take = min(size, self._end - self._start)
        payload[:take] = memoryview(self._buf)[self._start:self._start + take]
        self._start += take
        self._compact_if_empty()
        self._payload, self._filled = payload, take

    def get_buffer(self) -> memoryview:
        """Where the next received bytes should be written (never empty)."""
        if self.wanted:
            raise RuntimeError("a payload waits for accept_payload()")
        if self._payload is not None:
            return memoryview(self._payload)[self._filled:]
        if self._end == len(self._buf):
            self._make_room(len(self._buf) // 2 or 1)
        return memoryview(self._buf)[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._payload is not None:
            self._filled += nbytes
        else:
            self._end += nbytes

    def receive_data(self, data: bytes) -> None:
        """Copying entry point, for tests and callers without recv_into."""
        view = memoryview(data)
        while view:
            if self.wanted:  # kept in the byte buffer until the payload is accepted
                self._stash_rest(view)
                return
            target = self.get_buffer()
            n = min(len(target), len(view))
            target[:n] = view[:n]
            self.buffer_updated(n)
            view = view[n:]
            if self._payload is not None and self._filled == len(self._payload):
                # The payload is complete; stash the rest in the byte buffer.
                self._stash_rest(view)
                return

    def _stash_rest(self, view: memoryview) -> None:
        if not view:
            return
        self._make_room(len(view))
        self._buf[self._end:self._end + len(view)] = view
        self._end += len(view)

    def _make_room(self, needed: int) -> None:
        """Compact (and grow if needed) so that ``needed`` more bytes fit."""
        pending = self._end - self._start
        if self._start:
            self._buf[:pending] = self._buf[self._start:self._end]
            self._start, self._end = 0, pending
        if len(self._buf) - self._end < needed:
            # A new buffer, not extend(): the driver may still hold a view.
            grown = bytearray(max(2 * len(self._buf), self._end + needed))
            grown[:self._end] = memoryview(self._buf)[:self._end]
            self._buf = grown

    def next_event(self) -> Event | None:
        """The next complete event, or None until more bytes arrive.

        Raises:
            FrameTooLarge: a length prefix is over a limit (close the stream).
            ProtocolError: the header is not a valid message (close the stream).
        """
        if self.wanted:
            return None
        if self._payload is not None:
            if self._filled < len(self._payload):
                return None
            header, payload = self._header, self._payload
            self._header, self._payload, self._filled = None, None, 0
            return self._complete(header, payload)
        available = self._end - self._start
        if available < PREFIX.size:
            return None
        header_len, payload_len = PREFIX.unpack_from(self._buf, self._start)
        if header_len > self.max_header or header_len == 0:
            raise FrameTooLarge(f"frame header of {header_len} bytes (limit {self.max_header})")
        if payload_len > self.max_payload:
            raise FrameTooLarge(f"frame payload of {payload_len} bytes (limit {self.max_payload})")
        mac = self.mac
        tags = 0 if mac is None else mac.tag_size(payload_len)
        head_end = self._start + PREFIX.size + header_len
        if self._end < head_end + tags:
            if len(self._buf) - self._start < PREFIX.size + header_len + tags:
                self._make_room(PREFIX.size + header_len + tags - available)
            return None
        view = memoryview(self._buf)
        if mac is not None:
            counter = mac.open_head(view[self._start:head_end], view[head_end:head_end + TAG_SIZE])
            if payload_len:
                self._payload_tag = (counter, bytes(view[head_end + TAG_SIZE:head_end + tags]))
        try:
            header = msgpack.unpackb(view[self._start + PREFIX.size:head_end], raw=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"malformed frame: header is not msgpack ({exc.__class__.__name__})") from None
        del view
        self._start = head_end + tags
        if payload_len == 0:
            self._compact_if_empty()
            return _event_of(header, None)
        if self.defer_payload:
            self._header, self.wanted = header, payload_len
            return None
        payload = self.response_target(header, payload_len)
        take = min(payload_len, self._end - self._start)
        payload[:take] = memoryview(self._buf)[self._start:self._start + take]
        self._start += take
        self._compact_if_empty()
        if take == payload_len:
            return self._complete(header, payload)
        self._header, self._payload, self._filled = header, payload, take
        return None

    def response_target(self, header: Any, size: int) -> bytearray | memoryview:
        """The buffer a payload of ``size`` bytes is received into: the one
        :attr:`payload_sink` names for a response, if it does, else
        ``allocate(size)`` (a new one, or a pooled one to overwrite).

        The header is not validated yet (:func:`_event_of` does that after
        the payload); a sink is asked only about a well-formed response id.
        """
        sink = self.payload_sink
        if (sink is not None and type(header) is list and len(header) == 3 and header[0] == _RESPONSE
                and _is_id(header[1])):
            target = sink(header[1], size)
            if target is not None:
                if len(target) != size or target.readonly:
                    raise RuntimeError(f"payload sink gave {len(target)} bytes for a payload of {size}")
                return target
        return self.allocate(size)

    def _complete(self, header: Any, payload: bytearray | memoryview) -> Event:
        if self._payload_tag is not None:
            (counter, tag), self._payload_tag = self._payload_tag, None
            assert self.mac is not None
            self.mac.open_payload(counter, payload, tag)
        return _event_of(header, payload)

    def _compact_if_empty(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0


# ---------------------------------------------------------------- handshake

def client_proof(key: bytes, server_nonce: bytes, client_nonce: bytes, key_id: str) -> bytes:
    return hmac.new(key, b"cachefs-client" + server_nonce + client_nonce + key_id.encode(),
                    hashlib.sha256).digest()


def server_proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, b"cachefs-server" + client_nonce + server_nonce, hashlib.sha256).digest()


def frame_keys(key: bytes, server_nonce: bytes, client_nonce: bytes) -> tuple[bytes, bytes]:
    """The two directions' MAC keys of one connection: (client to server, server to client)."""
    def one(label: bytes) -> bytes:
        return hmac.new(key, label + server_nonce + client_nonce, hashlib.sha256).digest()

    return one(b"cachefs-mac-c2s"), one(b"cachefs-mac-s2c")


def proofs_match(expected: bytes, given: bytes) -> bool:
    return hmac.compare_digest(expected, given)
