"""What ``call()`` returns in torchmonarch's API: one value per point of a mesh, read by point.

``ValueMesh(Extent(["x", "y"], [2, 3]), values)`` holds the values in row-major order of the
extent. ``item(x=1, y=2)`` reads one, ``items()`` yields ``(Point, value)``, ``slice`` and
``flatten`` give new meshes whose points are their own positions (``slice(y=1)`` of the mesh
above has points ``{'x': 0/2}`` and ``{'x': 1/2}``), as in torchmonarch.

Where torchmonarch refuses what a list of values could do, this does it: a slice with a step or
a negative step, ``flatten`` after such a slice, and negative indices counted from the end (as
``ActorMesh.slice`` takes them, so a mesh and its results slice alike). Mistakes raise the
exception types torchmonarch raises.
"""

from __future__ import annotations

import math
import operator
import pprint
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from monarch_nb.actors.actor import Point
from monarch_nb.actors.extent import Extent, row_major

__all__ = ["Extent", "ValueMesh"]


class ValueMesh:
    """One value per point of ``extent``, in row-major order.

    ``item(**coords)``, ``items()``, ``values()``, iteration (the items), ``len``, ``get(i)``
    (by position), ``slice(**selection)`` (an int drops its dimension, a slice keeps it),
    ``flatten(name)``; ``extent``, ``sizes`` and ``size(dim)`` as on a mesh.
    """

    __slots__ = ("_extent", "_values")

    def __init__(self, extent: Mapping[str, int], values: Sequence[Any]):
        if not isinstance(extent, Extent):
            extent = Extent(list(extent), list(extent.values()))
        values = list(values)
        if len(values) != extent.nelements:
            raise ValueError(
                f"a ValueMesh of {extent} holds {extent.nelements} values (row-major), "
                f"got {len(values)}"
            )
        self._extent = extent
        self._values = values

    @property
    def extent(self) -> Extent:
        return self._extent

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self._extent)

    def size(self, dim: str | Sequence[str] | None = None) -> int:
        """How many values: in all, along ``dim``, or across several dims."""
        if dim is None:
            return len(self._values)
        if isinstance(dim, str):
            if dim not in self._extent:
                raise KeyError(f"{dim!r} is not a dimension of this ValueMesh ({self._extent})")
            return self._extent[dim]
        return math.prod(self.size(d) for d in dim)

    def __len__(self) -> int:
        return len(self._values)

    def get(self, index: int) -> Any:
        """The value at position ``index`` in row-major order of this mesh (not a cluster rank)."""
        n, i = len(self._values), _as_int(index, "get()")
        if not -n <= i < n:
            raise ValueError(f"get({i}) is out of range: this ValueMesh holds {n} values")
        return self._values[i]

    def item(self, **coords: int) -> Any:
        """The value at ``coords``, one for every dimension: ``item(x=1, y=2)``; ``item()`` on a
        mesh with no dimensions left (``mesh.slice(x=1, y=2).item()``)."""
        missing = [label for label in self._extent if label not in coords]
        if missing:
            needed = ", ".join(f"{label}=" for label in missing)
            raise KeyError(f"item() needs {needed} too: this ValueMesh is {self._extent}")
        extra = [label for label in coords if label not in self._extent]
        if extra:
            raise KeyError(f"item has extra dimensions: {extra} (this ValueMesh is {self._extent})")
        flat = 0
        for label, size in self._extent.items():
            flat = flat * size + _position(label, coords[label], size, "item")
        return self._values[flat]

    def items(self) -> Iterator[tuple[Point, Any]]:
        """``(point, value)`` in row-major order; points are positions in this mesh."""
        for rank, value in enumerate(self._values):
            yield Point(rank, self._extent), value

    def values(self) -> list[Any]:
        return list(self._values)

    def __iter__(self) -> Iterator[tuple[Point, Any]]:
        return self.items()

    def slice(self, **selection: int | slice) -> ValueMesh:
        """``slice(y=1)`` drops ``y``; ``slice(y=slice(0, 2))`` keeps it, of size 2."""
        for label in selection:
            if label not in self._extent:
                raise TypeError(
                    f"Shape does not have dimension labeled {label!r}: "
                    f"this ValueMesh is {self._extent}"
                )
        picks, kept = [], {}
        for label, size in self._extent.items():
            sel = selection.get(label, slice(None))
            if isinstance(sel, slice):
                chosen = range(*sel.indices(size))
                if not chosen:
                    raise ValueError(f"{label}={_show(sel)} selects nothing (size {size})")
                kept[label] = len(chosen)
            else:
                chosen = [_position(label, sel, size, "slice")]
            picks.append(chosen)
        values = [self._values[i] for i in row_major(picks, list(self._extent.sizes))]
        return ValueMesh(Extent(list(kept), list(kept.values())), values)

    def flatten(self, name: str) -> ValueMesh:
        """One dimension ``name`` holding every value, in row-major order."""
        if not isinstance(name, str):
            raise TypeError(f"flatten() takes the new dimension's name, not {name!r}")
        return ValueMesh(Extent([name], [len(self._values)]), self._values)

    def __repr__(self) -> str:
        body = textwrap.indent(pprint.pformat(tuple(self.items())), "  ")
        return f"ValueMesh({self._extent}):\n{body}"

    def __reduce__(self):
        return ValueMesh, (self._extent, self._values)


def _as_int(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{where} takes an int, not {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{where} takes an int, not {type(value).__name__} {value!r}") from None


def _position(label: str, index: Any, size: int, method: str) -> int:
    """``index`` along a dimension of ``size`` (negative counts from the end)."""
    if isinstance(index, slice) and method == "item":
        raise TypeError(f"item() takes an int per dimension; to select {label}=..., use slice()")
    i = _as_int(index, f"{method}({label}=...)")
    if not -size <= i < size:
        raise IndexError(f"{method}({label}={i}) is out of range: {label} has size {size}")
    return i % size


def _show(sel: slice) -> str:
    parts = ["" if x is None else str(x) for x in (sel.start, sel.stop, sel.step)]
    return ":".join(parts[:2] if sel.step is None else parts)
