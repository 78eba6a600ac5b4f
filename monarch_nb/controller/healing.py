"""A fault-tolerant cell (``ft.steps`` on a cluster started with ``--ft``) that loses a rank
goes on: the survivors step with fewer participants (torchft), and the notebook brings the
rank back into the same cell.

A rank's first ``ft`` event (rank/ft.py: its committed step and quorum) marks it as training
fault-tolerantly in this cell. When such a rank's worker dies while others of the cell still
run, the request does not end on it (``Request.on_lost``): the cell prints one line
(``rank 2 lost at step 57; 3 of 4 go on``) and, once the nanny's replacement worker has
attached (attach.py, which leaves the process group to be formed after the cell), this module
runs the ``--setup`` cells on it and then the cell itself, under the same request: its events
and its value join the others'. Its first quorum heals it from a live peer (torchft's
checkpoint transport), and it finishes the loop with them. Every step of that is an event of
``ft.history()`` and of the panel.

A rank whose cell never reached ``ft.steps``, or the last rank of the cell, ends as lost as in
any cell (with the ranks still waiting for a replacement: nobody is left to heal from).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from monarch_nb.controller import setup_cells
from monarch_nb.controller.attach import REPLACE_TIMEOUT

if TYPE_CHECKING:
    from monarch_nb.controller.controller import Controller
    from monarch_nb.dispatch.links import Request


class Healing:
    """The ``on_lost`` and ``on_ft`` hooks of one fault-tolerant cell's request."""

    def __init__(self, ctl: Controller, req: Request, msg: dict[str, Any]):
        self.ctl, self.req, self.msg = ctl, req, msg
        self.training: set[int] = set()  # ranks that reported an ft step in this cell
        self.steps: dict[int, int] = {}  # each rank's last committed step
        self.away: dict[int, str] = {}  # rank -> "lost" / "joining" / "healing"
        self.finished: set[int] = set()  # ranks done with the loop (or given up on)
        self.given_up = False  # no survivor left: the ranks away end as lost
        self._turns: dict[int, int] = {}  # rank -> how many times it was lost in this cell
        self._lock = threading.Lock()
        req.on_lost, req.on_ft = self.on_lost, self.on_ft
        self._tell()  # which ranks the loop's first quorum waits for (rank/ft.py)

    # -- on the event loop ---------------------------------------------------------------------
    def on_ft(self, rank: int, ev: dict[str, Any]) -> None:
        with self._lock:
            tell = not self.training or (ev.get("done") and rank not in self.finished)
            if ev.get("done"):
                self.finished.add(rank)
            self.training.add(rank)
            self.steps[rank] = ev["step"]
            state = self.away.get(rank)
            if state == "joining" and ev["healing"]:
                self.away[rank] = "healing"
                self._record("healing", rank, ev)
            elif state in ("joining", "healing") and not ev["healing"]:
                del self.away[rank]
                self._record("back", rank, ev)
                tell = True
                self._say(
                    rank, f"rank {rank} is back at step {ev['step']}, healed from a live peer"
                )
        if tell:
            self._tell()  # outside the lock, which _tell takes
        self.ctl.ft_steps.append((time.time(), ev["step"], ev["participants"]))
        quorum = self.ctl.ft_quorum
        if ev["quorum"] >= quorum.get("quorum", -1):
            quorum.update(
                quorum=ev["quorum"],
                participants=ev["participants"],
                step=max(ev["step"], quorum.get("step", 0)),
                ranks=sorted(r for r in self.training if r not in self.away),
            )

    def on_lost(self, rank: int, why: str) -> bool:
        """Whether the request goes on without ``rank`` (True: it will be brought back)."""
        with self._lock:
            if self.given_up or rank not in self.training:
                return False
            others = [r for r in self.req.ranks if r in self.req.remaining and r != rank]
            survivors = [r for r in others if r not in self.away]
            if not survivors:
                self.given_up = True
                waiting = [r for r in self.away if r in self.req.remaining]
            else:
                step = max(self.steps.get(r, 0) for r in survivors)
                again = rank in self.away  # its replacement, lost while it rejoined
                self.away[rank] = "lost"
                waiting = None
        if waiting is not None:
            for r in waiting:
                self._end(r, "lost with every other rank of the cell: no live peer to heal from")
            return False
        who = f"rank {rank}'s replacement" if again else f"rank {rank}"
        self._say(
            rank, f"{who} lost at step {step}; {len(survivors)} of {len(self.req.ranks)} go on"
        )
        self._record("lost", rank, {"step": step, "participants": len(survivors)})
        self._tell(lost=True)
        self.ctl.healing_ranks.add(rank)
        old = self.ctl.ranks[rank]
        with self._lock:
            turn = self._turns[rank] = self._turns.get(rank, 0) + 1
        threading.Thread(
            target=self._bring_back,
            args=(rank, old, turn),
            daemon=True,
            name=f"monarch-heal-{rank}",
        ).start()
        return True

    # -- on the rank's own thread --------------------------------------------------------------
    def _bring_back(self, rank: int, old, turn: int) -> None:
        ctl = self.ctl
        try:
            deadline = time.monotonic() + REPLACE_TIMEOUT
            while not self._replaced(rank, old):
                if ctl.closed or time.monotonic() > deadline:
                    if not self.given_up:
                        self._end(rank, f"no replacement worker joined within {REPLACE_TIMEOUT} s")
                    return
                time.sleep(0.05)
            with self._lock:
                if self._turns[rank] != turn:
                    return  # lost again as it attached: the next turn brings it back
            if not self.given_up:
                with self._lock:
                    self.away[rank] = "joining"
                self._record("joining", rank, {"step": None, "participants": None})
            # Every replacement gets them, for the cells after this one too.
            info = ctl.rejoined[rank]
            problem = setup_cells.replay(ctl, [rank]) if ctl.setup_cells else None
            if not info.alive:
                return  # lost in its turn: on_lost brings the next one back
            if self.given_up:
                ctl._notice(
                    f"rank {rank}: a replacement worker took its place; "
                    + (
                        problem
                        or (
                            "the --setup cells ran there"
                            if ctl.setup_cells
                            else "its namespace is empty"
                        )
                    )
                )
                return
            if problem is not None:
                self._end(rank, f"its replacement could not rejoin: {problem}")
                return
            link = ctl._links.get(rank)
            if link is None or rank not in self.req.remaining:
                return
            with self._lock:
                others = [r for r in self.req.ranks if r != rank and r not in self.away]
                floor = max((self.steps.get(r, 0) for r in others), default=0)
                pending = [r for r in self.req.ranks if r not in self.finished]
            # where its first quorum must heal it to, before the cell (on the control comm,
            # which it reads at once; the cell waits behind its --setup cells and ft.wrap)
            told = {"op": "ft", "id": self.req.id, "ranks": pending, "at_least": floor}
            ctl._loop.call_soon_threadsafe(link.control, told)
            link.send({**self.msg, "id": self.req.id})  # the cell, as the others run it
        finally:
            with self._lock:
                if self._turns[rank] == turn:  # not lost again meanwhile: nobody else brings it
                    ctl.healing_ranks.discard(rank)

    def _replaced(self, rank: int, old) -> bool:
        """Whether ``rank``'s replacement has attached, its synced code sent (attach.py)."""
        info = self.ctl.rejoined.get(rank)
        return info is not None and info is not old and info.alive

    def _end(self, rank: int, why: str) -> None:
        """``rank`` ends the cell as lost, releasing nobody (the others train on)."""
        with self._lock:
            self.away.pop(rank, None)
            self.finished.add(rank)  # nobody waits for it any more
        self._tell()
        self.ctl._router.deliver(
            rank,
            {"ev": "done", "id": self.req.id, "status": "lost", "why": why, "no_release": True},
        )

    def _tell(self, lost: bool = False) -> None:
        """Tell the cell's ranks which of them have yet to finish its loop (those away too): one
        whose loop is done keeps answering quorums until they have been in one with it, to heal
        from (rank/ft.py). At the first report, and whenever that changes; ``lost``: a rank
        was just lost, and the others' torchft groups are cut, to fail at once a collective
        that waits on one that waits on the lost rank."""
        with self._lock:
            pending = [r for r in self.req.ranks if r not in self.finished]
            away = set(self.away)
        msg = {"op": "ft", "id": self.req.id, "ranks": pending, "lost": lost}
        for rank in pending:
            link = self.ctl._links.get(rank)
            if link is not None and rank not in away:
                self.ctl._loop.call_soon_threadsafe(link.control, msg)

    def _say(self, rank: int, line: str) -> None:
        """A line in the cell's output, tagged with ``rank``."""
        self.req.events.put((rank, {"ev": "stream", "name": "stderr", "lines": [line]}))

    def _record(self, event: str, rank: int, ev: dict[str, Any]) -> None:
        self.ctl.ft_events.append(
            {
                "time": time.time(),
                "rank": rank,
                "event": event,
                "step": ev.get("step"),
                "participants": ev.get("participants"),
            }
        )
