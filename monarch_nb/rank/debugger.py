"""Worker side of prompting: ``input()``, ``getpass.getpass()`` and pdb on a rank read from the
notebook's input box.

A cell runs on the rank's own thread, which is also the thread that reads the rank's requests
(engine_io.Wire). So ``input()`` there sends an ``input`` event on the cell's channel and polls
the wire itself until the controller's ``input_reply`` arrives, leaving every other request in
the inbox, in order, for after the cell. The polling runs as user code: an interrupt raises
KeyboardInterrupt in it, as in any cell. Other threads (Dask's, a cell's own threads) and
processes without an engine keep the builtins they had.

Post-mortem: the traceback of the rank's last failed cell is kept (as IPython keeps
``sys.last_traceback``), and ``%monarch debug`` runs ``post_mortem`` on it in the rank's thread.
``breakpoint()`` and ``pdb.set_trace()`` on the rank's thread open the same debugger.
"""

from __future__ import annotations

import builtins
import contextlib
import getpass
import itertools
import pdb
import queue
import sys
import threading
import uuid
from typing import Any

from monarch_nb.rank.cells import CELL_PREFIX

PDB_PROMPT = "(Pdb rank {rank}) "
POLL = 0.1  # seconds between looks at the wire: an interrupt lands between two

_local = threading.local()  # .ctx: (wire, channel, request id, rank) while a request runs
_seq = itertools.count(1)
_originals: dict[str, Any] = {}
_actor_failure: tuple[str, BaseException, Any] | None = None  # keep_actor_failure
_stops: list[Stop] = []  # actor threads stopped in pdb, oldest first
_stops_lock = threading.Lock()


@contextlib.contextmanager
def serving(wire, channel, request_id: str, rank: int | None):
    """The calling thread runs ``request_id`` of ``channel``: its prompts go there."""
    _local.ctx = (wire, channel, request_id, rank)
    _local.holding = False
    _local.eof = None
    try:
        yield
    finally:
        _local.ctx = None


def install() -> None:
    """Route input, getpass and pdb.set_trace of the ranks' threads to the notebook (once)."""
    if _originals:
        return
    _originals.update(input=builtins.input, getpass=getpass.getpass, set_trace=pdb.set_trace)
    builtins.input = _input
    getpass.getpass = _getpass
    pdb.set_trace = _set_trace  # breakpoint()'s default hook calls it too


def _input(prompt: Any = "") -> str:
    if getattr(_local, "stop", None) is not None:
        return _local.stop.ask(str(prompt), password=False)
    if getattr(_local, "ctx", None) is None:
        return _originals["input"](prompt)
    return ask(str(prompt), password=False)


def _getpass(prompt: str = "Password: ", stream=None) -> str:
    if getattr(_local, "stop", None) is not None:
        return _local.stop.ask(str(prompt), password=True)
    if getattr(_local, "ctx", None) is None:
        return _originals["getpass"](prompt, stream)
    return ask(str(prompt), password=True)


def _set_trace(*, header: str | None = None) -> None:
    if getattr(_local, "ctx", None) is not None:
        debugger = RankPdb(_local.ctx[3])
    elif getattr(_local, "stops", None) is not None:  # an actor's thread
        rank, notify = _local.stops
        _local.stop = stop = Stop()
        debugger = RankPdb(rank, stdout=stop)
        notify(stop)
    else:
        return _originals["set_trace"](header=header)
    if header is not None:
        debugger.message(header)
    debugger.set_trace(sys._getframe().f_back)


def route_stops(rank: int | None, notify) -> None:
    """pdb on the calling thread (an actor's, which serves no notebook request) waits for the
    notebook to attach (``attach``); ``notify(stop)`` tells the caller it stopped."""
    _local.stops = (rank, notify)


class Stop:
    """A thread stopped in pdb where no notebook prompt is open (an actor endpoint's): what pdb
    writes and asks waits here until the notebook attaches from the rank's own thread, which
    relays it (its ``ask`` is the notebook's). Also pdb's stdout."""

    def __init__(self):
        self.events: queue.SimpleQueue = (
            queue.SimpleQueue()
        )  # ("out", text), ("ask", ...), ("end",)
        self.answers: queue.SimpleQueue = queue.SimpleQueue()  # (text, None) or (None, why)
        with _stops_lock:
            _stops.append(self)

    def write(self, text: str) -> int:
        self.events.put(("out", text))
        return len(text)

    def flush(self) -> None:
        pass

    def ask(self, prompt: str, password: bool) -> str:
        self.events.put(("ask", prompt, password))
        value, why = self.answers.get()
        if why is not None:
            _local.eof = why
            raise EOFError(why)
        return value

    def end(self) -> None:
        """pdb let go (continued or quit): the attached notebook stops relaying."""
        with _stops_lock:
            if self in _stops:
                _stops.remove(self)
        _local.stop = None
        self.events.put(("end",))


