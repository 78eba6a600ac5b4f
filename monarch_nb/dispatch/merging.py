"""Lines that many ranks print with different numbers, merged into one (output.py's Renderer,
from GROUP_RANKS ranks up): ``loss 0.4821`` on rank 0, ``loss 0.5119`` on rank 12 and so on
become ``[ranks 0-63] loss 0.4821..0.5119``, and a rank whose number stands apart from the
others' gets a line of its own, so it stands out::

    [ranks 0-11,13-63] loss 0.4821..0.5119
    [rank 12] loss 9.73

Lines have the same shape when they are the same text once their numbers are masked; a rank
whose line has another shape (``loss nan``) is another line, as before.
"""

from __future__ import annotations

import re
import statistics
from typing import Any

# From this many ranks in a cell, lines of the same shape merge; under it every rank's line is
# shown as it is (the live panel's compact form starts at the same size).
GROUP_RANKS = 16
# A number lies apart when it is this many interquartile ranges outside the middle half of the
# ranks' numbers (with every rank but one printing the same number, any other number does).
FAR = 3.0

# a minus sign only where it starts a word: "rank-3" is rank 3, "step -3" is minus three
_NUMBER = re.compile(r"(?:(?<![\w.])-)?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def shape(text: str) -> str:
    """``text`` with every number masked: lines of one shape differ only in their numbers."""
    return _NUMBER.sub("\0", text)


def merge(texts: dict[int, str], apart: bool = True) -> list[tuple[list[int], str]]:
    """One shape's lines by rank, as the lines to show: ``(ranks, text)``, the ranks whose
    numbers lie together first (with each number that differs shown as ``low..high``), then
    the ranks that lie apart, those with the same line together (``apart=False``: none does,
    for numbers such as pids)."""
    if len(set(texts.values())) == 1:
        return [(sorted(texts), next(iter(texts.values())))]
    parts = {rank: _NUMBER.split(text) for rank, text in texts.items()}
    numbers = {rank: _NUMBER.findall(text) for rank, text in texts.items()}
    words = next(iter(parts.values()))
    slots = len(words) - 1
    alone: set[int] = set()
    for slot in range(slots if apart else 0):
        values = {rank: float(found[slot]) for rank, found in numbers.items()}
        alone |= far_apart(values)
    body = sorted(r for r in texts if r not in alone)
    out = []
    if body:
        text = words[0]
        for slot in range(slots):
            text += _span([numbers[r][slot] for r in body]) + words[slot + 1]
        out.append((body, text))
    same: dict[str, list[int]] = {}
    for rank in sorted(alone):
        same.setdefault(texts[rank], []).append(rank)
    out.extend((ranks, text) for text, ranks in same.items())
    return out


def _span(found: list[str]) -> str:
    """The numbers of one place as ``low..high`` in their own spelling, or the one number."""
    low = min(found, key=float)
    high = max(found, key=float)
    return low if float(low) == float(high) else f"{low}..{high}"


def far_apart(values: dict[Any, float]) -> set[Any]:
    """The keys (ranks) whose value lies apart from the others' (FAR)."""
    xs = sorted(values.values())
    if len(xs) < 4:
        return set()
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    reach = FAR * (q3 - q1)
    low, high = q1 - reach, q3 + reach
    far = {rank for rank, v in values.items() if v < low or v > high}
    return far if len(far) * 2 < len(values) else set()
