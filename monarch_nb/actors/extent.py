"""A mesh's sizes by dimension name, as torchmonarch's ``Extent``: ``Extent(["x", "y"], [2, 3])``
prints ``{x: 2, y: 3}`` and reads like a dict (``extent["y"]``, ``dict(extent)``).

Its own module, with nothing above it to import, because both ``actor.Point`` and
``value_mesh.ValueMesh`` hold one.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import re
from collections.abc import Iterable, Iterator, Mapping

# torchmonarch prints a label bare when it is [A-Za-z0-9_]* and as a quoted string otherwise.
_BARE_LABEL = re.compile(r"[A-Za-z0-9_]*")


class Extent(Mapping):
    """The sizes of a mesh's dimensions, in order: ``labels``, ``sizes``, ``nelements``.

    Two Extents are equal when their labels and sizes are, in the same order (as in
    torchmonarch). Unlike torchmonarch's, an Extent also equals a dict of the same sizes, as any
    Mapping does: monarch_nb's own code and tests compare extents with dict literals.
    """

    __slots__ = ("_sizes",)

    def __init__(self, labels: Iterable[str], sizes: Iterable[int]):
        if isinstance(labels, str):
            raise TypeError(f"Extent takes a list of labels, not the string {labels!r}")
        labels, sizes = list(labels), list(sizes)
        if len(labels) != len(sizes):
            raise ValueError(
                f"Extent got {len(labels)} labels and {len(sizes)} sizes: give one size per label"
            )
        for label in labels:
            if not isinstance(label, str):
                raise TypeError(f"Extent labels are strings, not {type(label).__name__} {label!r}")
        repeated = sorted({label for label in labels if labels.count(label) > 1})
        if repeated:
            raise ValueError(
                f"Extent labels must differ: {', '.join(map(repr, repeated))} given more than once"
            )
        for label, size in zip(labels, sizes, strict=True):
            if isinstance(size, bool) or not hasattr(size, "__index__"):
                raise TypeError(
                    f"Extent sizes are ints, not {type(size).__name__} ({label}={size!r})"
                )
            if size < 0:
                raise ValueError(f"Extent sizes cannot be negative ({label}={size})")
        self._sizes = {label: operator.index(n) for label, n in zip(labels, sizes, strict=True)}

    @property
    def labels(self) -> list[str]:
        return list(self._sizes)

    @property
    def sizes(self) -> list[int]:
        return list(self._sizes.values())

    @property
    def nelements(self) -> int:
        """How many points the mesh has (1 for no dimensions: a single point)."""
        return math.prod(self._sizes.values())

    def __getitem__(self, label: str) -> int:
        try:
            return self._sizes[label]
        except KeyError:
            raise KeyError(f"{label!r} is not a dimension of {self}") from None

    def __contains__(self, label: object) -> bool:
        return label in self._sizes

    def __iter__(self) -> Iterator[str]:
        return iter(self._sizes)

    def __len__(self) -> int:
        return len(self._sizes)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Extent):
            return list(self._sizes.items()) == list(other._sizes.items())
        return Mapping.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]  # unhashable, as in torchmonarch

    def __repr__(self) -> str:
        body = ", ".join(f"{_show_label(label)}: {size}" for label, size in self._sizes.items())
        return "{" + body + "}"

    __str__ = __repr__

    def __reduce__(self):
        return Extent, (self.labels, self.sizes)


def _show_label(label: str) -> str:
    # json.dumps quotes and escapes as Rust's {:?} does for all but control characters.
    return label if _BARE_LABEL.fullmatch(label) else json.dumps(label, ensure_ascii=False)


def row_major(picks: list, sizes: list[int]) -> list[int]:
    """The row-major positions, in a mesh of ``sizes``, of every combination of ``picks`` (the
    indices chosen in each dimension), in row-major order: what a slice selects."""
    positions = []
    for index in itertools.product(*picks):
        flat = 0
        for i, size in zip(index, sizes, strict=True):
            flat = flat * size + i
        positions.append(flat)
    return positions
