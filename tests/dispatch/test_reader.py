"""Who reads the ranks' sockets on the controller (dispatch/reader.py): the notebook's thread
while it waits for a blocking cell, the Reader's thread otherwise; nothing is lost or reordered
when the two hand the sockets over."""

from __future__ import annotations

import threading
import time

from monarch_nb.dispatch.links import Router


def _recording(monkeypatch) -> list[tuple[str, str]]:
    """(thread name, event kind) of every event the controller routes."""
    seen: list[tuple[str, str]] = []
    deliver = Router.deliver

    def record(self, rank, ev):
        seen.append((threading.current_thread().name, ev["ev"]))
        return deliver(self, rank, ev)

    monkeypatch.setattr(Router, "deliver", record)
    return seen


def test_a_blocking_cells_replies_are_read_by_the_thread_that_waits(clean, monkeypatch):
    seen = _recording(monkeypatch)
    for _ in range(20):
        assert clean.run("rank").values() == [0, 1]
    done = [name for name, kind in seen if kind == "done"]
    assert len(done) == 40
    assert set(done) == {threading.main_thread().name}, done


def test_a_background_cell_is_read_by_the_reader_thread(clean, monkeypatch):
    seen = _recording(monkeypatch)
    handle = clean.run("print('hi')\nrank", block=False)
    assert handle.result(timeout=30).values() == [0, 1]
    assert {name for name, kind in seen if kind == "done"} == {"monarch-reader"}


def test_a_background_cells_output_arrives_whole_while_a_blocking_cell_waits(clean, capsys):
    # Rank 0's background cell prints while the notebook's thread waits for rank 1's blocking
    # cell, which reads rank 0's socket meanwhile, and hands it back between the cells.
    handle = clean.run(
        "import time\nfor i in range(40):\n    print('line', i, flush=True)\n    time.sleep(0.01)",
        targets=0,
        block=False,
    )
    for _ in range(5):
        clean.run("import time\ntime.sleep(0.05)", targets=1)
    handle.result(timeout=30)
    time.sleep(0.3)
    out = capsys.readouterr().out
    numbers = [int(line.rsplit(" ", 1)[1]) for line in out.splitlines() if " line " in line]
    assert numbers == list(range(40)), out


def test_an_input_prompt_gives_the_sockets_back_while_the_user_answers(clean, monkeypatch):
    # While the notebook's thread waits for the user's answer to rank 0's input(), rank 1's
    # output goes on being read (by the Reader's thread), and the cell ends with both.
    import builtins

    answered = threading.Event()

    def slow_user(prompt=""):
        time.sleep(0.5)  # rank 1 prints meanwhile
        answered.set()
        return "yes"

    monkeypatch.setattr(builtins, "input", slow_user)
    seen = _recording(monkeypatch)
    code = (
        "import time\n"
        "if rank == 0:\n"
        "    got = input('go? ')\n"
        "else:\n"
        "    for i in range(10):\n"
        "        print('tick', i, flush=True)\n"
        "        time.sleep(0.02)\n"
        "    got = 'no'\n"
        "got"
    )
    assert clean.run(code).values() == ["yes", "no"]
    assert answered.is_set()
    assert ("monarch-reader", "stream") in seen
