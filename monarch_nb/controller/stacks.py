"""``%monarch stacks``: every thread's stack on each rank, asked while a cell runs or hangs.

The request travels on each rank's control comm and is answered on the worker's event loop
(rank/stacks.py), as interrupt and info are: the rank's own thread may be blocked in a C call.
A rank silent for ANSWER_WITHIN seconds is reported not answering (stopped, or a C call holds
the GIL; dispatch/unanswered.py says which) rather than waited for. Safe from any thread: a second
thread may ask while the notebook's thread waits on a blocking cell.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from monarch_nb.dispatch import dispatch, unanswered
from monarch_nb.dispatch.links import Request
from monarch_nb.dispatch.reader import next_event
from monarch_nb.dispatch.results import Interrupted
from monarch_nb.dispatch.stacks_report import StacksReport
from monarch_nb.errors import ClusterError

if TYPE_CHECKING:
    from monarch_nb.controller.controller import Controller

ANSWER_WITHIN = 1.0  # seconds for a rank's event loop to answer
NATIVE_WAIT = 25.0  # seconds more for py-spy, on a rank that answered (rank/stacks.py: 20 s)

__all__ = ["StacksReport", "ask"]


def ask(
    ctl: Controller, targets=None, native: bool = False, actor: str | None = None
) -> StacksReport:
    """The stacks of the targeted ranks; ``native``: with C frames (py-spy, where the ranks
    have it); ``actor``: only the threads of that actor mesh's actors."""
    ctl._check_open()  # down, the scheduler gone, or the workers restarted meanwhile
    ranks = ctl.targets(targets)
    started = time.monotonic()
    req = Request("stacks", ranks)
    ctl._router.add(req)
    try:
        for rank in ranks:
            body = {"op": "stacks", "id": req.id, "native": bool(native)}
            ctl._loop.call_soon_threadsafe(ctl._links[rank].control, body)
    except RuntimeError:  # the client's event loop is closed: the client is gone
        raise ClusterError(ctl._scheduler_gone()) from None
    try:
        outcomes, answered = _wait(req, started)
    except KeyboardInterrupt:
        raise Interrupted("stopped waiting for the ranks' stacks") from None
    dispatch.heard(ctl, {**answered, **{r: ev for r, ev in outcomes.items() if "info" in ev}})
    heard_from = {r for r, ev in outcomes.items() if ev.get("status") == "ok"} | set(answered)
    ctl.unanswering.update(r for r in ranks if r not in heard_from)
    for rank in ranks:
        if rank in outcomes:
            continue
        if rank in answered:  # alive, but py-spy did not finish in time
            why = f"answered, but its stacks did not come within {NATIVE_WAIT:g} s (py-spy)"
        else:
            known = ctl._known.get(rank, {})
            why = unanswered.why(known.get("pid"), known.get("host"))
        outcomes[rank] = {"status": "unanswered", "why": why}
    hosts = {r: ctl.ranks[r].host for r in ranks}
    return StacksReport(ranks, hosts, outcomes, time.monotonic() - started, actor)


def _wait(req: Request, started: float) -> tuple[dict[int, dict], dict[int, dict]]:
    """The ranks' answers: every rank's event loop gets ANSWER_WITHIN seconds to say it is
    there; one that did (with native stacks to come) gets NATIVE_WAIT more. Returns the
    outcomes and the ranks that said they are there (with what they said of themselves)."""
    outcomes: dict[int, dict[str, Any]] = {}
    answered: dict[int, dict[str, Any]] = {}
    main = threading.current_thread() is threading.main_thread()
    while len(outcomes) < len(req.ranks):
        now = time.monotonic()
        waiting = [r for r in req.ranks if r not in outcomes]
        if now >= started + ANSWER_WITHIN and not set(waiting) & answered.keys():
            break  # the rest have said nothing: not answering
        if now >= started + ANSWER_WITHIN + NATIVE_WAIT:
            break
        try:
            # short waits on the notebook's thread, so that Ctrl-C lands between two
            rank, ev = next_event(req.events, 0.05 if main else 0.2)
        except queue.Empty:
            continue
        if ev["ev"] == "done":
            outcomes[rank] = ev
        elif ev["ev"] == "answered":
            answered[rank] = {"status": "ok", "info": ev["info"]}
    return outcomes, answered
