"""Ctrl-C while an endpoint's messages go out to a mesh's actors: it is raised once every actor
has its message, so no actor runs a call the others never get (one waiting in a collective
would wait for ever) and no reply is owed by an actor that was never asked.

The signal is a real SIGINT to this process, sent right after the first actor's message is
written (the mailbox's write, wrapped)."""

from __future__ import annotations

import os
import signal

import _actor_helpers as helpers
import cloudpickle
import pytest

from monarch_nb.actors import mesh as actors

cloudpickle.register_pickle_by_value(helpers)


@pytest.fixture
def counters(ctl):
    spawned = actors.proc_mesh(ctl).spawn("counted", helpers.Counter, 10)
    yield spawned
    spawned.stop().get(timeout=10)


@pytest.fixture
def ctrl_c_after_the_first_write(counters, monkeypatch):
    mailbox = counters._mailbox
    post = mailbox._post

    def then_ctrl_c(conn, batch):
        post(conn, batch)
        if batch:
            monkeypatch.undo()  # once
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(mailbox, "_post", then_ctrl_c)
    return counters


def test_ctrl_c_as_a_call_goes_out_reaches_every_actor_first(ctrl_c_after_the_first_write):
    counters = ctrl_c_after_the_first_write
    with pytest.raises(KeyboardInterrupt):
        counters.incr.call(1)
    # Both actors had it: the next call finds both at 11 + 1, and is answered by both.
    assert counters.incr.call(1).get(timeout=10).values() == [12, 12]
