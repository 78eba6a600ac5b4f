"""What the tests of the course's checkers (tests/examples/) share."""

from __future__ import annotations


def said(capsys, right: bool, check, *args, **kwargs) -> str:
    """Call ``check`` with the answer and its context; assert it was ``right`` (or not) and
    printed the matching verdict; return the line it printed."""
    assert bool(check(*args, **kwargs)) is right
    out = capsys.readouterr().out
    assert out.startswith("right: " if right else "not quite: "), out
    return out.strip()
