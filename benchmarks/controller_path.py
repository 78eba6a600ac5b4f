"""The controller's own work per rank for one trivial request, without rank processes: N
socketpairs stand for N ranks, each rank's reply is written before the request is sent, and the
notebook's thread submits, reads, routes, gathers and settles through the controller's real
Reader, Router and links (a Controller's other parts are not needed for this). Only that
thread's CPU time is counted (``time.thread_time``), so other processes on the machine barely
move it, unlike a cluster's round trip; what it leaves out is the ranks' wake-ups, which a
socket send to a waiting process costs the sender in the kernel. The socketpairs' own sends
and reads, timed alone, are taken off.

    python benchmarks/controller_path.py                 # 2 and 64 ranks
    PYTHONPATH=../other-tree python benchmarks/controller_path.py   # another version's
"""

from __future__ import annotations

import argparse
import pickle
import socket
import time
import timeit
from types import SimpleNamespace

import cloudpickle
import machine

from monarch_nb.dispatch import dispatch, gathering, links
from monarch_nb.dispatch.output import Renderer
from monarch_nb.dispatch.reader import Reader
from monarch_nb.wire import HEADER, FrameConn


def setup(n: int):
    """A controller's reading parts with ``n`` links, and the far end of each."""
    router = links.Router()
    ctl = SimpleNamespace(_router=router, _reader=Reader(router), _links={})
    peers = []
    for rank in range(n):
        near, far = socket.socketpair()
        link = links.Link(links.RankInfo(rank, rank, f"rank-{rank}", "here"), router)
        link.conn = FrameConn(near)
        ctl._links[rank] = link
        ctl._reader.add(link)
        peers.append(far)
    time.sleep(0.2)  # the Reader has taken the links in
    return ctl, peers


def request(ctl, peers: list[socket.socket], value: bytes) -> None:
    """One trivial request to every rank, its replies already waiting."""
    next_id = f"execute-{next(links._ids) + 1}-{links._PROCESS}"  # the one submit makes
    with ctl._reader.borrow(), gathering.sigint_sets() as stop:
        data = pickle.dumps([{"ev": "done", "id": next_id, "status": "ok", "value": value}])
        reply = HEADER.pack(len(data)) + data
        for peer in peers:
            peer.send(reply)
        ranks = list(range(len(peers)))
        req = dispatch.submit(ctl, "execute", ranks, {"op": "execute", "code": "1", "n": 1})
        outcomes = gathering.gather(req, Renderer(ranks), None, {}, stop)
    gathering.settle(ranks, dict.fromkeys(ranks, "here"), outcomes)
    for peer in peers:
        peer.recv(65536)  # what the controller sent


def sockets_only(ctl, peers: list[socket.socket]) -> None:
    """The socketpairs' sends and reads of ``request``, twice over, with nothing else."""
    frame = bytes(200)
    with ctl._reader.borrow():
        for rank, peer in enumerate(peers):
            ctl._links[rank].conn.sock.send(frame)
            peer.recv(65536)
            peer.send(frame)
            ctl._links[rank].conn.sock.recv(65536)


def per_request(fn, number: int) -> float:
    return min(timeit.Timer(fn, timer=time.thread_time).repeat(number=number, repeat=7)) / number


def main(args) -> None:
    value = cloudpickle.dumps(1)
    cost = {}
    for n in args.ranks:
        ctl, peers = setup(n)
        for _ in range(50):
            request(ctl, peers, value)
        whole = per_request(lambda: request(ctl, peers, value), args.number)  # noqa: B023
        floor = per_request(lambda: sockets_only(ctl, peers), args.number)  # noqa: B023
        cost[n] = whole - floor / 2
        ctl._reader.stop()
    lines = [
        "the controller's work per trivial request, without rank processes",
        f"machine: {machine.cpu()}",
        f"the notebook's thread's CPU, best of 7 x {args.number} requests; us",
        "",
        f"{'ranks':>5}  {'per request':>11}",
        *(f"{n:>5}  {cost[n] * 1e6:>11.1f}" for n in args.ranks),
    ]
    lo, hi = min(args.ranks), max(args.ranks)
    per_rank = (cost[hi] - cost[lo]) / (hi - lo)
    lines.append(f"per added rank: {per_rank * 1e6:.2f} us ({lo} -> {hi})")
    print("\n".join(lines))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 64])
    p.add_argument("--number", type=int, default=200, help="requests per timing")
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse())
