"""The emulated WAN link (bench.wan's relay) outlives a connection reset by a peer.

A reset used to escape the relay's handler wrapped in an exception group and
end the relay process, so every route behind it (the datanodes, JuiceFS's S3
endpoint) refused connections for the rest of a benchmark run.
"""

from __future__ import annotations

import socket
import struct
import threading
from pathlib import Path

from bench.wan import LOCAL, Relay
from cachefs.testing.ports import free_port


def _backend() -> tuple[socket.socket, int]:
    """Resets its first connection after reading from it; echoes on the others."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        first = True
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                data = conn.recv(65536)
                if first:
                    first = False
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    continue  # closed with RST
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def test_relay_survives_a_reset_connection(tmp_path: Path) -> None:
    srv, backend_port = _backend()
    port = free_port()
    relay = Relay(tmp_path, {port: f"127.0.0.1:{backend_port}"}, LOCAL)
    relay.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"x" * 100_000)
            assert s.recv(65536) == b""  # the relay passed the reset on as a close
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"ping")
            assert s.recv(16) == b"ping"
        assert relay.proc is not None and relay.proc.poll() is None
    finally:
        relay.stop()
        srv.close()
