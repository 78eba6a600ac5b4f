"""Gathering a request's events from the ranks, and settling the outcomes into a result.

``gather`` feeds each rank's output to the renderer until every rank is done, and stops only
between two events (a Ctrl-C or the deadline never loses one). ``settle`` turns the ranks'
outcomes into a ``ValueMesh``, or raises ``CellError`` / ``CellTimeout`` carrying the values
that did arrive.
"""

from __future__ import annotations

import _signal
import contextlib
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

import cloudpickle

from monarch_nb.dispatch import prompting
from monarch_nb.dispatch.links import UNREACHABLE, Request
from monarch_nb.dispatch.output import Renderer
from monarch_nb.dispatch.reader import given_back, next_event
from monarch_nb.dispatch.results import (
    CellError,
    CellTimeout,
    RemoteError,
    UnserializableResult,
    ValueMesh,
)
from monarch_nb.dispatch.targets import format_ranks


def gather(
    req: Request,
    renderer: Renderer,
    deadline: float | None = None,
    outcomes: dict[int, dict] | None = None,
    stop: threading.Event | None = None,
    quiet: float | None = None,
    ask: bool = True,
) -> dict[int, dict]:
    """Events of ``req`` until every rank is done; raises TimeoutError at ``deadline`` or once
    ``quiet`` seconds pass without an event, and KeyboardInterrupt once ``stop`` is set (or
    Ctrl-C at a rank's prompt), always between two events, so none is lost. A rank's prompt
    (its input(), pdb) is put to the user, unless ``ask`` is False."""
    outcomes = {} if outcomes is None else outcomes
    last = time.monotonic()
    background = threading.current_thread() is not threading.main_thread()
    borrow = req.reader.borrow() if req.reader is not None else contextlib.nullcontext()
    ranks, events, backlog = len(req.ranks), req.events, req.backlog
    never = float("inf") if deadline is None else deadline
    try:
        with borrow:
            while len(outcomes) < ranks:
                if stop is not None and stop.is_set():
                    raise KeyboardInterrupt
                if last >= never:  # the previous event's time: a flood of output still ends
                    raise TimeoutError
                try:
                    # what has arrived is taken at once (at 64 ranks, 64 times per cell)
                    rank, ev = backlog.popleft() if backlog else events.get_nowait()
                except queue.Empty:
                    now = time.monotonic()
                    until = never if quiet is None else min(never, last + quiet)
                    if now >= until:
                        raise TimeoutError from None
                    try:
                        rank, ev = next_event(events, min(0.1, until - now))
                    except queue.Empty:
                        renderer.tick()
                        continue
                last = time.monotonic()
                if background and prompting.divert(req, rank, ev):
                    continue
                if ev["ev"] == "done":
                    outcomes[rank] = ev
                    prompting.release(req, rank)
                elif ev["ev"] in ("input", "release"):
                    with given_back():  # the user's think time: the Reader reads meanwhile
                        prompting.on_event(req, rank, ev, renderer, ask)
                    last = time.monotonic()  # the user's think time is not the ranks' silence
                else:
                    renderer.feed(rank, ev)
    finally:
        renderer.close()
    return outcomes


def settle(
    ranks: list[int],
    hosts: Mapping[int, str],
    outcomes: dict[int, dict],
    stopped=None,
    timeout=None,
    first: int | None = None,
):
    """``first``: the rank whose failure released the others (releasing.py), if one did."""
    values: dict[int, Any] = {}
    errors: dict[int, RemoteError] = {}
    for rank in ranks:
        host = hosts[rank]
        ev = outcomes.get(rank)
        if ev is None:
            errors[rank] = RemoteError(
                rank,
                host,
                "StillRunning",
                "did not stop after the interrupt (stuck in a C call?); "
                "try %monarch interrupt again, or %monarch restart for fresh workers",
                [],
            )
        elif ev["status"] == "ok":
            values[rank] = _unpack(rank, ev)
        elif ev["status"] == "error":
            errors[rank] = RemoteError(rank, host, **ev["error"])
        elif ev["status"] == "unanswered":
            errors[rank] = RemoteError(rank, host, "NotAnswering", ev["why"], [])
        else:
            lost = ev["status"] == "lost"
            errors[rank] = RemoteError(
                rank,
                host,
                "WorkerLost" if lost else "Cancelled",
                f"on {host}: {why(ev)}" if lost else why(ev),
                [],
            )
    if not errors:
        return ValueMesh(values)
    if stopped is None:
        raise CellError(errors, ValueMesh(values), ranks, cause=cause(outcomes, errors, first))
    reason, running = stopped
    stuck = [r for r in running if r not in outcomes]
    # and those the interrupt ended before it was noticed here (a background cell's, whose
    # collective its cut ended at once: controller/dist.py)
    ended = {r for r, e in errors.items() if e.ename == "KeyboardInterrupt"}
    stopped_ranks = [r for r in ranks if r in outcomes and (r in running or r in ended)]
    if reason == "timeout":
        were = "was" if len(running) == 1 else "were"
        headline = (
            f"the cell ran past --timeout {timeout:g} s; {format_ranks(running)} {were} still "
            f"running and {were} interrupted"
        )
        if stuck:
            headline += _not_stopped(stuck)
        raise CellTimeout(errors, ValueMesh(values), ranks, headline)
    headline = f"interrupted {format_ranks(stopped_ranks)}" if stopped_ranks else ""
    if stuck:
        headline = (headline + _not_stopped(stuck)) if headline else _not_stopped(stuck)[2:]
    raise CellError(errors, ValueMesh(values), ranks, headline)


