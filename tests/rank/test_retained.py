"""What an engine keeps behind a host relay until the controller has read it (rank/retained.py)."""

from __future__ import annotations

from monarch_nb.rank import retained as module
from monarch_nb.rank.retained import Retained


def test_frames_are_kept_until_acknowledged_and_sent_again_after_what_was_read():
    kept = Retained()
    for i in range(5):
        kept.keep(b"frame%d" % i)
    assert kept.after(2) == [b"frame2", b"frame3", b"frame4"]
    kept.acked(3)
    assert kept.size == len(b"frame3") + len(b"frame4")
    assert kept.after(3) == [b"frame3", b"frame4"]
    assert kept.after(5) == []


def test_past_the_bound_the_oldest_go_and_a_resume_that_needs_them_is_refused(monkeypatch):
    monkeypatch.setattr(module, "MAX_RETAINED", 10)
    kept = Retained()
    for data in (b"aaaa", b"bbbb", b"cccc", b"dddd"):
        kept.keep(data)
    assert kept.size <= 10 and kept.given_up == 2  # frames 1 and 2 given up
    assert kept.after(1) is None
    assert kept.after(2) == [b"cccc", b"dddd"]
