"""Ctrl-C in the moment a request is being sent: it lands between two ranks' sends, or after
the last send and before the wait for the replies. Either way every targeted rank has the
request and the request is interrupted as a whole, so no rank is left running it alone (a
collective in it would wait for ever) and no cell goes on running unwatched.

The signal is a real SIGINT to this process, sent from the points named: the ``watch``
callback, which ``run`` calls once the cell is sent, and the send to rank 0, wrapped."""

from __future__ import annotations

import os
import signal
import time

import pytest

from monarch_nb import CellError
from monarch_nb.dispatch.results import Interrupted

LONG = "import time\nfor _ in range(600):\n    time.sleep(0.05)"  # 30 s, interruptible


def ctrl_c(*_) -> None:
    os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture
def ctrl_c_after_rank_0s_send(clean, monkeypatch):
    """The next request's send to rank 0 is followed by a Ctrl-C, before rank 1's send."""
    link = clean._links[0]

    def then_ctrl_c(*args):
        monkeypatch.undo()  # once
        link.send(*args)
        ctrl_c()

    monkeypatch.setattr(link, "send", then_ctrl_c)
    return clean


def idle_at_once(ctl, capsys, busy: bool = False) -> None:
    """The next cell runs at once on both ranks: nothing is left running before it (``busy``:
    the interrupted cell may still be ending, and the next one says it waits for that)."""
    start = time.monotonic()
    assert ctl.run("rank").values() == [0, 1]
    assert time.monotonic() - start < 5
    if not busy:
        assert "busy with an earlier cell" not in capsys.readouterr().err


def test_ctrl_c_once_the_cell_is_sent_interrupts_it(clean, capsys):
    start = time.monotonic()
    with pytest.raises(CellError) as info:
        clean.run(LONG, watch=ctrl_c)
    assert time.monotonic() - start < 5
    assert info.value.headline == "interrupted ranks 0-1"
    # stopped as it ran, or dropped before it started where the interrupt came first (a rank
    # slow to take the cell on a loaded machine): either way no rank runs it alone
    assert {e.ename for e in info.value.errors.values()} <= {"KeyboardInterrupt", "Cancelled"}
    idle_at_once(clean, capsys)


def test_ctrl_c_between_two_ranks_sends_interrupts_both(ctrl_c_after_rank_0s_send, capsys):
    ctl = ctrl_c_after_rank_0s_send
    with pytest.raises(CellError) as info:
        ctl.run(LONG)
    assert info.value.headline == "interrupted ranks 0-1"
    assert sorted(info.value.errors) == [0, 1]
    idle_at_once(ctl, capsys)


def test_ctrl_c_between_two_ranks_sends_of_a_call_interrupts_both(
    ctrl_c_after_rank_0s_send, capsys
):
    ctl = ctrl_c_after_rank_0s_send
    with pytest.raises(CellError) as info:
        ctl.apply(exec, LONG, {})  # a call: push, pull, apply and map go this way
    assert info.value.headline == "interrupted ranks 0-1"
    idle_at_once(ctl, capsys)


def test_ctrl_c_while_a_background_cell_is_sent_interrupts_it(ctrl_c_after_rank_0s_send, capsys):
    """The caller's Ctrl-C still stops the caller (a loop starting cells ends), and the cell
    it was starting is interrupted rather than left running where no handle reaches it."""
    ctl = ctrl_c_after_rank_0s_send
    with pytest.raises(Interrupted) as info:
        ctl.run(LONG, block=False)
    assert info.value._render_traceback_() == [
        "KeyboardInterrupt: interrupted as the cell was started in the background; "
        "it was interrupted on ranks 0-1 too"
    ]
    idle_at_once(ctl, capsys, busy=True)
