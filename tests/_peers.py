"""Peers on 127.0.0.1 that are no Dask scheduler, on real sockets: one that never speaks, one
that speaks first (an SSH banner, a length prefix claiming 4 GiB), an HTTP server. Each hangs up
on its connections after ``hang_up`` seconds, so that a client that would wait for ever without
its fix ends, and its test fails rather than hangs."""

from __future__ import annotations

import http.server
import socket
import struct
import threading
import time

SSH_BANNER = b"SSH-2.0-OpenSSH_9.6\r\n"
CLAIMS_4_GIB = struct.pack("Q", 4 << 30)  # Dask's frame length: 8 bytes, native byte order
GARBAGE = b"\xff\xfe\x12\x34\x56\x78\x9a\x7f"


class Peer:
    """Accepts on 127.0.0.1, sends ``first`` (nothing if None) on each connection, then reads
    and drops what comes until the other side closes or ``hang_up`` seconds have passed."""

    def __init__(self, first: bytes | None = None, hang_up: float = 30):
        self.first, self.hang_up = first, hang_up
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.address = f"tcp://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self.hang_up
        with conn:
            try:
                if self.first is not None:
                    conn.sendall(self.first)
                while (left := deadline - time.monotonic()) > 0:
                    conn.settimeout(left)
                    if not conn.recv(65536):
                        return
            except OSError:
                return

    def close(self) -> None:
        self.listener.close()


class _Quiet(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


class HttpPeer:
    """An HTTP server, as a dashboard is: it waits for a request and never speaks first."""

    def __init__(self, hang_up: float = 30):
        handler = type("Handler", (_Quiet,), {"timeout": hang_up})
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.address = f"tcp://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
