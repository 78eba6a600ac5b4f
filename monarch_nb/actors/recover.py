"""Actor meshes that outlive their notebook's kernel.

On a kept cluster (``%monarch up --keep``) the actors a notebook spawned live on when its kernel
goes (actors/worker.py keeps them for the next caller); a handle to them cannot, since it was
an object in that kernel. A notebook attached to the cluster finds them by name:
``%monarch actors`` lists them, and ``monarch_nb.actor_mesh(NAME)`` gives a handle again, which
takes up their output and their broadcast failures (the workers' ``adopt``). A mesh an actor
spawned is listed, and stays that actor's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from monarch_nb.actors import mesh as meshes
from monarch_nb.actors import worker
from monarch_nb.actors.adverbs import gather


@dataclass
class LiveMesh:
    """A mesh of live actors: ``points`` maps each place in the mesh to the rank it runs on."""

    name: str
    id: str
    info: tuple  # (class name, endpoints, plain methods), as an ActorMesh is pickled
    dims: dict[str, int]
    points: dict[int, int] = field(default_factory=dict)
    owners: set[str] = field(default_factory=set)  # "gone", "caller" (this notebook), "other"

    @property
    def held(self) -> str:
        if "other" in self.owners:
            return "an actor"
        return "this notebook" if self.owners == {"caller"} else "no one"


def live_meshes(ctl=None) -> list[LiveMesh]:
    """Every actor mesh living on the cluster's ranks, by name."""
    ctl = meshes._require_controller(ctl)
    mailbox = meshes._controller_state(ctl).mailbox
    found: dict[str, LiveMesh] = {}
    for rank, items in ctl.call(worker.live, mailbox.id).items():
        for item in items:
            live = found.setdefault(
                item["mesh"],
                LiveMesh(item["name"], item["mesh"], tuple(item["info"]), dict(item["dims"])),
            )
            live.points[item["pt"]] = rank
            live.owners.add(item["owner"])
    return sorted(found.values(), key=lambda m: (m.name, m.id))


def actor_mesh(name: str, ctl=None) -> meshes.ActorMesh:
    """A handle to the live actor mesh named ``name`` (spawned by this notebook or by one
    before it on this kept cluster); one ValueError naming the meshes there where there is no
    such mesh, or where an actor holds it."""
    ctl = meshes._require_controller(ctl)
    state = meshes._controller_state(ctl)
    for mesh in state.mailbox.meshes.values():
        if mesh.name == name:
            return mesh
    live = live_meshes(ctl)
    named = [m for m in live if m.name == name]
    if not named:
        there = ", ".join(sorted({m.name for m in live})) or "none"
        raise ValueError(
            f"no live actor mesh is named {name!r} on this cluster (there: {there}); "
            "%monarch actors lists them"
        )
    found = named[-1]
    if found.held == "an actor":
        raise ValueError(
            f"actor mesh {name!r} was spawned by an actor, which holds it; ask that actor"
        )
    members = meshes.proc_mesh(ctl)._members  # one per rank, in rank order
    positions = [found.points[pt] for pt in sorted(found.points)]
    mesh = meshes.ActorMesh(
        name, found.id, found.info, members, found.dims, positions, state.mailbox
    )
    where = f"{found.info[0]} (taking up {name!r})"
    base = {"op": "adopt", "mesh": found.id, "where": where}
    msgs = [{**base, "pt": i, "r": member.rank} for i, member in mesh._targets()]
    gather(mesh, msgs, where, lambda values: None).get()
    state.mailbox.meshes[found.id] = mesh
    return mesh
