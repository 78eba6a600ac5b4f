"""Each rank's clock against the controller's, for a profiled cell's timeline.

torch's traces count Unix time (``CLOCK_REALTIME``). A rank on the controller's host reads the
same kernel clock as the controller: its offset is 0, exactly, and measuring it would only add
the error of the measure. A rank on another host is asked for its time ROUNDS times, as NTP
asks: with ``t0`` and ``t2`` the controller's clock before the ask and after the answer and
``t1`` the rank's, the offset is ``(t0 + t2) / 2 - t1``, right within half the round trip;
the round with the shortest trip is kept.
"""

from __future__ import annotations

import socket
import time

ROUNDS = 5


def offsets(ctl, ranks: list[int]) -> dict[int, tuple[int, int]]:
    """rank -> (offset_ns, error_ns): add the offset to the rank's clock to read the
    controller's. Ranks that cannot be asked (lost, gone) are left out."""
    here = socket.gethostname()
    far = [r for r in ranks if ctl._known.get(r, {}).get("host") != here]
    found = {r: (0, 0) for r in ranks if r not in far}
    if not far:
        return found
    best: dict[int, tuple[int, int]] = {}
    for _ in range(ROUNDS):
        t0 = time.time_ns()
        try:
            answers = ctl.call(_now, targets=far)
        except Exception:  # a rank gone since the cell: its trace is drawn unaligned
            break
        t2 = time.time_ns()
        for rank, t1 in answers.items():
            error = (t2 - t0) // 2
            if rank not in best or error < best[rank][1]:
                best[rank] = ((t0 + t2) // 2 - t1, error)
    return {**found, **best}


def _now(engine) -> int:
    return time.time_ns()
