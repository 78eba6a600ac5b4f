"""Controller side of prompting: a rank's ``input()``, ``getpass()`` or pdb asks, the notebook's
user answers.

The gathering loop meets a rank's ``input`` event on the thread that waits for the cell, shows
what the ranks printed so far, and asks through the notebook's own ``input``/``getpass`` (in a
kernel, ipykernel's, which use the front end's input box; in a terminal IPython, the terminal).
The answer goes back on that rank's link. One prompt at a time: ranks that ask meanwhile wait,
and are named. Ctrl-C while prompting interrupts the cell as usual.

Post-mortem (``%monarch debug``, ``CellError.debug``) is such a prompt: a call that runs pdb
on the traceback the failed rank kept (rank/debugger.py), driven from here.
"""

from __future__ import annotations

import builtins
import contextlib
import getpass
import queue
import signal
import sys
import threading
from typing import Any

from IPython.core.error import StdinNotImplementedError

from monarch_nb.controller.targets import format_ranks
from monarch_nb.errors import ClusterError

NOBLOCK = (
    "a rank's input() or pdb needs a blocking cell: this one runs in the background "
    "(--noblock), where the notebook cannot prompt; run it without --noblock"
)
NO_INPUT_BOX = "the notebook's front end does not take input (allow_stdin is off)"
PDB_PROMPT_START = "(Pdb rank "  # rank/debugger.py's prompt names the rank already


class Turns:
    """Whose prompt is open: a rank's debugger holds it until it continues or quits (its
    prompts come one after another), and the prompts of other ranks wait their turn."""

    def __init__(self):
        self.holder: int | None = None
        self.deferred: list[tuple[int, dict[str, Any]]] = []


def on_event(req, rank: int, ev: dict[str, Any], renderer, ask: bool) -> None:
    """A rank's ``input`` (a prompt) or ``release`` (its debugger let go)."""
    turns = req.turns = req.turns or Turns()
    if ev["ev"] == "release":
        release(req, rank)
        return
    if ask and turns.holder not in (None, rank):
        turns.deferred.append((rank, ev))
        return
    if ev.get("hold"):
        turns.holder = rank
    answer(req, rank, ev, renderer, _waiting(req, rank), ask)


def release(req, rank: int) -> None:
    """``rank`` let go of the prompt (or ended): the prompts that waited for it come next."""
    turns = req.turns
    if turns is not None and turns.holder == rank:
        turns.holder = None
        req.backlog.extendleft(reversed(turns.deferred))
        turns.deferred.clear()


def _waiting(req, rank: int) -> list[int]:
    """The other ranks whose prompts arrived: waiting their turn, or read ahead now into
    ``req.backlog`` (which the gathering loop takes before anything newer)."""
    with contextlib.suppress(queue.Empty):
        while True:
            req.backlog.append(req.events.get_nowait())
    asked = [r for r, ev in [*req.turns.deferred, *req.backlog] if ev["ev"] == "input"]
    return sorted(set(asked) - {rank})


def answer(req, rank: int, ev: dict[str, Any], renderer, waiting: list[int], ask: bool) -> None:
    """Prompt for rank ``rank``'s ``input`` event and send the reply; ``ask`` False (the cell is
    being interrupted, or runs in the background) answers with an EOFError instead."""
    reply = {"op": "input_reply", "id": ev["id"], "for": ev["seq"]}
    if not ask:
        req.send(rank, {**reply, "error": "the cell was interrupted"})
        return
    if threading.current_thread() is not threading.main_thread():
        req.send(rank, {**reply, "error": NOBLOCK})
        return
    renderer.tick(final=True)  # what the rank printed before asking shows above the prompt
    if waiting:
        are = "waits" if len(waiting) == 1 else "wait"
        print(f"({format_ranks(waiting)} {are} to be answered next)", flush=True)
    prompt = ev["prompt"]
    if not prompt.startswith(PDB_PROMPT_START):
        prompt = f"[rank {rank}] {prompt}"
    try:
        with _sigint_raises():
            value = _ask(prompt, ev["password"])
    except EOFError:
        req.send(rank, {**reply, "error": "no input: the notebook's input ended"})
        return
    except StdinNotImplementedError:  # a front end without an input box
        req.send(rank, {**reply, "error": NO_INPUT_BOX})
        return
    req.send(rank, {**reply, "value": value})


def _ask(prompt: str, password: bool) -> str:
    # Looked up now: ipykernel puts its own input and getpass in place while a cell runs.
    if password:
        return getpass.getpass(prompt)
    return builtins.input(prompt)


@contextlib.contextmanager
def _sigint_raises():
    """Ctrl-C raises KeyboardInterrupt while the user is asked: the gathering loop's handler
    only sets a flag, which a kernel waiting for the input box never looks at."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.stdout.flush()


class Failure:
    """Where a failed cell's tracebacks are kept: on each rank that raised, until that rank's
    next failed cell (or its worker's end). ``debug(rank)`` opens pdb there."""

    def __init__(self, ctl, request_id: str, failed: list[int], call):
        self.ctl = ctl
        self.call = call  # dispatch.call (passed in: dispatch imports this module)
        self.request_id = request_id
        self.failed = failed
        self.workers = {r: _worker(ctl, r) for r in failed}

    def debug(self, rank: int | None = None) -> None:
        ctl = self.ctl
        rank = self.failed[0] if rank is None else rank
        if rank not in self.failed:
            raise ClusterError(
                f"rank {rank} did not fail in that cell; {format_ranks(self.failed)} did "
                "(%monarch debug --rank R)"
            )
        if ctl.closed:
            raise ClusterError("the cluster is down, and the tracebacks its ranks kept with it")
        if _worker(ctl, rank) != self.workers[rank]:
            raise ClusterError(
                f"rank {rank} was restarted since that cell failed, and its traceback went "
                "with the old worker"
            )
        if ctl.debugging is not None:
            raise ClusterError(
                f"a debugger is already open on rank {ctl.debugging}; end it (q) first"
            )
        ctl.debugging = rank
        try:
            state = self.call(
                ctl, _post_mortem, (self.request_id,), targets=[rank], asked="the debugger"
            )[rank]
        finally:
            ctl.debugging = None
        if state == "none":
            raise ClusterError(
                f"rank {rank} kept no traceback of that cell: its worker was restarted since"
            )
        if state == "other":
            raise ClusterError(
                f"rank {rank} failed again in a later cell, whose traceback replaced this "
                "one's; %monarch debug opens the latest"
            )


def keep_failure(ctl, request_id: str, outcomes: dict[int, dict], err, call) -> None:
    """Remember the failed cell ``err`` comes from, for ``%monarch debug`` and ``err.debug``:
    the ranks that raised (not those lost, cancelled or silent) keep its traceback."""
    failed = sorted(r for r, ev in outcomes.items() if ev.get("status") == "error")
    if failed:
        err.failure = ctl.last_failure = Failure(ctl, request_id, failed, call)


def _worker(ctl, rank: int) -> tuple[str, str, bool]:
    info = ctl.ranks[rank]
    return info.address, info.incarnation, info.alive


def _post_mortem(engine, request_id: str) -> str:
    from monarch_nb.rank import debugger

    return debugger.post_mortem(engine, request_id)
