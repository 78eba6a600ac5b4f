"""A rank's ``mesh``: the ``torch.distributed`` DeviceMesh the controller asks every rank to
build over the default process group (``%monarch mesh dp=2,tp=2``), named ``mesh`` in the rank's
namespace beside ``rank`` and ``device``.

Without one, ``mesh`` is a ``NoMesh``: any use of it (``mesh["dp"]``, ``fully_shard(model,
mesh=mesh)``) says in one line how to build one, where ``None`` would let torch fall back to a
1-D mesh of its own without a word. The rank's coordinates (``dp=1 tp=0``) become its labels,
which the live panel and the sidebar show, with those of ``labels.label()``.
"""

from __future__ import annotations

from typing import Any


class NoMesh:
    """What ``mesh`` is on a rank of a cluster without a device mesh."""

    def __init__(self, world_size: int | None = None):
        self._size = world_size

    def _why(self) -> str:
        n = self._size or "N"
        return (
            "this cluster has no device mesh: build one with %monarch mesh dp="
            f"{n} (names and sizes of your choice, e.g. dp=2,tp=2), or %monarch up --mesh"
        )

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):  # copy, pickle and friends probe these
            raise AttributeError(name)
        raise RuntimeError(self._why())

    def __getitem__(self, key):
        raise RuntimeError(self._why())

    def __repr__(self) -> str:
        return "<no device mesh: %monarch mesh dp=N,... builds one>"


def build(engine, names: tuple[str, ...], sizes: tuple[int, ...]) -> str:
    """On every rank at once (``init_device_mesh`` forms a group per slice, collectively):
    the mesh over the default group, put in the namespace; returns this rank's coordinates."""
    from torch.distributed.device_mesh import init_device_mesh

    device = engine.device_info.get("torch", "cpu").split(":")[0]
    mesh = init_device_mesh(device, sizes, mesh_dim_names=names)
    engine.mesh = mesh
    engine.namespace["mesh"] = mesh
    coords = dict(zip(names, mesh.get_coordinate(), strict=True))
    engine.mesh_coords = {k: str(v) for k, v in coords.items()}
    return " ".join(f"{k}={v}" for k, v in coords.items())


def drop(engine) -> None:
    """No mesh (``%monarch mesh off``, or its group about to go): ``mesh`` says how to build one.
    The DeviceMesh's groups go with the default group (``dist._leave``)."""
    engine.mesh = None
    engine.namespace["mesh"] = NoMesh(engine.identity.get("world_size"))
    engine.mesh_coords = {}


def current(engine) -> Any:
    return engine.mesh if engine.mesh is not None else NoMesh(engine.identity.get("world_size"))


def shape(engine) -> tuple[tuple[str, int], ...] | None:
    """The dimensions of the rank's mesh, ``(("dp", 2), ("tp", 2))``; None without one."""
    mesh = engine.mesh
    if mesh is None:
        return None
    return tuple(zip(mesh.mesh_dim_names, (int(n) for n in mesh.shape), strict=True))
