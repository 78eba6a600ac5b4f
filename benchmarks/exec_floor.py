"""Round trips that leave out parts of monarch-nb's per-cell work (bench_breakdown.py), so that
the time a trivial cell takes beyond the socket floor splits into the controller's share and the
rank's:

- ``lean_client``: the controller's data sockets written and read directly, with the fewest
  Python steps a request and its answer need (one pickle, a send per rank, epoll, the replies
  read until every rank is done); monarch-nb's engines answer. What ``ctl.run`` takes beyond
  it is the controller's own work: routing, rendering, interrupts, prompts, the result.
- ``exec_floor``: the same client against a minimal server in each worker process (a thread
  that reads a request, compiles and runs its code, and answers), the least a Python design
  of this shape needs. What the lean client takes beyond it is the engine's work: output
  capture, interrupts, the reply after the cell's output.

Both borrow the controller's sockets from its Reader (reader.py) while they run; nothing the
ranks send goes astray, and the ranks run their cells as usual (``x = 1`` in their namespaces).
"""

from __future__ import annotations

import pickle
import select
import socket
import time

from monarch_nb.dispatch.links import new_id
from monarch_nb.wire import HEADER


def _rounds(socks: list[socket.socket], frame_for, answered, cells: int, warmup: int):
    """Milliseconds of each of ``cells`` round trips after ``warmup``: ``frame_for(i)`` sent on
    every socket, then each readable socket handed to ``answered(sock)``, which reads it and says
    how many ranks it heard the end from, until every rank has answered."""
    ep = select.epoll()
    by_fd = {s.fileno(): s for s in socks}
    for fd in by_fd:
        ep.register(fd, select.EPOLLIN)
    times = []
    try:
        for i in range(warmup + cells):
            t = time.perf_counter()
            frame = frame_for(i)
            for s in socks:
                s.send(frame)
            left = len(socks)
            while left:
                for fd, _ in ep.poll():
                    left -= answered(by_fd[fd])
            if i >= warmup:
                times.append((time.perf_counter() - t) * 1e3)
    finally:
        ep.close()
    return times


def lean_client(ctl, cells: int, warmup: int) -> list[float]:
    """Round trips (ms) of ``x = 1`` to every rank, sent and read on the controller's own data
    sockets with nothing else done; monarch-nb's engines answer."""
    conns = {ctl._links[r].conn.fileno(): ctl._links[r].conn for r in range(ctl.world_size)}

    def frame_for(i: int) -> bytes:
        msg = {"op": "execute", "code": "x = 1", "n": 1_000_000 + i, "id": new_id("execute")}
        data = pickle.dumps(msg, protocol=5)
        return HEADER.pack(len(data)) + data

    def answered(sock) -> int:
        batches = conns[sock.fileno()].feed() or []
        return sum(ev["ev"] == "done" for batch in batches for ev in batch)

    with ctl._reader.borrow():
        return _rounds([c.sock for c in conns.values()], frame_for, answered, cells, warmup)


def _serve_minimal(engine) -> str:
    """On a rank (through ``ctl.call``): a thread that serves one connection on a Unix-domain
    socket, running each request's code in a namespace of its own; its abstract name."""
    import os
    import threading

    name = f"monarch-nb-exec-floor-{os.getpid()}-{threading.get_ident()}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind("\0" + name)
    server.listen(1)

    def serve() -> None:
        conn, _ = server.accept()
        server.close()
        namespace: dict = {}
        buf = b""
        with conn:
            while data := conn.recv(65536):
                buf += data
                while len(buf) >= HEADER.size:
                    (n,) = HEADER.unpack_from(buf)
                    if len(buf) < HEADER.size + n:
                        break
                    msg = pickle.loads(buf[HEADER.size : HEADER.size + n])
                    buf = buf[HEADER.size + n :]
                    exec(compile(msg["code"], "<cell>", "exec"), namespace)
                    reply = pickle.dumps([{"ev": "done", "id": msg["id"], "status": "ok"}])
                    conn.sendall(HEADER.pack(len(reply)) + reply)

    threading.Thread(target=serve, name="monarch-exec-floor", daemon=True).start()
    return name


def exec_floor(ctl, cells: int, warmup: int) -> list[float]:
    """Round trips (ms) of ``x = 1`` to a minimal server in each rank's worker process."""
    socks = []
    try:
        for name in ctl.call(_serve_minimal).values():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect("\0" + name)
            socks.append(s)

        def frame_for(i: int) -> bytes:
            data = pickle.dumps({"op": "execute", "code": "x = 1", "id": f"floor-{i}"})
            return HEADER.pack(len(data)) + data

        def answered(sock) -> int:
            if not sock.recv(65536):  # one small reply per request, read whole
                raise ConnectionError("a rank's minimal server closed its connection")
            return 1

        return _rounds(socks, frame_for, answered, cells, warmup)
    finally:
        for s in socks:
            s.close()
