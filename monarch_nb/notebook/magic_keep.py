"""The ``%monarch`` commands of kept clusters (``%monarch up --keep``): ``attach`` (the list of
them, then the only one or the one named), ``detach``, and ``actors`` (the live actor meshes,
which a kernel attaching takes up by name)."""

from __future__ import annotations

from monarch_nb import kept
from monarch_nb.actors import recover
from monarch_nb.controller import keep, start
from monarch_nb.dispatch.targets import format_ranks
from monarch_nb.notebook.magic_cluster import _print_ranks, controller, format_table, guard

GONE = (
    "monarch-nb: what the old kernel held itself (ValueMesh results, cell and actor mesh "
    "handles) went with it; the ranks' namespaces, process group and actors are kept"
)


def attach(magics, args):
    if args.name is None:
        rows = keep.rows(kept.entries())
        if rows:
            print(format_table(rows, ["name", "ranks", "devices", "age", "idle", "held by"]))
    ctl = guard(lambda: start.attach(args.name, take=args.take))
    _print_ranks(ctl, f"attached to {ctl.kept['name']}:")
    print(GONE)
    meshes = guard(lambda: recover.live_meshes(ctl))
    if meshes:
        names = ", ".join(sorted({m.name for m in meshes}))
        print(
            f"monarch-nb: live actor meshes: {names}; monarch_nb.actor_mesh(NAME) gives a "
            "handle again (%monarch actors lists them)"
        )


def detach(magics, args):
    ctl = controller()
    guard(ctl.detach)
    name, idle = ctl.kept["name"], keep.duration(ctl.kept["idle_limit"])
    print(
        f"monarch-nb: detached from {name}; it keeps running, every rank's state with it: "
        f"%monarch attach {name} in any kernel of yours (it shuts itself down after {idle} "
        "without one)"
    )


def actors(magics, args):
    ctl = controller()
    meshes = guard(lambda: recover.live_meshes(ctl))
    if not meshes:
        print("monarch-nb: no live actor meshes on this cluster")
        return
    rows = [
        {
            "name": m.name,
            "class": m.info[0],
            "actors": len(m.points),
            "ranks": format_ranks(sorted(set(m.points.values()))),
            "held by": m.held,
        }
        for m in meshes
    ]
    print(format_table(rows, ["name", "class", "actors", "ranks", "held by"]))
    print("monarch_nb.actor_mesh(NAME) gives a handle to one")
