"""How much of the notebook thread's CPU per trivial cell goes to sending the request, on a live
cluster: every ``Link.send`` (one per rank) and ``Relay.forward`` (one per request, from
relaying.RELAY_FROM ranks) is timed with ``time.thread_time``, which counts the kernel's work
in the send (copying the frame, waking the reader) as the sender's. The rest is reading the
replies, routing and gathering them, and monarch-nb's own bookkeeping. ``--no-relay`` sends to
every rank directly, as below RELAY_FROM ranks.

    python benchmarks/controller_sends.py                 # 8 and 64 ranks
    python benchmarks/controller_sends.py --ranks 2 16 --cells 500
    python benchmarks/controller_sends.py --no-relay
"""

from __future__ import annotations

import argparse
import os
import time

import machine

import monarch_nb
from monarch_nb.dispatch import links, relaying

SENDS = ((links.Link, "send"), (relaying.Relay, "forward"))


class SendClock:
    """``Link.send`` and ``Relay.forward`` wrapped: the CPU seconds their calls took, and how
    many there were."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0
        self._kept = [(cls, name, getattr(cls, name)) for cls, name in SENDS]

    def __enter__(self):
        for cls, name, send in self._kept:
            setattr(cls, name, self._timed(send))
        return self

    def _timed(self, send):
        def timed(*args):
            began = time.thread_time()
            try:
                return send(*args)
            finally:
                self.seconds += time.thread_time() - began
                self.calls += 1

        return timed

    def __exit__(self, *exc):
        for cls, name, send in self._kept:
            setattr(cls, name, send)


def measure(n: int, cells: int, warmup: int) -> tuple[float, float, float]:
    """(the notebook thread's CPU per cell, of which sending) in seconds, and the messages it
    wrote per cell, at ``n`` ranks."""
    ctl = monarch_nb.up(workers=n, cpu=True, dist=False, current=False)
    try:
        for _ in range(warmup):
            ctl.run("1")
        with SendClock() as sends:
            began = time.thread_time()
            for _ in range(cells):
                ctl.run("1")
            used = time.thread_time() - began
        return used / cells, sends.seconds / cells, sends.calls / cells
    finally:
        ctl.down()


def main(args) -> None:
    if args.no_relay:
        relaying.RELAY_FROM = 1 << 30
    rows = {n: measure(n, args.cells, args.warmup) for n in args.ranks}
    how = "every rank directly" if args.no_relay else f"relayed from {relaying.RELAY_FROM} ranks"
    lines = [
        f"the notebook thread's CPU per trivial cell, and the part that sends the request ({how})",
        f"machine: {machine.cpu()}; load average (1 min) after: {os.getloadavg()[0]:.2f}",
        f"CPU ranks, one process each; {args.cells} cells after {args.warmup} warm-up; us",
        "",
        f"{'ranks':>5}  {'per cell':>8}  {'sending':>7}  {'sending a rank':>14}  {'messages':>8}",
    ]
    for n, (whole, send, calls) in rows.items():
        lines.append(
            f"{n:>5}  {whole * 1e6:>8.0f}  {send * 1e6:>7.0f}  {send / n * 1e6:>14.2f}"
            f"  {calls:>8.0f}"
        )
    lo, hi = min(rows), max(rows)
    if hi > lo:
        whole = (rows[hi][0] - rows[lo][0]) / (hi - lo)
        send = (rows[hi][1] - rows[lo][1]) / (hi - lo)
        lines.append(
            f"per added rank ({lo} -> {hi}): {whole * 1e6:.1f} us, "
            f"of which sending {send * 1e6:.1f} us"
        )
    print("\n".join(lines))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    p.add_argument("--cells", type=int, default=300, help="timed trivial cells per size")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--no-relay", action="store_true", help="send to every rank directly")
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse())
