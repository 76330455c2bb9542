"""A hand-driven peer for hostile-input tests: raw frames over a trio stream,
with the real handshake and frame MACs when a test wants to be let in."""

from __future__ import annotations

import os

import trio

from cachefs import wire
from cachefs.credentials import Credential, Secret, as_credential


class RawPeer:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.decoder = wire.FrameDecoder()
        self.mac: wire.FrameMac | None = None

    @classmethod
    async def connect(cls, addr: str, source: str | None = None) -> RawPeer:
        host, port = addr.rsplit(":", 1)
        return cls(await trio.open_tcp_stream(host, int(port), local_address=source))

    async def read(self) -> wire.Event | None:
        """The next event, or None once the server closed the stream."""
        while (event := self.decoder.next_event()) is None:
            try:
                data = await self.stream.receive_some(65536)
            except trio.BrokenResourceError:
                return None
            if not data:
                return None
            self.decoder.receive_data(data)
        return event

    async def send(self, event: wire.Event) -> None:
        for buf in wire.encode(event, self.mac):
            await self.stream.send_all(buf)

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def login(self, secret: Secret) -> wire.Event | None:
        """Read the Hello, authenticate with ``secret`` (a cluster secret or a
        credential); the server's answer. MACs are on after a Welcome."""
        credential: Credential = as_credential(secret)  # type: ignore[assignment]
        hello = await self.read()
        assert isinstance(hello, wire.Hello), hello
        nonce = os.urandom(wire.NONCE_SIZE)
        await self.send(wire.Auth(nonce, credential.key_id,
                                  wire.client_proof(credential.key, hello.nonce, nonce, credential.key_id)))
        answer = await self.read()
        if isinstance(answer, wire.Welcome):
            send, receive = wire.frame_keys(credential.key, hello.nonce, nonce)
            self.mac = wire.FrameMac(send)
            self.decoder.mac = wire.FrameMac(receive)
        return answer

    async def drain(self) -> None:
        """Read until the server closes the stream."""
        try:
            while await self.stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def send_frame(self, header: bytes, payload: bytes = b"") -> None:
        """A frame of any header bytes, sealed like a real one once logged in."""
        head = wire.PREFIX.pack(len(header), len(payload)) + header
        if self.mac is not None:
            head += self.mac.seal(head, payload or None)
        await self.stream.send_all(head + payload)
