"""The course's exercises: a checker per exercise, which says whether an answer is right and why.

An exercise cell in a notebook reads::

    answer = ...  # your answer here
    check.ddp_bytes(answer)

and each checker prints one line (``right: ...``, ``not quite: ...`` or ``not answered yet``) and
returns whether the answer was right, as a ``Verdict`` that the notebook does not show again
under the line; it never raises, so a notebook run top to bottom with its exercises unanswered
still runs. The answers are in ``notebooks/answers/``, a notebook per lesson
that a teacher can withhold. Each lesson's checkers are a module here, named for its topic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

RIGHT, WRONG, UNANSWERED = "right", "not quite", "not answered yet"


class Verdict:
    """Whether an answer was right: true or false as a bool is, shown by the line the checker
    printed rather than again as ``True`` or ``False`` under it."""

    __slots__ = ("right",)

    def __init__(self, right: bool):
        self.right = bool(right)

    def __bool__(self) -> bool:
        return self.right

    def __eq__(self, other: object) -> bool:
        return self.right == other

    def __hash__(self) -> int:
        return hash(self.right)

    def __repr__(self) -> str:
        return repr(self.right)

    def _ipython_display_(self) -> None:
        """Nothing: the checker's line said it."""


def verdict(right: bool, why: str) -> bool:
    """Print the verdict on an answer, with why; return whether it was right."""
    print(f"{RIGHT if right else WRONG}: {why}")
    return right


def answered(answer: Any, hint: str) -> bool:
    """Whether ``answer`` was given (not ``...``); if not, say so with ``hint``."""
    if answer is ...:
        print(f"{UNANSWERED}: {hint}")
        return False
    return True


def close(answer: Any, expected: float, rel: float = 0.02) -> bool:
    """Whether ``answer`` is a number within ``rel`` of ``expected``."""
    try:
        value = float(answer)
    except (TypeError, ValueError):
        return False
    return abs(value - expected) <= rel * abs(expected)


def checker(hint: str) -> Callable[[Callable[..., bool]], Callable[..., Verdict]]:
    """Decorate a check ``f(answer, ...) -> bool`` so that ``...`` is met with ``hint`` and the
    result is a ``Verdict``."""

    def wrap(f: Callable[..., bool]) -> Callable[..., Verdict]:
        def check(answer: Any = ..., *args: Any, **kwargs: Any) -> Verdict:
            if not answered(answer, hint):
                return Verdict(False)
            return Verdict(f(answer, *args, **kwargs))

        return functools.wraps(f)(check)

    return wrap