def attach(engine) -> str:
    """Run on the rank's thread for ``%monarch debug``: relay the oldest stopped actor thread's
    pdb to the notebook until it continues or quits. "none" where no thread waits."""
    with _stops_lock:
        stop = _stops[0] if _stops else None
    if stop is None:
        return "none"
    _local.holding = True
    try:
        while True:
            try:
                event = stop.events.get(timeout=POLL)  # an interrupt lands between two
            except queue.Empty:
                continue
            if event[0] == "out":
                sys.stdout.write(event[1])
            elif event[0] == "ask":
                try:
                    stop.answers.put((ask(event[1], event[2]), None))
                except EOFError as e:
                    stop.answers.put((None, str(e)))
            else:
                return "ok"
    except BaseException:
        stop.answers.put((None, "the notebook stopped debugging"))  # pdb quits: the call fails
        raise
    finally:
        _release()


def ask(prompt: str, password: bool) -> str:
    """What the notebook's user typed at ``prompt``; EOFError where nobody can be asked."""
    wire, channel, request_id, _ = _local.ctx
    seq = next(_seq)
    sys.stdout.flush()
    # ``hold``: asked by a debugger, which keeps the notebook's prompt until it lets go
    hold = getattr(_local, "holding", False)
    channel.reply(
        {
            "ev": "input",
            "id": request_id,
            "seq": seq,
            "prompt": prompt,
            "password": password,
            "hold": hold,
        }
    )

    def answer(ch, msg):
        return ch is channel and msg.get("op") == "input_reply" and msg.get("for") == seq

    while (got := wire.take(answer)) is None:
        if channel.closed:
            raise EOFError("the notebook that ran this cell is gone")
        wire.poll(POLL)
    msg = got[1]
    if "error" in msg:
        _local.eof = msg["error"]  # pdb swallows the EOFError: RankPdb says why it ended
        raise EOFError(msg["error"])
    return msg["value"]


class RankPdb(pdb.Pdb):
    """pdb on a rank: its prompt names the rank, it reads through ``ask`` and writes to the
    cell's captured stdout. An interrupt ends it (plain pdb would prompt again)."""

    def __init__(self, rank: int | None, stdout=None):
        super().__init__(stdout=stdout or sys.stdout, nosigint=True, readrc=False)
        self.prompt = PDB_PROMPT.format(rank=rank)
        self.use_rawinput = True

    def interaction(self, frame, traceback):
        _local.holding = True
        super().interaction(frame, traceback)

    def set_continue(self):
        super().set_continue()
        self._let_go()

    def set_quit(self):
        super().set_quit()
        self._let_go()

    def _let_go(self) -> None:
        if isinstance(self.stdout, Stop):
            self.stdout.end()
        else:
            _release()

    def _cmdloop(self) -> None:
        try:
            self.cmdloop()
        except KeyboardInterrupt:
            self.set_quit()
            raise

    def do_interact(self, arg):
        # A notebook's input box cannot send Ctrl-D, so exit() is how one leaves: back to pdb,
        # not out of the worker.
        try:
            super().do_interact(arg)
        except SystemExit:
            self.message("(back in pdb)")

    do_interact.__doc__ = pdb.Pdb.do_interact.__doc__

    def do_EOF(self, arg):
        why = getattr(_local, "eof", None)
        if why:
            self.message(why)
        return super().do_EOF(arg)


def _release() -> None:
    """Tell the notebook this rank's debugger let go: other ranks' prompts may come."""
    ctx = getattr(_local, "ctx", None)
    if ctx is not None and _local.holding:
        _local.holding = False
        ctx[1].reply({"ev": "release", "id": ctx[2]})


def keep_failure(engine, request_id: str, exc: BaseException) -> None:
    """The failed cell's traceback, from its own frames on, for ``%monarch debug``."""
    tb = exc.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith(CELL_PREFIX):
        tb = tb.tb_next
    engine.failure = (request_id, exc, tb) if tb is not None else None


def post_mortem(engine, request_id: str | None) -> str:
    """pdb on the traceback that cell ``request_id`` left here (None: the latest failed cell's):
    "ok" once the user quits, or why it cannot start ("none": no failed cell kept, "other": a
    different cell's)."""
    return _post_mortem(engine, getattr(engine, "failure", None), request_id)


def keep_actor_failure(exc: BaseException, skip: str) -> str | None:
    """An actor call that raised keeps its traceback, from the endpoint's own frame on
    (``skip``: the actor worker's file), for ``ActorError.debug``: the latest per process, as a
    cell's. Its token, which the error carries back; None where no frame of the actor's is left."""
    global _actor_failure
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == skip:
        tb = tb.tb_next
    if tb is None or not _originals:  # not a rank: nobody can debug it from a notebook
        return None
    token = uuid.uuid4().hex
    _actor_failure = (token, exc, tb)
    return token


def actor_post_mortem(engine, token: str) -> str:
    """``post_mortem`` for the actor call whose error carries ``token``."""
    return _post_mortem(engine, _actor_failure, token)


def _post_mortem(engine, kept: tuple | None, key: str | None) -> str:
    """pdb on ``kept`` (key, exception, traceback) if it is ``key``'s (None: whoever's)."""
    if kept is None:
        return "none"
    if key is not None and kept[0] != key:
        return "other"
    _open(engine, *kept[1:])
    return "ok"


def _open(engine, exc: BaseException, tb) -> None:
    debugger = RankPdb(engine.identity.get("rank"))
    debugger.message(f"{type(exc).__name__}: {exc}")
    debugger.reset()
    debugger.interaction(None, tb)
