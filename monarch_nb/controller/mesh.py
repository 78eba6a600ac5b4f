"""The device mesh: ``%monarch mesh dp=2,tp=2``, ``up(mesh={"dp": 2, "tp": 2})``.

A shape is an ordered mapping of dimension names to sizes whose product is the world size. The
controller keeps the shape and has every rank build the ``torch.distributed`` DeviceMesh over the
default process group each time the group forms (rank/mesh.py): after ``up``, a replaced worker,
a restart, an interrupt that left the ranks out of step, ``scale``. Rank ``r``'s coordinates
are ``r``'s place in the row-major shape, as ``init_device_mesh`` lays the ranks out.

``scale`` keeps every dimension but the first, which takes up the new world size: ``dp=2,tp=2``
scaled to 8 is ``dp=4,tp=2``, and 6 does not fit (refused before anything starts).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from monarch_nb.dispatch.results import CellError
from monarch_nb.errors import ClusterError
from monarch_nb.rank import mesh as rank_mesh

if TYPE_CHECKING:
    from monarch_nb.controller.controller import Controller

Shape = dict[str, int]
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_EXAMPLE = "e.g. dp=2,tp=2"


def parse(spec: Any) -> Shape | None:
    """A shape from ``"dp=2,tp=2"`` (commas or spaces), a mapping or ``(name, size)`` pairs;
    ``None``, ``""``, ``"off"`` and ``"none"`` mean no mesh. Every mistake is one ValueError."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "off", "none")):
        return None
    if isinstance(spec, str):
        pairs = []
        for part in re.split(r"[,\s]+", spec.strip()):
            name, eq, size = part.partition("=")
            if not eq:
                raise ValueError(
                    f"mesh: {part!r} has no size; give each dimension as NAME=SIZE, {_EXAMPLE}"
                )
            pairs.append((name.strip(), size.strip()))
    elif isinstance(spec, Mapping):
        pairs = list(spec.items())
    else:
        try:
            pairs = [tuple(p) for p in spec]
        except TypeError:
            pairs = None
        if pairs is None or any(len(p) != 2 for p in pairs):
            raise ValueError(
                "mesh: give a mapping of names to sizes ({'dp': 2, 'tp': 2}) or text "
                f"({_EXAMPLE}), not {type(spec).__name__}"
            )
    if not pairs:
        raise ValueError(f"mesh: no dimensions; give each as NAME=SIZE, {_EXAMPLE}")
    shape: Shape = {}
    for name, size in pairs:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(
                f"mesh: {name!r} is not a dimension name; use letters, digits and _ (dp, tp, pp...)"
            )
        if name in shape:
            raise ValueError(f"mesh: {name} is named twice; each dimension once, {_EXAMPLE}")
        shape[name] = _size(name, size)
    return shape


def _size(name: str, size: Any) -> int:
    if isinstance(size, str) and re.fullmatch(r"\s*-?[0-9]+\s*", size):
        # ASCII digits only: "²" is a digit to str.isdigit, not to int()
        try:
            size = int(size)
        except ValueError:  # past Python's 4300 digits
            raise ValueError(
                f"mesh: {name} has {len(size.strip())} digits: no cluster is that large"
            ) from None
    if isinstance(size, bool) or not isinstance(size, int):
        raise ValueError(f"mesh: {name}={size!r}: a size is a whole number, at least 1")
    if size < 1:
        raise ValueError(f"mesh: {name}={size}: a size is at least 1")
    return size


def text(shape: Shape | None) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items()) if shape else "none"


def check_world(shape: Shape, world_size: int) -> None:
    """One line where the shape's product is not the number of ranks."""
    n = math.prod(shape.values())
    if n != world_size:
        have = "1 rank" if world_size == 1 else f"{world_size} ranks"
        raise ValueError(
            f"mesh {text(shape)} covers {n} ranks but the cluster has {have}: give sizes whose "
            f"product is {world_size}, or scale to {n} first (%monarch scale {n})"
        )


def coordinates(shape: Shape, rank: int) -> dict[str, int]:
    """Rank ``rank``'s place in the row-major ``shape``: ``{"dp": 1, "tp": 0}``."""
    out = {}
    for name, size in reversed(shape.items()):
        rank, out[name] = divmod(rank, size)
    return dict(reversed(out.items()))


def rescaled(shape: Shape, n: int) -> Shape:
    """The shape for ``n`` ranks: the first dimension takes up the change; one line where
    ``n`` is not a multiple of the other dimensions' product."""
    first, *rest = shape
    per = math.prod(shape[k] for k in rest)
    if n % per:
        fixed = ",".join(f"{k}={shape[k]}" for k in rest)
        raise ValueError(
            f"{n} ranks do not fit the mesh {text(shape)}: {first} grows or shrinks and {fixed} "
            f"stays, so the size must be a multiple of {per}; or set another mesh first "
            "(%monarch mesh NAME=SIZE,...)"
        )
    return {first: n // per, **{k: shape[k] for k in rest}}


def build(ctl: Controller) -> None:
    """Every rank builds ``ctl.mesh_shape`` over the group just formed; ``ctl.mesh_error`` says
    why not. Called with the group's lock held (``Controller._form_group``)."""
    ctl.mesh_error = None
    shape = ctl.mesh_shape
    if not shape:
        return
    try:
        check_world(shape, ctl.world_size)
        ctl.call(rank_mesh.build, tuple(shape), tuple(shape.values()))
    except (ValueError, CellError) as e:
        ctl.mesh_error = f"the device mesh {text(shape)} was not built: {_short(e)}"


def set_mesh(ctl: Controller, spec: Any) -> Shape | None:
    """``%monarch mesh SPEC``: check, then build on every rank (``None``/``"off"``: drop it).
    Refused, with nothing changed, while a cell runs or without a process group."""
    shape = parse(spec)
    ctl._check_open()
    busy = sorted(ctl._router.busy())
    if busy:
        raise ClusterError(
            "a %%monarch cell is running; set the mesh once it has ended "
            "(%monarch interrupt stops it)"
        )
    if shape is None:
        ctl.mesh_shape = ctl.mesh_error = None
        ctl.call(rank_mesh.drop)
        return None
    check_world(shape, ctl.world_size)
    if not ctl.dist_backend:
        why = ctl.dist_error or "the cluster was started with --no-dist"
        raise ClusterError(f"a device mesh needs the torch.distributed process group: {why}")
    with ctl._group_lock:
        old = ctl.mesh_shape
        ctl.mesh_shape = shape
        build(ctl)
        if ctl.mesh_error:
            error, ctl.mesh_shape = ctl.mesh_error, old
            build(ctl)  # the ranks go back to the mesh they had
            raise ClusterError(error)
    return shape


def _short(e: BaseException) -> str:
    if isinstance(e, CellError):
        first = next(iter(e.errors.values()))
        return f"rank {first.rank}: {first.ename}: {first.evalue}"
    return str(e)
