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
import collections
import contextlib
import getpass
import queue
import signal
import sys
import threading
from typing import Any

from IPython.core.error import StdinNotImplementedError

from monarch_nb import errors
from monarch_nb.dispatch.output import Renderer
from monarch_nb.dispatch.reader import next_event
from monarch_nb.dispatch.targets import format_ranks
from monarch_nb.errors import ClusterError
from monarch_nb.wire import sent_after

NOBLOCK = (
    "a rank's input() needs a blocking cell: this one runs in the background "
    "(--noblock), where the notebook cannot prompt; run it without --noblock"
)
PARKED = "waits in the debugger: %monarch debug --rank {rank} attaches to it"
SCRIPT_ENDED = "the cell's pdb commands ended"
RECENT = 50  # a rank's latest output lines kept while it may stop: where its pdb stopped
NO_INPUT_BOX = "the notebook's front end does not take input (allow_stdin is off)"
PDB_PROMPT_START = "(Pdb rank "  # rank/debugger.py's prompt names the rank already


class Turns:
    """Whose prompt is open: a rank's debugger holds it until it continues or quits (its
    prompts come one after another), and the prompts of other ranks wait their turn."""

    def __init__(self):
        self.holder: int | None = None
        self.deferred: list[tuple[int, dict[str, Any]]] = []
        # A background cell's: ranks whose pdb waits for ``%monarch debug`` (their prompt and
        # the output just before it), the rank attached to and the queue its events go to.
        self.parked: dict[int, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
        self.attached: tuple[int, queue.SimpleQueue] | None = None
        self.recent: dict[int, collections.deque] = {}


def on_event(req, rank: int, ev: dict[str, Any], renderer, ask: bool) -> None:
    """A rank's ``input`` (a prompt) or ``release`` (its debugger let go)."""
    turns = req.turns = req.turns or Turns()
    if ev["ev"] == "release":
        release(req, rank)
        return
    if ask and turns.holder not in (None, rank):
        turns.deferred.append((rank, ev))
        return
    recent = list(turns.recent.pop(rank, ()))
    if ask and ev.get("hold") and threading.current_thread() is not threading.main_thread():
        # pdb in a background cell: it waits until the notebook attaches
        turns.parked[rank] = (ev, recent)
        notice = {"ev": "stream", "name": "stderr", "lines": [PARKED.format(rank=rank) + "\n"]}
        renderer.feed(rank, notice)
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


def divert(req, rank: int, ev: dict[str, Any]) -> bool:
    """A background cell's event: while the notebook is attached to ``rank``'s debugger, that
    rank's output and prompts go to the attaching cell (True: taken). Until then the rank's
    latest output is kept, to show where its pdb stopped when the notebook attaches."""
    turns = req.turns = req.turns or Turns()
    attached = turns.attached
    if attached is None or attached[0] != rank:
        if ev["ev"] == "stream":
            turns.recent.setdefault(rank, collections.deque(maxlen=RECENT)).append(ev)
        elif ev["ev"] == "release":
            turns.recent.pop(rank, None)
        return False
    attached[1].put(ev)
    if ev["ev"] in ("release", "done"):
        turns.attached = None
    return ev["ev"] != "done"  # the gathering loop settles the rank's end as ever


def attach(ctl, rank: int | None) -> bool:
    """``%monarch debug`` where a background cell's rank waits in pdb (``rank``, or the lowest
    that waits): its prompts come here until it continues or quits. False: none waits."""
    parked = ctl._router.parked()
    if rank is None and parked:
        rank = min(parked)
    req = parked.get(rank)
    if req is None:
        return False
    if ctl.debugging is not None:
        raise ClusterError(f"a debugger is already open on rank {ctl.debugging}; end it (q) first")
    events: queue.SimpleQueue = queue.SimpleQueue()
    ev, recent = req.turns.parked.pop(rank)
    req.turns.attached = (rank, events)
    renderer = Renderer([rank])
    ctl.debugging = rank
    try:
        for old in recent:
            renderer.feed(rank, old)
        while ev["ev"] not in ("release", "done"):
            if ev["ev"] == "input":
                answer(req, rank, ev, renderer, [], ask=True)
            else:
                renderer.feed(rank, ev)
            ev = _next(events, renderer)
    except KeyboardInterrupt:
        ctl.interrupt(targets=[rank])  # the stop button ends debugging and the cell, as ever
        raise
    finally:
        if req.turns.attached is not None and req.turns.attached[1] is events:
            req.turns.attached = None
        ctl.debugging = None
        renderer.close()
    return True


def _next(events: queue.SimpleQueue, renderer) -> dict[str, Any]:
    while True:
        try:
            return next_event(events, 0.1)  # a short wait: Ctrl-C lands between two
        except queue.Empty:
            renderer.tick()


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
    if _script is not None:  # %%monarch debug: the cell's lines are typed at the prompts
        if not _script:
            req.send(rank, {**reply, "error": SCRIPT_ENDED})
            return
        value = _script.popleft()
        print(f"{prompt}{value}", flush=True)
        req.send(rank, {**reply, "value": value})
        return
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


_script: collections.deque | None = None


@contextlib.contextmanager
def scripted(commands: list[str]):
    """The ranks' prompts are answered with ``commands``, in turn, instead of asking the user
    (``%%monarch debug``: a notebook that shows a debugging session and runs unattended);
    past the last one a prompt gets EOF, which ends pdb."""
    global _script
    _script = collections.deque(commands)
    try:
        yield
    finally:
        _script = None


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


def _open(ctl, rank: int, fn, key: str, call) -> str:
    """``fn(engine, key)`` on ``rank``, which runs pdb there: one debugger at a time."""
    if ctl.debugging is not None:
        raise ClusterError(f"a debugger is already open on rank {ctl.debugging}; end it (q) first")
    ctl.debugging = rank
    try:
        return call(ctl, fn, (key,), targets=[rank], asked="the debugger")[rank]
    finally:
        ctl.debugging = None


class Failure:
    """Where a failed cell's tracebacks are kept: on each rank that raised, until that rank's
    next failed cell (or its worker's end). ``debug(rank)`` opens pdb there."""

    def __init__(self, ctl, request_id: str, failed: list[int], call):
        self.ctl = ctl
        self.call = call  # dispatch.call (passed in: dispatch imports this module)
        self.request_id = request_id
        self.failed = failed
        self.workers = {r: _worker(ctl, r) for r in failed}

    def debug(self, rank: int | None = None, latest: bool = False) -> None:
        """pdb on ``rank``'s traceback of this cell; ``latest`` (``%monarch debug``): of the
        latest cell that failed on that rank, where one failed there since (a ``--noblock``
        cell that is still running elsewhere is not known here until it ends)."""
        ctl = self.ctl
        rank = self.failed[0] if rank is None else rank
        if rank not in self.failed:
            raise ClusterError(
                f"rank {rank} did not fail in that cell; {format_ranks(self.failed)} did "
                "(%monarch debug --rank R)"
            )
        if ctl.closed:
            raise ClusterError("the cluster is down, and the tracebacks its ranks kept with it")
        if rank >= ctl.world_size:
            raise ClusterError(
                f"rank {rank} left with %monarch scale since that cell failed, and its "
                f"traceback went with it (the world is {ctl.world_size} now)"
            )
        if _worker(ctl, rank) != self.workers[rank]:
            # a new worker in the rank's place: a restart, or a scale down and up again
            raise ClusterError(
                f"rank {rank} was restarted since that cell failed (or left with %monarch "
                "scale and a new worker joined as it), and its traceback went with the old worker"
            )
        state = _open(ctl, rank, _post_mortem, None if latest else self.request_id, self.call)
        if state == "none":
            raise ClusterError(
                f"rank {rank} kept no traceback of that cell: its worker was restarted since"
            )
        if state == "other":
            raise ClusterError(
                f"rank {rank} failed again in a later cell, whose traceback replaced this "
                "one's; %monarch debug opens the latest"
            )


def debug_actor(err) -> None:
    """``ActorError.debug``: pdb on the traceback the failed actor call left on its rank."""
    ctl = errors.current()
    if err.post_mortem is None:
        raise ClusterError(
            f"{err.where} kept no traceback to debug: it failed outside the endpoint's own code"
        )
    token, rank = err.post_mortem
    if ctl is None or ctl.closed:
        raise ClusterError("the cluster is down, and the tracebacks its ranks kept with it")

    def call(ctl, fn, args, targets, asked):
        return ctl.call(fn, *args, targets=targets)

    state = _open(ctl, rank, _actor_post_mortem, token, call)
    if state == "none":
        raise ClusterError(
            f"rank {rank} kept no traceback of that call: its worker was restarted since"
        )
    if state == "other":
        raise ClusterError(
            f"an actor call failed on rank {rank} since, and its traceback replaced this one's; "
            "debug the latest error"
        )


def attach_actor(rank: int) -> bool:
    """Take the prompt of an actor endpoint stopped in pdb on ``rank`` (the rank's own thread
    relays it) until it continues or quits. False: none waits there."""
    ctl = errors.current()
    if ctl is None or ctl.closed:
        return False

    def call(ctl, fn, args, targets, asked):
        return ctl.call(fn, *args, targets=targets)

    return _open(ctl, rank, _attach_stopped, "", call) == "ok"


def keep_failure(ctl, request_id: str, outcomes: dict[int, dict], err, call) -> None:
    """Remember the failed cell ``err`` comes from, for ``%monarch debug`` and ``err.debug``:
    the ranks that raised (not those lost, cancelled or silent) keep its traceback.

    The latest failure is the cell sent last, not the one settled last: a rank runs cells in
    the order they were sent, and a ``--noblock`` cell's failure is settled on its handle's
    thread, often after that of a cell queued behind it, which ``%monarch debug`` then could
    not open ("%monarch debug opens the latest", it said of itself)."""
    failed = sorted(r for r, ev in outcomes.items() if ev.get("status") == "error")
    if not failed:
        return
    err.failure = failure = Failure(ctl, request_id, failed, call)
    with _failures_lock:  # the notebook's thread and a handle's may both be here
        last = ctl.last_failure
        if last is None or sent_after(request_id, last.request_id):
            ctl.last_failure = failure


_failures_lock = threading.Lock()


def _worker(ctl, rank: int) -> tuple[str, str, bool]:
    info = ctl.ranks[rank]
    return info.address, info.incarnation, info.alive


def _post_mortem(engine, request_id: str | None) -> str:
    from monarch_nb.rank import debugger

    return debugger.post_mortem(engine, request_id)


def _attach_stopped(engine, _: str) -> str:
    from monarch_nb.rank import debugger

    return debugger.attach(engine)


def _actor_post_mortem(engine, token: str) -> str:
    from monarch_nb.rank import debugger

    return debugger.actor_post_mortem(engine, token)
