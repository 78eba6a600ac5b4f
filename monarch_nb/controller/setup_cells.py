"""The cells run with ``%%monarch --setup`` (imports, the model's and the data's definitions),
run again on every rank that joins later: the replacement of a lost worker (attach.py, and
healing.py within a fault-tolerant cell) and the ranks ``%monarch scale`` adds (scale.py), so
that a new rank's namespace has what the others' had before their training cells."""

from __future__ import annotations

import contextlib
import queue
import time
from typing import TYPE_CHECKING, Any

from monarch_nb.dispatch import dispatch
from monarch_nb.dispatch.gathering import why
from monarch_nb.dispatch.reader import next_event
from monarch_nb.dispatch.targets import format_ranks

if TYPE_CHECKING:
    from monarch_nb.controller.controller import Controller

SETUP_CELL_TIMEOUT = 300.0  # seconds a replayed cell may take (importing torch, loading data)


def remember(ctl: Controller, msg: dict[str, Any]) -> None:
    """Keep a ``--setup`` cell that ran on every rank, to run on the ranks that join later."""
    ctl.setup_cells.append({k: msg[k] for k in ("code", "source") if k in msg})


def replay(ctl: Controller, ranks: list[int]) -> str | None:
    """Run the ``--setup`` cells, in their order, on ``ranks`` (ranks that just joined), their
    output not shown; what went wrong, in one line, or None."""
    for i, cell in enumerate(list(ctl.setup_cells), 1):
        msg = {"op": "execute", **cell, "n": next(ctl._cells)}
        req = dispatch.submit(ctl, "execute", ranks, msg)
        outcomes = _wait(req, time.monotonic() + SETUP_CELL_TIMEOUT)
        for rank in ranks:
            ev = outcomes.get(rank)
            if ev is None:
                dispatch.send_interrupt(ctl, [rank], req.id)
                return (
                    f"--setup cell {i} of {len(ctl.setup_cells)} did not finish on rank {rank} "
                    f"within {SETUP_CELL_TIMEOUT:.0f} s; it was interrupted"
                )
            if ev["status"] != "ok":
                return (
                    f"--setup cell {i} of {len(ctl.setup_cells)} failed on rank {rank}: {why(ev)}"
                )
    return None


def replay_or_say(ctl: Controller, ranks: list[int]) -> None:
    """``replay``, its failure told as a notice (the ranks stay, without the rest)."""
    if not ctl.setup_cells:
        return
    problem = replay(ctl, ranks)
    if problem is None:
        n = len(ctl.setup_cells)
        ctl._notice(f"{format_ranks(ranks)}: the {n} --setup cell{'s' * (n != 1)} ran again there")
    else:
        ctl._notice(f"{format_ranks(ranks)}: {problem}")


def _wait(req, deadline: float) -> dict[int, dict]:
    """The outcomes of ``req`` by ``deadline``; its output is dropped."""
    outcomes: dict[int, dict] = {}
    while len(outcomes) < len(req.ranks):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        with contextlib.suppress(queue.Empty):
            rank, ev = next_event(req.events, min(left, 0.5))
            if ev["ev"] == "done":
                outcomes[rank] = ev
    return outcomes
