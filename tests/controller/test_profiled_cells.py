"""A cell may profile or trace its rank's own thread (cProfile, a sys.settrace tracer) across
cells, before and after an interrupt. The engine once cleared undelivered interrupts in a way
that, on CPython 3.11, left every such cell's rank spinning for ever at its next call."""

from __future__ import annotations

import threading

import pytest

import monarch_nb
from monarch_nb.dispatch.results import CellError

PROFILE = """
import cProfile, io, pstats
_profile = cProfile.Profile()
_profile.enable()
"""
REPORT = """
_profile.disable()
_out = io.StringIO()
pstats.Stats(_profile, stream=_out).print_stats("work")
"work" in _out.getvalue()
"""
WORK = """
def work(n):
    total = 0
    for i in range(n):
        total += i
    return total
"""
TRACE = """
import sys
_lines = []
def _tracer(frame, event, arg):
    if event == "line" and frame.f_code.co_name == "work":
        _lines.append(frame.f_lineno)
    return _tracer
sys.settrace(_tracer)
"""


@pytest.fixture(scope="module")
def own():
    """A cluster of its own: a rank wedged by a failure here must not hold up other tests."""
    ctl = monarch_nb.up(workers=1, cpu=True, dist=False, current=False)
    ctl.run(WORK)
    yield ctl
    ctl.down()


def test_a_cell_profiles_its_rank_across_cells(own):
    own.run(PROFILE, timeout=20)
    assert own.run("work(1000)", timeout=20).values() == [499500]
    assert own.run(REPORT, timeout=20).values() == [True]


def test_a_cell_traces_its_rank_across_cells(own):
    own.run(TRACE, timeout=20)
    own.run("work(3)", timeout=20)
    assert own.run("sys.settrace(None)\nlen(_lines) > 3", timeout=20).values() == [True]


def test_profiling_still_works_after_an_interrupt(own):
    timer = threading.Timer(1.0, own.interrupt)
    timer.start()
    with pytest.raises(CellError, match="KeyboardInterrupt"):
        own.run("import time\nwhile True:\n    time.sleep(0.01)", timeout=30)
    timer.join()
    own.run(PROFILE, timeout=20)
    assert own.run("work(10)", timeout=20).values() == [45]
    assert own.run(REPORT, timeout=20).values() == [True]
