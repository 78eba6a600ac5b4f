"""How much of the notebook thread's CPU per trivial cell goes to sending the request, on a live
cluster: every ``Link.send`` (one per rank) is timed with ``time.thread_time``, which counts the
kernel's work in the send (copying the frame, waking the rank's engine) as the sender's. The
rest is reading the replies, routing and gathering them, and monarch-nb's own bookkeeping.

    python benchmarks/controller_sends.py                 # 8 and 64 ranks
    python benchmarks/controller_sends.py --ranks 2 16 --cells 500
"""

from __future__ import annotations

import argparse
import os
import time

import machine

import monarch_nb
from monarch_nb.dispatch import links


class SendClock:
    """``Link.send`` wrapped: the CPU seconds its calls took, and how many there were."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0
        self._send = links.Link.send

    def __enter__(self):
        send, clock = self._send, self

        def timed(link, msg, framed=None):
            began = time.thread_time()
            send(link, msg, framed)
            clock.seconds += time.thread_time() - began
            clock.calls += 1

        links.Link.send = timed
        return self

    def __exit__(self, *exc):
        links.Link.send = self._send


def measure(n: int, cells: int, warmup: int) -> tuple[float, float]:
    """(the notebook thread's CPU per cell, of which sending) in seconds, at ``n`` ranks."""
    ctl = monarch_nb.up(workers=n, cpu=True, dist=False, current=False)
    try:
        for _ in range(warmup):
            ctl.run("1")
        with SendClock() as sends:
            began = time.thread_time()
            for _ in range(cells):
                ctl.run("1")
            used = time.thread_time() - began
        assert sends.calls == n * cells, (sends.calls, n, cells)
        return used / cells, sends.seconds / cells
    finally:
        ctl.down()


def main(args) -> None:
    rows = {n: measure(n, args.cells, args.warmup) for n in args.ranks}
    lines = [
        "the notebook thread's CPU per trivial cell, and the part that sends the request",
        f"machine: {machine.cpu()}; load average (1 min) after: {os.getloadavg()[0]:.2f}",
        f"CPU ranks, one process each; {args.cells} cells after {args.warmup} warm-up; us",
        "",
        f"{'ranks':>5}  {'per cell':>8}  {'sending':>7}  {'sending a rank':>14}",
    ]
    for n, (whole, send) in rows.items():
        lines.append(f"{n:>5}  {whole * 1e6:>8.0f}  {send * 1e6:>7.0f}  {send / n * 1e6:>14.2f}")
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
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse())
