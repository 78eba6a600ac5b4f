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

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any

from monarch_nb.controller import dist, setup_cells
from monarch_nb.controller.attach import REPLACE_TIMEOUT
from monarch_nb.dispatch.targets import format_ranks

# seconds a rank of a sharded model that failed waits for the notebook to notice a lost rank of
# its group, which broke its collectives (a worker's death is noticed in about 0.05 s)
PEER_WAIT = 1.0

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
        # A sharded model's replica groups (rank/ft_hsdp.py), which are lost and come back as
        # one: each rank's group, as it reports it; the ranks the notebook killed because their
        # group lost a rank; and the workers each group's ranks had when they were lost.
        self.groups: dict[int, list[int]] = {}
        self.doomed: set[int] = set()
        self.old: dict[int, Any] = {}
        self._lock = threading.Lock()
        req.on_lost, req.on_ft, req.on_done = self.on_lost, self.on_ft, self.on_done
        self._tell()  # which ranks the loop's first quorum waits for (rank/ft.py)

    # -- on the event loop ---------------------------------------------------------------------
    def on_ft(self, rank: int, ev: dict[str, Any]) -> None:
        with self._lock:
            tell = not self.training or (ev.get("done") and rank not in self.finished)
            if ev.get("done"):
                self.finished.add(rank)
            self.training.add(rank)
            self.steps[rank] = ev["step"]
            self.groups[rank] = list(ev.get("group") or [rank])
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
            quiet = rank in self.doomed  # killed by the notebook with its group: already said
            self.doomed.discard(rank)
            # the others of its replica group go with it (a sharded model's: rank/ft_hsdp.py)
            partners = [
                r
                for r in self.groups.get(rank, [rank])
                if r != rank and r in self.req.remaining and r not in self.away
            ]
            others = [r for r in self.req.ranks if r in self.req.remaining and r != rank]
            survivors = [r for r in others if r not in self.away and r not in partners]
            if not survivors and not quiet:
                self.given_up = True
                waiting = [r for r in self.away if r in self.req.remaining]
            else:
                step = max((self.steps.get(r, 0) for r in survivors), default=0)
                again = rank in self.away and not quiet  # lost while it rejoined
                self.away[rank] = "lost"
                for r in partners:
                    self.away[r] = "lost"
                    self.doomed.add(r)
                waiting = None
        if waiting is not None:
            self._kill(partners)
            for r in waiting:
                self._end(r, "lost with every other rank of the cell: no live peer to heal from")
            return False
        if not quiet:
            who = f"rank {rank}'s replacement" if again else f"rank {rank}"
            group = self.groups.get(rank, [rank])
            also = f"; its replica group ({format_ranks(group)}) goes with it" if partners else ""
            self._say(
                rank,
                f"{who} lost at step {step}{also}; {len(survivors)} of {len(self.req.ranks)} go on",
            )
            for r in [rank, *partners]:
                self._record("lost", r, {"step": step, "participants": len(survivors)})
            self._tell(lost=True)
            self._kill(partners)
        self.ctl.healing_ranks.add(rank)
        old = self.old[rank] = self.ctl.ranks[rank]
        with self._lock:
            turn = self._turns[rank] = self._turns.get(rank, 0) + 1
        threading.Thread(
            target=self._bring_back,
            args=(rank, old, turn),
            daemon=True,
            name=f"monarch-heal-{rank}",
        ).start()
        return True

    def on_done(self, rank: int, ev: dict[str, Any]) -> bool:
        """Whether a rank's end is taken back (True: it is killed and brought back with its
        replica group): a rank of a sharded model that failed as a rank of its group was lost
        (its collectives with that rank broke), which may be noticed up to ``PEER_WAIT`` after."""
        if ev.get("status") != "error" or ev.get("checked"):
            return False
        with self._lock:
            group = self.groups.get(rank, [rank])
            if self.given_up or rank not in self.training or len(group) == 1:
                return False
        threading.Thread(
            target=self._fail_or_rejoin, args=(rank, ev), daemon=True, name="monarch-heal-peer"
        ).start()
        return True

    def _fail_or_rejoin(self, rank: int, ev: dict[str, Any]) -> None:
        deadline = time.monotonic() + PEER_WAIT
        while True:
            with self._lock:
                group = self.groups.get(rank, [rank])
                lost = any(self.away.get(r) == "lost" for r in group if r != rank)
                if lost and not self.given_up:
                    self.away[rank] = "lost"
                    self.doomed.add(rank)
            if lost and not self.given_up:
                self._kill([rank])  # its loss brings it back (on_lost)
                return
            if time.monotonic() > deadline or self.given_up:
                break
            time.sleep(0.02)
        # a failure of its own: the cell's, as in any cell
        self.ctl._loop.call_soon_threadsafe(self.ctl._router.deliver, rank, {**ev, "checked": True})

    def _kill(self, ranks: list[int]) -> None:
        """SIGKILL the workers of ``ranks``, from a thread of its own (this may be the event
        loop's, on which a Dask call would not be made)."""

        def kill() -> None:
            for r in ranks:
                with contextlib.suppress(Exception):  # gone already: its loss comes all the same
                    self.ctl.kill(r)

        if ranks:
            threading.Thread(target=kill, daemon=True, name="monarch-heal-kill").start()

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
            group = self.groups.get(rank, [rank])
            if len(group) > 1:
                # a replica group comes back as one, brought by its first rank's thread: its
                # own process group and mesh, over which the --setup cells shard the model
                if rank != group[0] or not self._group_back(group, deadline):
                    return
                problem = self._form_part(group)
            else:
                problem = None
            # Every replacement gets them, for the cells after this one too.
            infos = [ctl.rejoined[r] for r in group]
            if problem is None and ctl.setup_cells:
                problem = setup_cells.replay(ctl, group)
            if not all(info.alive for info in infos):
                return  # lost in its turn: on_lost brings the next one back
            if self.given_up:
                ctl._notice(
                    f"{format_ranks(group)}: a replacement worker took its place; "
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
                for r in group:
                    self._end(r, f"its replacement could not rejoin: {problem}")
                return
            for r in group:
                self._send_cell(r)
        finally:
            with self._lock:
                if self._turns[rank] == turn:  # not lost again meanwhile: nobody else brings it
                    ctl.healing_ranks.discard(rank)

    def _send_cell(self, rank: int) -> None:
        """The cell, as the others run it, to ``rank``'s replacement, told first the step its
        first quorum must heal it to (on the control comm, which it reads at once; the cell
        waits behind its --setup cells and ft.wrap)."""
        link = self.ctl._links.get(rank)
        if link is None or rank not in self.req.remaining:
            return
        with self._lock:
            others = [r for r in self.req.ranks if r != rank and r not in self.away]
            floor = max((self.steps.get(r, 0) for r in others), default=0)
            pending = [r for r in self.req.ranks if r not in self.finished]
        told = {"op": "ft", "id": self.req.id, "ranks": pending, "at_least": floor}
        self.ctl._loop.call_soon_threadsafe(link.control, told)
        link.send({**self.msg, "id": self.req.id})

    def _group_back(self, group: list[int], deadline: float) -> bool:
        """Wait until every rank of ``group`` has its replacement attached."""
        while not all(r in self.old and self._replaced(r, self.old[r]) for r in group):
            if self.ctl.closed or self.given_up or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _form_part(self, group: list[int]) -> str | None:
        """The replica group's own process group and mesh (dist.form_part); why not, or None."""
        shape = part_shape(self.ctl.mesh_shape or {}, len(group))
        try:
            dist.form_part(self.ctl, group, shape)
        except Exception as e:
            text = (getattr(e, "headline", None) or str(e) or type(e).__name__).splitlines()[0]
            return f"its replica group's process group could not form ({text})"
        return None

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


def part_shape(shape: dict[str, int], size: int) -> dict[str, int] | None:
    """The mesh of one replica group of ``size`` ranks (a slice of ``shape``'s last dimensions,
    the others of size 1): ``replicate=2,shard=2`` gives ``replicate=1,shard=2``."""
    out, product = {}, 1
    for name, n in reversed(list(shape.items())):
        out[name] = n if product < size else 1
        product *= out[name]
    return dict(reversed(list(out.items()))) if shape and product == size else None
