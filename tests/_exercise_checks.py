"""What the tests of the course's checkers (tests/examples/) share."""

from __future__ import annotations

import pytest


def said(capsys, right: bool, check, *args, **kwargs) -> str:
    """Call ``check`` with the answer and its context; assert it was ``right`` (or not) and
    printed the matching verdict; return the line it printed."""
    assert bool(check(*args, **kwargs)) is right
    out = capsys.readouterr().out
    assert out.startswith("right: " if right else "not quite: "), out
    return out.strip()


def table_tests(wrong: list, right: list):
    """The two tests of a checker module written as tables: each ``(check, args, kwargs, why)``
    of ``wrong`` is ``not quite:`` and says ``why``; each ``(check, args, kwargs)`` of ``right``
    is right. Assign them to test_ names in the module."""

    @pytest.mark.parametrize("f,args,kwargs,why", wrong, ids=[w[0].__name__ for w in wrong])
    def test_a_likely_mistake_is_not_quite_and_says_why(capsys, f, args, kwargs, why):
        line = said(capsys, False, f, *args, **kwargs)
        assert why in line, line

    @pytest.mark.parametrize("f,args,kwargs", right, ids=[r[0].__name__ for r in right])
    def test_the_answer_is_right(capsys, f, args, kwargs):
        said(capsys, True, f, *args, **kwargs)

    return test_a_likely_mistake_is_not_quite_and_says_why, test_the_answer_is_right
