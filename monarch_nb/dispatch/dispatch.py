"""Requests to the ranks and what comes back: a request sent on each rank's link, its events
gathered (the ranks still running interrupted on Ctrl-C or a timeout), the ranks that do not
answer, and the info a rank answers on its event loop even while a cell runs."""

from __future__ import annotations

import contextlib
import numbers
import sys
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import cloudpickle

from monarch_nb import wire
from monarch_nb.dispatch import gathering, host_relays, prompting, relaying, unanswered
from monarch_nb.dispatch.links import Request, new_id
from monarch_nb.dispatch.output import Renderer
from monarch_nb.dispatch.releasing import Release
from monarch_nb.dispatch.results import CellError, Interrupted, ValueMesh
from monarch_nb.dispatch.targets import format_ranks
from monarch_nb.errors import ClusterError

if TYPE_CHECKING:
    from monarch_nb.dispatch.protocol import Ctl

# After an interrupt the ranks get INTERRUPT_GRACE seconds of silence to stop: a rank whose
# output is still arriving (its backlog, on a busy machine) is still heard out, up to
# INTERRUPT_FLUSH seconds in all, before it is reported as still running.
INTERRUPT_GRACE = 1.5
INTERRUPT_FLUSH = 10.0
# A rank asked at the interrupt (on its event loop, which answers while the cell runs) and
# silent this long after is not answering: stopped, or a C call holds the GIL.
ANSWER_WITHIN = INTERRUPT_GRACE + 0.25
# A rank that did not answer before gets this long to answer again (a stopped process that was
# let go on answers in milliseconds), so that status and the checks after an interrupt stay quick.
SILENT_WAIT = 0.25


