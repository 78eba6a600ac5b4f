"""A stand-in for one host's ranks (issue 52's simulation): one process holds K ranks' sockets
and answers the controller as a real engine (monarch_nb/rank/engine.py, engine_io.py) does.

Each rank has what a worker gives its engine: a Dask comm listener whose ``monarch_attach``
sends the hello (where the data path listens, and a token) and then obeys ``info`` and
``interrupt``; and the data listeners (wire.Listeners: TCP, and a Unix-domain socket for a
controller on this host) that take the controller's data connection, the relay's, and
``interrupt_here``'s, each checked by its first frame (controller id and token). The product's
own code does the framing (wire.FrameConn), the replies (engine_io.Channel: a second copy of a
resent cell dropped, events sent as a list per frame, kept behind a host relay until the
controller acknowledges them and sent again on its resume) and the cells (rank/cells.py: compiled,
run in the rank's namespace, the last expression's value pickled, an exception formatted).

What it leaves out: the rank's own thread and process (the ranks' cells run one after another
on this process's event loop, so a cell that sleeps holds up every rank of the host, as a C
call holding the GIL would, and K ranks' replies leave from one process, not K), what cells
print as it goes (a cell's lines are sent when it ends), ``call`` requests (answered with an
error), the control comm's ``stacks``, ``comm`` and ``ft`` (not answered), the handshake's
timeout and the peer-credential check of the Unix socket, TLS, torch and devices.

    python benchmarks/fanout_standin.py --ranks 16 [--host 10.77.3.2] [--tcp-only | --far]

It prints one JSON line, ``{"pid": ..., "addresses": [...]}`` (the ranks' Dask addresses), and
then reads commands on stdin: ``garbage I`` writes a malformed frame to the controller on its
I-th rank's data connection (a faithful engine never would: the harness's fault); ``heard KEY``
prints how many of its ranks an interrupt (by its key) reached, and when the last of them
first heard it, as a JSON line. It exits when stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import io
import json
import os
import secrets
import socket
import sys
import time
from typing import Any

from distributed.comm import CommClosedError, listen

from monarch_nb.rank.cells import compile_cell, format_error, pack, plain_error
from monarch_nb.rank.engine_io import Channel
from monarch_nb.wire import HEADER, MAX_HANDSHAKE, FrameConn, Listeners

MAX_CANCELLED = 1024  # as engine.py: ids of interrupted-before-they-ran requests remembered
# Eight bytes that claim three, then three that are no pickle: what "garbage" sends
GARBAGE = HEADER.pack(3) + b"\xff\x00\xff"


class Rank:
    """One rank: its control listener, data listeners, channels (one per controller) and
    namespace."""

    def __init__(self, host: str, tcp_only: bool, far: bool = False):
        self.host = host
        self.far = far
        self.hostname = socket.gethostname()
        # ssl_context None: TCP plus the Unix-domain socket, as a worker without TLS listens
        self.listeners = Listeners(host, None)
        if tcp_only:  # as a rank on another host: the controller can only reach it by TCP
            self.listeners.local.close()
            self.listeners.local = self.listeners.local_name = None
        self.token = secrets.token_hex(16)
        self.channels: dict[str, Channel] = {}
        self.identity: dict[str, Any] = {}
        self.namespace: dict[str, Any] = {"__name__": "__main__"}
        self.cancelled: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.current: str | None = None
        self.heard: dict[str | None, float] = {}  # interrupt key -> when it first arrived
        self.printed: list[str] = []  # the running cell's lines
        self.control = None
        self.address = ""

    async def start(self) -> None:
        self.control = listen(f"tcp://{self.host}:0", self.attach, deserialize=True)
        await self.control.start()
        self.address = self.control.contact_address
        loop = asyncio.get_running_loop()
        for sock in (self.listeners.tcp, self.listeners.local):
            if sock is not None:
                sock.setblocking(False)
                loop.add_reader(sock.fileno(), self._accept, sock)

    def poke(self) -> None:
        """The Outbox's wake-up for printed output (engine_io.Wire.poke): none is captured."""

    # -- the control comm (Engine.attach) --------------------------------------------------------
    async def attach(self, comm) -> None:
        """A comm from ``links.Link.open``: its first message names the handler and the
        controller, as Dask's Server would hand it to ``Engine.attach``."""
        try:
            msg = await comm.read()
            if not isinstance(msg, dict) or msg.get("op") != "monarch_attach":
                comm.abort()
                return
            controller = msg["controller"]
            old = self.channels.pop(controller, None)
            if old is not None:
                self.close_channel(old)
            channel = self.channels[controller] = Channel(self, controller, comm)
            hello = {**self.listeners.hello(), "token": self.token}
            if self.far:  # its socket is for its host's processes (a relay), not the controller
                hello["uid"] = -1
            await comm.write(hello)
            try:
                while True:
                    for m in await comm.read():
                        self.control_msg(channel, m)
            finally:
                self.close_channel(channel)
        except (CommClosedError, OSError):
            pass

    def close_channel(self, channel: Channel) -> None:
        channel.closed = True
        if self.channels.get(channel.controller) is channel:
            del self.channels[channel.controller]
        if channel.conn is not None:
            channel.conn.shutdown()

    def control_msg(self, channel: Channel, msg: dict[str, Any]) -> None:
        if msg["op"] == "interrupt":
            self.interrupt(msg)
        elif msg["op"] == "info":
            info = self.info(msg.get("about"))
            channel.reply({"ev": "done", "id": msg["id"], "status": "ok", "info": info})

    def interrupt(self, msg: dict[str, Any]) -> None:
        """No cell runs while this loop reads an interrupt (they run on it): one aimed at a
        request still to come drops it when it comes, as the engine's does. When each press
        (its key) first arrived, by whichever path, is kept for the harness (``heard``)."""
        self.heard.setdefault(msg.get("key"), time.time())
        while len(self.heard) > MAX_CANCELLED:
            self.heard.pop(next(iter(self.heard)))
        target = msg.get("target")
        if target is not None and target != self.current:
            self.cancelled[target] = None
            while len(self.cancelled) > MAX_CANCELLED:
                self.cancelled.popitem(last=False)

    def info(self, about: str | None = None) -> dict[str, Any]:
        """``Engine.info``'s keys, with what a stand-in has to say."""
        state = None
        if about is not None:
            state = "cancelled" if about in self.cancelled else "unknown"
        names = [k for k in self.namespace if not k.startswith("_")]
        return {
            "about": state,
            **self.identity,
            "pid": os.getpid(),
            "host": self.hostname,
            "device": {"kind": "stand-in"},
            "busy_since": None,
            "current": self.current,
            "hit": None,
            "queued": 0,
            "names": len(names),
            "collectives": [],
            "labels": {},
        }

    # -- the data path (engine_io.Wire) ---------------------------------------------------------
    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(True)  # FrameConn reads without blocking (MSG_DONTWAIT) by itself
        conn = FrameConn(sock)
        asyncio.get_running_loop().add_reader(conn.fileno(), self._readable, conn, [None])

    def _readable(self, conn: FrameConn, known: list[Channel | None]) -> None:
        """``known[0]``: the channel the connection's hello named, once it has said it."""
        try:
            msgs = conn.feed(None if known[0] else MAX_HANDSHAKE)
        except (OSError, ValueError, EOFError):
            msgs = None
        if msgs and known[0] is None:
            known[0] = self._hello(conn, msgs[0])
            # what came behind the hello is read only once the hello is checked (wire.py)
            msgs = None if known[0] is None else list(conn.backlog)
            if msgs is not None:
                conn.backlog.clear()
        if msgs is None:
            self._drop(conn, known[0])
            return
        channel = known[0]
        for msg in msgs:
            if channel.fresh(msg):
                self.request(channel, msg)

    def _hello(self, conn: FrameConn, hello: Any) -> Channel | None:
        """``Wire._hello``: the channel of a valid hello, or None (the connection is refused,
        or was an interrupt, now obeyed)."""
        channel = self.channels.get(hello.get("controller")) if isinstance(hello, dict) else None
        if channel is None or hello.get("token") != self.token:
            return None
        if isinstance(hello.get("interrupt"), dict):
            self.interrupt(hello["interrupt"])
            return None
        if "ack" in hello:  # what the controller read through the host relay
            if channel.retained is not None:
                channel.retained.acked(int(hello["ack"]))
            return None
        if "resume" in hello:  # the host relay ended: the controller is here directly
            return channel if channel.resume(conn, int(hello["resume"])) else None
        if not hello.get("relay"):
            channel.attach(conn, retain=bool(hello.get("retain")))
        return channel

    def _drop(self, conn: FrameConn, channel: Channel | None) -> None:
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(conn.fileno())
        if channel is not None:
            channel.ended(conn)
        conn.close()

    def garbage(self) -> None:
        """A malformed frame to every controller on its data connection."""
        for channel in list(self.channels.values()):
            if channel.conn is not None:
                with channel.lock:
                    channel.conn.sock.sendall(GARBAGE)

    # -- requests (Engine._handle) --------------------------------------------------------------
    def request(self, channel: Channel, msg: dict[str, Any]) -> None:
        if msg["op"] == "input_reply":
            return
        cid = msg["id"]
        if cid in self.cancelled:
            self.cancelled.pop(cid)
            channel.reply({"ev": "done", "id": cid, "status": "cancelled"})
            return
        self.current = cid
        try:
            reply = self.run_op(msg)
        except Exception as e:
            reply = {"status": "error", "error": format_error(e)}
        finally:
            self.current = None
        if self.printed:  # as the engine's Outbox sends them: lines, then the end
            lines, self.printed = self.printed, []
            channel.reply({"ev": "stream", "id": cid, "name": "stdout", "lines": lines})
        channel.reply({"ev": "done", "id": cid, **reply})

    def run_op(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg["op"]
        if op == "execute":
            self.namespace.update(self.identity)
            return self.execute(msg)
        if op == "setup":
            self.identity = {k: msg[k] for k in ("rank", "world_size", "local_rank")}
            self.identity["host"] = self.hostname
            self.namespace.update(self.identity)
            return {"status": "ok", "info": self.info()}
        if op == "call":
            return {"status": "error", "error": plain_error("the stand-in runs no calls")}
        return {"status": "error", "error": plain_error(f"unknown op {op!r}")}

    def execute(self, msg: dict[str, Any]) -> dict[str, Any]:
        """``Engine._execute`` without autoreload and the profiler; what it prints is sent as
        whole lines after it (the engine's go as they are printed)."""
        body, expr, silent = compile_cell(msg)
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                eval(body, self.namespace)
                value = eval(expr, self.namespace) if expr is not None else None
        except Exception as e:
            return {"status": "error", "error": format_error(e)}
        finally:
            self.printed = out.getvalue().splitlines()
        if expr is None or silent:
            return {"status": "ok"}
        return {"status": "ok", **pack(value)}


async def serve(ranks: int, host: str, tcp_only: bool, far: bool) -> None:
    standins = [Rank(host, tcp_only, far) for _ in range(ranks)]
    for r in standins:
        await r.start()
    said = {"pid": os.getpid(), "addresses": [r.address for r in standins]}
    print(json.dumps(said), flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        words = line.decode().split()
        if len(words) == 2 and words[0] == "garbage":
            standins[int(words[1])].garbage()
        elif len(words) == 2 and words[0] == "heard":  # an interrupt's key: who has it, when
            times = [r.heard[words[1]] for r in standins if words[1] in r.heard]
            print(json.dumps({"ranks": len(times), "last": max(times, default=None)}), flush=True)
    # stdin closed: whoever started the stand-in is gone, and its ranks go with it


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, required=True, help="ranks this process stands in for")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--tcp-only", action="store_true", help="no Unix-domain socket (a far host)")
    p.add_argument(
        "--far",
        action="store_true",
        help="a far host on this machine: the controller is told a Unix-domain socket it may "
        "not use (another user's), so it uses TCP, and only a relay started here uses it",
    )
    args = p.parse_args(argv)
    asyncio.run(serve(args.ranks, args.host, args.tcp_only, args.far))


if __name__ == "__main__":
    main()
