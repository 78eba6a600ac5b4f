"""``%monarch status``: a row per rank from what the rank answers on its event loop (also while
a cell runs), or, for a rank that does not answer, what it last said about itself."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from monarch_nb.dispatch import dispatch, unanswered

if TYPE_CHECKING:
    from monarch_nb.controller.controller import Controller


def rows(ctl: Controller) -> list[dict[str, Any]]:
    alive = [i.rank for i in ctl.ranks if i.alive]
    for rank in alive:
        # A worker stopped on this machine (SIGSTOP, Ctrl-Z) cannot answer: read from /proc,
        # its rank gets the short wait of one that did not answer last time (SILENT_WAIT), not
        # the whole one, on the first status too. Let go on, it answers within that wait.
        known = ctl._known.get(rank, {})
        if unanswered.process_state(known.get("pid"), known.get("host")) == "stopped":
            ctl.unanswering.add(rank)
    outcomes = dispatch.rank_info(ctl, alive, timeout=2)
    table = []
    now = time.time()
    for info in ctl.ranks:
        ev = outcomes.get(info.rank)
        if ev is None or ev.get("status") != "ok":
            known = ctl._known.get(info.rank, {})
            silent = info.alive and info.rank in ctl.unanswering
            table.append(
                {
                    "rank": info.rank,
                    "host": known.get("host", info.host),
                    "pid": known.get("pid") if silent else None,
                    "device": known.get("device", {}),
                    "state": "not answering" if silent else "dead",
                    "names": None,
                    "labels": known.get("labels", {}),
                }
            )
            continue
        i = ev["info"]
        since = i["busy_since"]
        state = "idle" if since is None else f"busy {now - since:.1f} s"
        table.append(
            {
                "rank": info.rank,
                "host": i["host"],
                "pid": i["pid"],
                "device": i["device"],
                "state": state,
                "names": i["names"],
                "labels": i.get("labels", {}),
            }
        )
    return table
