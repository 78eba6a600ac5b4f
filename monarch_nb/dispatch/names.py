"""Names that values are stored under, in a rank's namespace (push, scatter, pull) or the
notebook's (``--out``): normalised as Python reads a name in code, and the reserved ones
refused, each in one line.

Python reads identifiers in NFKC form, so the ``ﬁ`` (one ligature character) of ``ﬁ = 1`` in a
cell is the name ``fi``; a value stored under the raw ``ﬁ`` would be found by no code.
"""

from __future__ import annotations

import keyword
import re
import unicodedata

from monarch_nb.rank.engine import IDENTITY

# IPython's output history (_, __, ___, _5) and input history (_i, _ii, _iii, _i5): the shell
# overwrites them on every cell, and its displayhook reads them.
_HISTORY = re.compile(r"_{1,3}|_\d+|_i{1,3}|_i\d+")


def python_name(name: object, what: str) -> str:
    """``name`` as Python reads it in code; ValueError where it is no Python name. ``what``
    starts the message: ``cannot push to``."""
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"{what} {name!r}: not a valid Python name")
    return unicodedata.normalize("NFKC", name)


def _dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def rank_name(name: object, what: str) -> str:
    """A name to store a value under on the ranks: the names monarch-nb sets on every rank
    (``rank``, ``device``, ``get_ipython``, which ``!cmd`` calls...) and Python's own
    (``__builtins__``, ``__name__``) are refused: overwriting one breaks every later cell."""
    name = python_name(name, what)
    if name in IDENTITY:
        raise ValueError(
            f"{what} {name!r}: monarch-nb sets it on every rank ({', '.join(IDENTITY)}); "
            "use another name"
        )
    if _dunder(name):
        raise ValueError(f"{what} {name!r}: Python keeps that name for itself; use another")
    return name


def notebook_name(name: object, hidden, what: str) -> str:
    """A name to store a value under in the notebook's namespace; ``hidden`` holds the names
    the shell keeps there for itself (``In``, ``Out``, ``_oh``, ``get_ipython``...)."""
    name = python_name(name, what)
    if name in hidden or _dunder(name) or _HISTORY.fullmatch(name):
        raise ValueError(f"{what} {name!r}: IPython keeps that name for itself; use another")
    return name
