"""Members of the cluster arranged in named dimensions, and slicing them: what actor meshes
and process meshes share (mesh.py builds on it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from monarch_nb.actors.extent import Extent, row_major
from monarch_nb.actors.mailbox import Mailbox


class _Member(NamedTuple):
    rank: int  # the cluster rank of the worker
    address: str
    host: str
    incarnation: str = ""  # which worker process at that address (RankInfo.incarnation)


class Shaped:
    """Members of the cluster arranged in named dimensions; a slice keeps the full member list
    and the positions it selects, in row-major order of ``extent``."""

    def __init__(self, members, dims: Mapping[str, int], positions, mailbox: Mailbox | None = None):
        self._members: tuple[_Member, ...] = tuple(members)
        self._dims = dict(dims)
        self._positions: tuple[int, ...] = tuple(positions)
        self._box = mailbox

    @property
    def extent(self) -> Extent:
        return Extent(self._dims, self._dims.values())

    sizes = extent

    def size(self, dim: str | None = None) -> int:
        if dim is None:
            return len(self._positions)
        if dim not in self._dims:
            raise ValueError(f"unknown dimension {dim!r}; this mesh has {self._describe_dims()}")
        return self._dims[dim]

    def __len__(self) -> int:
        return len(self._positions)

    def _describe_dims(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self._dims.items()) or "no dimensions"

    def _targets(self) -> list[tuple[int, _Member]]:
        """(position in this slice, member) for every actor this mesh addresses."""
        return [(i, self._members[p]) for i, p in enumerate(self._positions)]

    def slice(self, **selection):
        """``mesh.slice(gpus=slice(0, 2))`` keeps a dimension; ``mesh.slice(hosts=0)`` drops it."""
        unknown = [k for k in selection if k not in self._dims]
        if unknown:
            raise ValueError(
                f"cannot slice by {', '.join(map(repr, unknown))}: this mesh has dimensions "
                f"{self._describe_dims()}"
            )
        picks, dims = [], {}
        for name, size in self._dims.items():
            sel = selection.get(name, slice(None))
            if isinstance(sel, slice):
                chosen = list(range(*sel.indices(size)))
                if not chosen:
                    raise IndexError(f"{name}={_show(sel)} selects nothing (size {size})")
                dims[name] = len(chosen)
            elif isinstance(sel, int) and not isinstance(sel, bool):
                if not -size <= sel < size:
                    raise IndexError(f"{name}={sel} is out of range 0..{size - 1}")
                chosen = [sel % size]
            else:
                raise TypeError(f"{name}= takes an int or a slice, not {type(sel).__name__}")
            picks.append(chosen)
        flat = row_major(picks, list(self._dims.values()))
        return self._with(dims, [self._positions[i] for i in flat])


def _show(sel: slice) -> str:
    parts = ["" if x is None else str(x) for x in (sel.start, sel.stop, sel.step)]
    return ":".join(parts[:2] if sel.step is None else parts)


def _dims_of(ranks) -> dict[str, int]:
    """{"hosts": H, "gpus": G} when every host holds G consecutive ranks, else {"ranks": N}."""
    hosts: list[str] = []
    for info in ranks:
        if not hosts or hosts[-1] != info.host:
            hosts.append(info.host)
    per_host = len(ranks) // len(hosts)
    if len(set(hosts)) == len(hosts) and per_host * len(hosts) == len(ranks):
        counts = [sum(1 for i in ranks if i.host == h) for h in hosts]
        if all(c == per_host for c in counts):
            return {"hosts": len(hosts), "gpus": per_host}
    return {"ranks": len(ranks)}
