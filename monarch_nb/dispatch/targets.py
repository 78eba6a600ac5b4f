"""Target specs: which ranks a cell or a request goes to.

A spec is ``all``, one rank (``0``, ``-1``), a list (``0,2``), a slice (``1:3``, ``::2``) or a
comma-separated mix of these; the API also takes an int or an iterable of ints.
"""

from __future__ import annotations

from collections.abc import Iterable

HELP = "use all, 0, 0,2, 1:3 or ::2"


class TargetError(ValueError):
    """A target spec that names no valid rank."""


def parse_targets(spec: str | int | Iterable[int] | None, world_size: int) -> list[int]:
    """Ranks selected by ``spec`` among ``range(world_size)``, sorted and without repeats."""
    if world_size <= 0:
        raise TargetError("the cluster has no ranks; start one with %monarch up")
    if spec is None:
        return list(range(world_size))
    if isinstance(spec, bool):
        raise TargetError(f"target spec {spec!r} is not a rank; {HELP}")
    if isinstance(spec, int):
        return [_one(spec, world_size, str(spec))]
    if not isinstance(spec, str):
        ranks = []
        for item in spec:
            if isinstance(item, bool) or not isinstance(item, int):
                raise TargetError(f"target {item!r} is not an integer rank; {HELP}")
            ranks.append(_one(item, world_size, str(item)))
        if not ranks:
            raise TargetError(f"the target list is empty; {HELP}")
        return sorted(set(ranks))

    text = spec.strip()
    if text in ("all", "*", ""):
        if text == "":
            raise TargetError(f"empty target spec; {HELP}")
        return list(range(world_size))
    selected: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise TargetError(f"target spec {spec!r} has an empty item; {HELP}")
        if ":" in part:
            selected.update(_slice(part, world_size, spec))
        else:
            selected.add(_one(_int(part, spec), world_size, spec))
    return sorted(selected)


def _int(text: str, spec: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise TargetError(f"target spec {spec!r}: {text!r} is not a rank; {HELP}") from None


def _one(rank: int, world_size: int, spec: str) -> int:
    if not -world_size <= rank < world_size:
        raise TargetError(
            f"target spec {spec!r}: rank {rank} is out of range; "
            f"this cluster has ranks 0..{world_size - 1}"
        )
    return rank % world_size


def _slice(part: str, world_size: int, spec: str) -> list[int]:
    pieces = part.split(":")
    if len(pieces) > 3:
        raise TargetError(f"target spec {spec!r}: {part!r} is not a slice; {HELP}")
    start, stop, step = (_int(p, spec) if p.strip() else None for p in [*pieces, ""][:3])
    if step == 0:
        raise TargetError(f"target spec {spec!r}: a slice step cannot be zero")
    for bound in (start, stop):
        if bound is not None and not -world_size <= bound <= world_size:
            raise TargetError(
                f"target spec {spec!r}: {bound} is out of range; "
                f"this cluster has ranks 0..{world_size - 1}"
            )
    ranks = list(range(world_size))[slice(start, stop, step)]
    if not ranks:
        raise TargetError(f"target spec {spec!r} selects no ranks out of 0..{world_size - 1}")
    return ranks


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``'ranks 0-3'``; ``[0, 2]`` -> ``'ranks 0,2'``;
    ``[1]`` -> ``'rank 1'``."""
    rs = sorted(set(ranks))
    if len(rs) == 1:
        return f"rank {rs[0]}"
    return "ranks " + compact(rs)


def compact(ranks: list[int]) -> str:
    """Sorted ranks as runs: ``[0, 1, 2, 5]`` -> ``'0-2,5'``."""
    runs: list[str] = []
    start = prev = None
    for r in ranks:
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            runs.append(f"{start}-{prev}" if prev > start else str(start))
            start = prev = r
    if start is not None:
        runs.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(runs)