def check_timeout(timeout) -> None:
    """A cell's ``timeout``: None, or seconds above 0 as ``--timeout`` takes them (0 or less
    would give up before the ranks could start, and NaN would never come)."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(
            f"timeout must be a number of seconds, or None for no limit; got {timeout!r}"
        )
    if not timeout > 0:
        raise ValueError(
            f"timeout must be more than 0 seconds, or None for no limit; got {timeout}"
        )


def submit(
    ctl: Ctl,
    kind: str,
    ranks: list[int],
    msg: dict[str, Any] | None = None,
    per_rank: Mapping[int, dict[str, Any]] | None = None,
    release: str | None = None,
    prepare=None,
) -> Request:
    """Send a request to ``ranks``. ``release``: the first rank to fail releases the others
    (releasing.py), their second step ending this ("group", "children"). ``prepare(req)`` is
    called before anything is sent (a fault-tolerant cell's hooks, controller/healing.py)."""
    req = Request(kind, ranks)
    req.send = lambda rank, msg: _link(ctl, req, rank) and ctl._links[rank].send(msg)
    req.reader = ctl._reader
    if release is not None and len(ranks) > 1:
        req.on_failure = Release(ctl, req, release, send_interrupt)
    if prepare is not None:
        prepare(req)
    ctl._router.add(req)
    body = {**(msg or {}), "id": req.id}
    # the same bytes for every rank: pickled once, not once per rank
    framed = wire.frame(body) if per_rank is None and kind != "info" else None
    if framed is not None:
        ranks = relaying.forward(ctl, req, ranks, body, framed)  # those it did not take
        ranks = host_relays.forward(ctl, req, ranks, body, framed)  # and other hosts' relays
    for rank in ranks:
        if not _link(ctl, req, rank):
            continue
        if per_rank is not None:
            body = {**(msg or {}), **per_rank.get(rank, {}), "id": req.id}
        if kind == "info":  # answered on the worker's event loop, even by a busy rank
            ctl._loop.call_soon_threadsafe(ctl._links[rank].control, body)
        else:
            ctl._links[rank].send(body, framed)
    return req


def _link(ctl: Ctl, req: Request, rank: int) -> bool:
    """Whether ``rank`` has a link; a rank without one (its attach failed) ends ``req`` as
    lost at once, where looking it up used to raise KeyError in every later command."""
    if rank in ctl._links:
        return True
    why = "the notebook has no connection to it"
    ctl._router.deliver(rank, {"ev": "done", "id": req.id, "status": "lost", "why": why})
    return False


def call(
    ctl: Ctl,
    fn,
    args: tuple = (),
    targets=None,
    per_rank: Mapping[int, tuple] | None = None,
    asked: str | None = None,
    release: str | None = None,
) -> ValueMesh:
    """``fn(engine, *args)`` in each targeted rank's thread (``per_rank``: each rank's own
    args). ``asked`` names what the user asked for ("this push"): said when it waits behind a
    busy rank, as a cell is; calls of our own (the process group's) stay quiet. ``release``:
    as ``submit``'s."""
    ctl._check_open()
    ranks = ctl.targets(targets)
    if asked is not None:
        say_waiting(ctl, ranks, asked)
    if per_rank is not None:
        blobs = {r: {"fn": cloudpickle.dumps((fn, per_rank[r]))} for r in ranks}
        msg, per = {"op": "call"}, blobs
    else:
        msg, per = {"op": "call", "fn": cloudpickle.dumps((fn, args))}, None
    # Both before the send: the first reply may come at once, and a Ctrl-C is held until
    # every rank has the request (gathering.sigint_sets).
    with ctl._reader.borrow(), gathering.sigint_sets() as stop:
        req = submit(ctl, "call", ranks, msg, per, release)
        outcomes, stopped = collect(ctl, req, Renderer(ranks), stop=stop)
    return settle(ctl, req, outcomes, stopped)


def say_waiting(ctl: Ctl, ranks: list[int], what: str) -> None:
    """Say so when ``what`` queues behind a cell still running on some of ``ranks``."""
    waiting = sorted(set(ctl._router.busy()) & set(ranks))
    if waiting:
        are, them = ("is", "it") if len(waiting) == 1 else ("are", "them")
        silent = sorted(set(waiting) & ctl.unanswering)
        why = "busy with an earlier cell"
        if silent:  # said by the interrupt or status that found it so
            why += f", and {format_ranks(silent)} did not answer when last asked"
        print(
            f"{format_ranks(waiting)} {are} {why}; {what} waits for "
            f"{them} (interrupt to cancel it)",
            file=sys.stderr,
        )


def collect(ctl: Ctl, req: Request, renderer: Renderer, timeout=None, stop=None):
    """Gather a request; on Ctrl-C or timeout (or ``stop`` set: a background cell's
    ``handle.interrupt()``, or a Ctrl-C while the request was sent) interrupt the ranks still
    running."""
    outcomes: dict[int, dict] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    with gathering.sigint_sets(stop) as stop:
        try:
            gathering.gather(req, renderer, deadline, outcomes, stop)
            return outcomes, None
        except KeyboardInterrupt:
            reason = "interrupted"
        except TimeoutError:
            reason = "timeout"
        running = [r for r in req.ranks if r not in outcomes]
        send_interrupt(ctl, running, req.id)
        # Asked behind the interrupt on the same comm, answered on the ranks' event loops:
        # by the end of the grace below, every rank that can answer has.
        probe = submit(ctl, "info", running, {"op": "info", "about": req.id})
        asked_at = time.monotonic()
        stop.clear()  # a second Ctrl-C stops waiting for them
        cut_short = False
        try:
            flush = time.monotonic() + INTERRUPT_FLUSH
            gathering.gather(req, renderer, flush, outcomes, stop, quiet=INTERRUPT_GRACE, ask=False)
        except KeyboardInterrupt:
            cut_short = True
        except TimeoutError:
            pass
        _cancelled_in_queue(ctl, req, outcomes, renderer, cut_short, probe, asked_at)
    return outcomes, (reason, running)


def _cancelled_in_queue(
    ctl: Ctl,
    req: Request,
    outcomes: dict[int, dict],
    renderer,
    cut_short: bool,
    probe: Request,
    asked_at: float,
) -> None:
    """A rank still silent after the interrupt may never have started ``req``: it waits
    behind an earlier cell (a ``--noblock`` one), and the interrupt told it to drop ``req``
    when it comes to it. ``probe`` asked the ranks what they run, so that those are not
    reported as stuck in a C call; a rank that did not answer it either is not answering
    at all (stopped, or the GIL held), and is reported so rather than waited for."""
    silent = [r for r in req.ranks if r not in outcomes]
    if not silent:
        return
    answers: dict[int, dict] = {}
    with contextlib.suppress(KeyboardInterrupt, TimeoutError):
        until = max(asked_at + ANSWER_WITHIN, time.monotonic())
        gathering.gather(probe, Renderer(probe.ranks), until, answers)
    about = {r: ev["info"]["about"] for r, ev in answers.items() if ev["status"] == "ok"}
    heard(ctl, answers)
    for rank in silent:
        if rank not in answers:
            ctl.unanswering.add(rank)
            outcomes[rank] = {"ev": "done", "status": "unanswered", "why": _silence(ctl, rank)}
    for rank, state in about.items():
        if state == "cancelled" and rank in silent:
            outcomes[rank] = {
                "ev": "done",
                "status": "cancelled",
                "why": "queued behind an earlier cell that is still running; "
                "cancelled before it started",
            }
    if cut_short and {"unknown", "running"} & set(about.values()):
        # A second Ctrl-C cut the wait short: a rank that finished has its answer on the
        # way, and one still running has had the interrupt for only a moment. Up to 2 s
        # more for them, so neither is reported stuck in a C call by mistake.
        with contextlib.suppress(KeyboardInterrupt, TimeoutError):
            gathering.gather(req, renderer, time.monotonic() + 2, outcomes, ask=False)


def heard(ctl: Ctl, answers: Mapping[int, dict]) -> None:
    """Keep what the ranks that answered an info request said about themselves."""
    for rank, ev in answers.items():
        if ev.get("status") == "ok":
            ctl._known[rank] = ev["info"]
            ctl.unanswering.discard(rank)


def _silence(ctl: Ctl, rank: int) -> str:
    known = ctl._known.get(rank, {})
    return unanswered.why(known.get("pid"), known.get("host"))


def send_interrupt(
    ctl: Ctl,
    ranks: Iterable[int],
    target: str | None = None,
    release: str | None = None,
    cut: str | None = None,
) -> str:
    """Interrupt ``ranks``; the press's key, which ``rank_info(press=)`` asks about.
    ``release``: why another rank's failure stops them (releasing.py); ``cut``: what every
    rank ends first, its cell running or not ("group": its process groups' connections)."""
    if ctl.closed:
        raise ClusterError("this cluster is down, and its cells ended with it")
    if cut is None and _fault_tolerant(ctl, target):
        cut = "ft"  # its ranks wait in torchft's collectives: those end at once (rank/ft.py)
    key = new_id("interrupt")  # one press, by two paths to each rank: acted on once there
    try:
        for rank in ranks:
            link = ctl._links.get(rank)
            if link is None:  # nothing of ours runs there: see _link
                continue
            msg = {"op": "interrupt", "target": target, "sent": link.last_sent, "key": key}
            if release is not None:
                msg["release"] = release
            if cut is not None:
                msg["cut"] = cut
            link.interrupt_here(msg)
            ctl._loop.call_soon_threadsafe(link.control, msg)
    except RuntimeError:  # the client's event loop is closed: the client is gone
        raise ClusterError(ctl._scheduler_gone()) from None
    return key


def _fault_tolerant(ctl: Ctl, target: str | None) -> bool:
    """Whether the interrupt is of a fault-tolerant cell (``target``, or any cell running)."""
    live = ctl._router.live
    requests = [live.get(target)] if target is not None else list(live.values())
    return any(req is not None and req.on_lost is not None for req in requests)


def settle(ctl: Ctl, req: Request, outcomes: dict[int, dict], stopped=None, timeout=None):
    """The outcomes as a ValueMesh, or the error that carries what did arrive."""
    hosts = {rank: ctl.ranks[rank].host for rank in req.ranks}
    ended = "shut down (%monarch down)" if ctl.closed else None
    if ctl._detached:
        ended = "restarted (%monarch restart)"
    for ev in outcomes.values():
        if ev.get("status") == "lost" and ended:
            ev["why"] = f"the cluster was {ended} while the cell ran"
            ev["ended_here"] = True
    ctl._regroup_after_interrupt(req, outcomes)  # controller/dist.py
    try:
        first = req.on_failure.first if req.on_failure is not None else None
        return gathering.settle(req.ranks, hosts, outcomes, stopped, timeout, first)
    except CellError as e:
        if req.kind == "execute":
            prompting.keep_failure(ctl, req.id, outcomes, e, call)
        raise
    except KeyboardInterrupt:  # unpickling a large result, say: the frames are ours
        raise Interrupted(
            f"interrupted while the results of {format_ranks(req.ranks)} were unpickled "
            "here; they are not kept (keep a value in a name on the ranks and "
            "%monarch pull it)"
        ) from None


def rank_info(
    ctl: Ctl, ranks: list[int], timeout: float = 5, press: str | None = None
) -> dict[int, dict]:
    """Each rank's engine state (``Engine.info``), answered on its event loop even while
    a cell runs; a rank that does not answer within ``timeout`` (``SILENT_WAIT`` for one
    that did not answer last time either) is left out. ``press``: an interrupt's key
    (``send_interrupt``), whose ``hit`` each rank says."""
    req = submit(ctl, "info", ranks, {"op": "info", "press": press})
    outcomes: dict[int, dict] = {}
    start = time.monotonic()
    for until in (start + min(timeout, SILENT_WAIT), start + timeout):
        with contextlib.suppress(TimeoutError):
            gathering.gather(req, Renderer(ranks), until, outcomes)
        if set(ranks) - set(outcomes) <= ctl.unanswering:
            break  # only ranks that did not answer before are silent: not worth the wait
    heard(ctl, outcomes)
    ctl.unanswering.update(r for r in ranks if r not in outcomes)
    return outcomes