def _not_stopped(stuck: list[int]) -> str:
    does, runs = ("does", "runs") if len(stuck) == 1 else ("do", "run")
    return f"; {format_ranks(stuck)} {does} not stop and still {runs}"


def cause(outcomes: Mapping[int, dict], errors: Mapping[int, RemoteError], first: int | None):
    """The failure to name first, where one set off the others: the first to arrive
    (``first``, known where the cell releases its ranks on a failure) if it failed of itself,
    else the lowest rank that did (a collective that gave up shows a peer's failure, not its
    own). None where no failure was first (no release) or every failure is alike (the same
    error on every rank): the headline then counts them."""
    knock_on = {"Released", "StillRunning"}
    gave_up = {r for r in errors if outcomes.get(r, {}).get("collective")}
    own = [r for r, e in errors.items() if e.ename not in knock_on and r not in gave_up]
    released = gave_up or any(e.ename == "Released" for e in errors.values())
    alike = len({(e.ename, e.evalue) for e in errors.values()}) == 1
    if not released and (first is None or alike):
        return None
    if first in own:
        return first
    return own[0] if own else first


_armed: threading.Event | None = None  # the Event the main thread's Ctrl-C sets, if any


@contextlib.contextmanager
def sigint_sets(stop: threading.Event | None = None):
    """While sending and gathering on the main thread, Ctrl-C (the kernel's interrupt, SIGINT)
    sets an Event instead of raising wherever the main thread happens to be: one between two
    ranks' sends leaves the request with some ranks only, one after the sends leaves the
    request running unwatched, one inside a library callback is swallowed, and one between
    taking an event and showing it loses it. ``stop``: an Event of the caller's to use (a
    background cell's handle sets it); the one already armed is left as it is."""
    global _armed
    stop = threading.Event() if stop is None else stop
    if stop is _armed or threading.current_thread() is not threading.main_thread():
        yield stop
        return
    # _signal: the signal module's enum wrapping was a tenth of a trivial cell's own time
    previous = _signal.signal(_signal.SIGINT, lambda signum, frame: stop.set())
    outer, _armed = _armed, stop
    try:
        yield stop
    finally:
        _armed = outer
        _signal.signal(_signal.SIGINT, previous)


def _unpack(rank: int, ev: dict[str, Any]) -> Any:
    if "value_error" in ev:
        return UnserializableResult(rank, ev["value_error"])
    if "value" not in ev:
        return ev.get("info")
    try:
        return cloudpickle.loads(ev["value"])
    except Exception as e:
        return UnserializableResult(
            rank, f"cannot unpickle on the controller: {type(e).__name__}: {e}"
        )


def why(ev: dict[str, Any]) -> str:
    if ev["status"] == "lost":
        why = ev.get("why", "connection lost")
        if ev.get("ended_here"):  # the notebook ended it: down or restart, no advice needed
            return why
        if why == UNREACHABLE:  # the worker may live on behind a network that comes back
            return (
                f"the worker is out of reach: {why} (if the host comes back with it, %monarch "
                "restart gives every rank a fresh worker; if it does not, %monarch scale with the "
                "same number of ranks starts one)"
            )
        return (
            f"the worker is gone: {why} (if no replacement joins, %monarch scale with the same "
            "number of ranks starts one)"
        )
    if ev["status"] == "cancelled":
        return ev.get("why", "cancelled before it started")
    if ev["status"] == "unanswered":
        return ev["why"]
    err = ev.get("error") or {}
    return f"{err.get('ename')}: {err.get('evalue')}"
