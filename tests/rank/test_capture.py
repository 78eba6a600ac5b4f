"""The worker's output capture under the engine's asynchronous interrupts.

The engine stops a cell by raising KeyboardInterrupt in its thread (``PyThreadState_SetAsyncExc``),
which can land at any bytecode, including inside the capture's own code. What reaches the
controller must then be exactly what the cell printed: each write whole or not at all, never
twice, in order. And which cell a write belongs to when a thread the cell started makes it.
"""

from __future__ import annotations

import ctypes
import gc
import io
import sys
import threading
import time

from monarch_nb.rank import capture
from monarch_nb.rank.capture import HELD_MAX, MAX_PARTIAL, Console, Outbox

PRINTS = 20_000


def _pieces() -> list[str]:
    # what print('flood', i) writes: separate pieces, the newline last
    return [p for i in range(PRINTS) for p in (f"flood{i} ", str(i), "\n")]


def _received(outbox: Outbox) -> str:
    outbox.end_cell("c")
    events, _ = outbox.drain()
    lines = [line for ev in events if ev["ev"] == "stream" for line in ev["lines"]]
    return "".join(line + "\n" for line in lines)


def _interrupt(ident: int) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(KeyboardInterrupt)
    )


def _flood_under_interrupts(pieces: list[str]):
    """Write ``pieces`` to an Outbox from a thread that the main thread interrupts as fast as it
    can. Returns ``(outbox, attempted, returned, interrupts)``: the indices of the pieces
    handed to write() in order, those whose write() came back normally, and how many
    interrupts were sent."""
    outbox = Outbox(lambda urgent: None)
    attempted: list[int] = []
    returned: set[int] = set()
    # plain flags, not threading.Event: an interrupt inside an Event's own lock handling would
    # break the Event, not the capture
    state = {"ready": False, "done": False, "quiet": False}

    def cell() -> None:
        k = 0
        while k < len(pieces):
            try:
                state["ready"] = True  # interrupts start once this thread is inside the try
                while k < len(pieces):
                    attempted.append(k)
                    outbox.write("c", "stdout", pieces[k])
                    returned.add(k)
                    k += 1
            except KeyboardInterrupt:
                k += 1  # the interrupted print goes on with its next piece
        while True:  # stay until the interrupts have stopped, then drop one still pending
            try:
                state["done"] = True
                while not state["quiet"]:
                    time.sleep(0.001)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(threading.get_ident()), None
                )
                return
            except KeyboardInterrupt:
                continue

    # Python checks for a pending interrupt at loop back-edges and calls, and the back-edge of
    # the cell's outer loop lies outside its try: an interrupt landing there ends the thread
    # (this harness's loop, not the capture). The writes before it still count; the flood
    # stops, and the thread's end is not reported as an error.
    default_hook = threading.excepthook

    def hook(args) -> None:
        if args.thread is thread and issubclass(args.exc_type, KeyboardInterrupt):
            state["done"] = True
        else:
            default_hook(args)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads as finely as the interpreter allows
    # no collection while interrupts fly: a finaliser of earlier tests' garbage would run on
    # the writing thread and take the interrupt meant for the capture
    gc.collect()
    gc.disable()
    threading.excepthook = hook
    try:
        thread = threading.Thread(target=cell)
        thread.start()
        while not state["ready"]:
            time.sleep(0.001)
        interrupts = 0
        while not state["done"] and thread.is_alive():
            _interrupt(thread.ident)
            interrupts += 1
        state["quiet"] = True
        thread.join()
    finally:
        threading.excepthook = default_hook
        gc.enable()
        sys.setswitchinterval(old)
    return outbox, attempted, returned, interrupts


def test_writes_interrupted_at_any_bytecode_arrive_once_and_in_order():
    pieces = _pieces()
    for _ in range(3):  # again if the harness's own loop took an interrupt early
        outbox, attempted, returned, interrupts = _flood_under_interrupts(pieces)
        if interrupts > 100:
            break
    assert interrupts > 100 and len(returned) < len(pieces)  # the interrupts did land

    # The text received is the attempted pieces in order, each at most once, with every piece
    # whose write() returned among them.
    text = _received(outbox)
    pos = 0
    for k in dict.fromkeys(attempted):
        piece = pieces[k]
        if text.startswith(piece, pos):
            pos += len(piece)
        else:
            assert k not in returned, f"piece {k} ({piece!r}) was written but is missing"
    # (end_cell ends a last line cut before its newline)
    rest = text[pos:]
    assert rest in ("", "\n"), f"text not from the pieces, once each, at {rest[:60]!r}"


def test_a_line_sent_in_parts_for_its_length_ends_without_an_empty_line():
    """A line past MAX_PARTIAL goes out before its newline arrives; that newline (print writes
    it separately) ends the line already sent, it does not start an empty one."""
    outbox = Outbox(lambda urgent: None)
    long = "x" * (MAX_PARTIAL + 10)
    for piece in (long, "\n", "after", "\n", long, "tail", "\n"):
        outbox.write("c", "stdout", piece)
    assert _received(outbox).splitlines() == [long, "after", long, "tail"]


def _lines(events) -> list[tuple[str, str, str]]:
    """(cell id, stream, line) of each line sent."""
    return [
        (ev["id"], ev["name"], line)
        for ev in events
        if ev["ev"] == "stream"
        for line in ev["lines"]
    ]


def test_a_thread_a_cell_starts_prints_into_the_cell_its_engine_runs_else_the_next():
    """Threads started by a cell (and by those threads) print into the cell running on their
    engine; between cells what they print is held and opens the engine's next cell."""
    console = Console()
    outbox = Outbox(lambda urgent: None)
    go, said = threading.Event(), threading.Event()

    def later():  # started by the first cell's thread, prints while no cell runs
        go.wait()
        assert capture.current_capture() is None
        console.write("stdout", "between cells\n", io.StringIO())
        said.set()

    def child():
        assert capture.current_capture() == (outbox, "c1")
        console.write("stdout", "in c1\n", io.StringIO())
        capture._start(threading.Thread(target=later))

    with console.running(outbox, "c1"):
        t = threading.Thread(target=child)
        capture._start(t)
        t.join()
    outbox.end_cell("c1")
    go.set()
    assert said.wait(5)
    with console.running(outbox, "c2"):
        outbox.write("c2", "stdout", "c2's own\n")
    outbox.end_cell("c2")
    events, _ = outbox.drain()
    assert _lines(events) == [
        ("c1", "stdout", "in c1"),
        ("c2", "stdout", "between cells"),
        ("c2", "stdout", "c2's own"),
    ]


def test_output_held_between_cells_past_its_bound_goes_to_the_worker_log_and_is_announced():
    console = Console()
    outbox = Outbox(lambda urgent: None)
    log = io.StringIO()
    line = "x" * 1000 + "\n"
    n = HELD_MAX // len(line) + 5
    for _ in range(n):
        console.write("stdout", line, log)
    with console.running(outbox, "c"):
        pass
    outbox.end_cell("c")
    events, _ = outbox.drain()
    got = _lines(events)
    kept = HELD_MAX // len(line)
    assert got[:kept] == [("c", "stdout", line[:-1])] * kept
    spilled = len(line) * (n - kept)
    assert log.getvalue() == line * (n - kept)
    assert got[kept:] == [
        (
            "c",
            "stderr",
            f"[monarch] threads printed {spilled} more characters between cells than are kept "
            "for the next one; those went to the worker's own log",
        )
    ]
