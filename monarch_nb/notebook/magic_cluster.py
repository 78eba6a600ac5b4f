"""The ``%monarch`` commands that manage the cluster: up, connect, run, status, down, restart,
scale, reset and interrupt; and ``controller()`` and ``guard()``, which every command goes through.
Each command is ``fn(magics, args)`` with the arguments ``magic_args.line_parser`` read."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from IPython.core.error import UsageError

from monarch_nb import errors
from monarch_nb.actors import mesh as actors
from monarch_nb.controller import keep, start
from monarch_nb.controller import mesh as device_mesh
from monarch_nb.controller.launch import run_script
from monarch_nb.dispatch.targets import TargetError, format_ranks
from monarch_nb.errors import ClusterError
from monarch_nb.notebook import rank_groups

NO_CLUSTER = "no cluster is up; start one with %monarch up (or %monarch connect ADDRESS)"


def controller():
    """The current controller, or the user's mistake (no cluster) in one line."""
    ctl = errors.current()
    if ctl is None or ctl.closed:
        raise UsageError(keep.taken_notice() or NO_CLUSTER)
    ctl.announce()
    return ctl


def guard(fn):
    """``fn()``, with the errors that mean the user asked for something impossible (a rank that
    is not there, a name that is not defined) as one-line UsageErrors."""
    try:
        return fn()
    except (ClusterError, TargetError, ValueError, NameError, TypeError) as e:
        raise UsageError(str(e)) from None


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def _table(rows: list[dict[str, Any]], columns: list[str], every: bool = False) -> str:
    """A row per rank, or from rank_groups.GROUP_FROM ranks (unless ``every``) a row per
    group of ranks alike, with a line saying so."""
    if every or len(rows) < rank_groups.GROUP_FROM:
        return format_table(rows, columns)
    grouped, kept = rank_groups.group(rows, columns)
    return (
        format_table(grouped, kept)
        + f"\n({len(rows)} ranks in {len(grouped)} row{'s' if len(grouped) > 1 else ''} "
        "of ranks alike; "
        "%monarch status --ranks shows a row per rank, with its pid)"
    )


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "?"


def _device(d: dict[str, Any]) -> str:
    if not d:
        return "-"
    return f"{d.get('kind', '?')}: {d.get('name', '?')} ({_gib(d.get('memory'))})"


def _print_ranks(ctl, verb: str) -> None:
    rows = ctl.status()
    for r in rows:
        r["device"] = _device(r["device"])
    dash = ""
    with contextlib.suppress(Exception):
        dash = f" (dashboard {ctl.client.dashboard_link})"
    ranks = "1 rank" if ctl.world_size == 1 else f"{ctl.world_size} ranks"
    print(f"monarch-nb: {verb} {ranks} at {ctl.scheduler_address}{dash}")
    print(_table(rows, ["rank", "host", "pid", "device", *_mesh_column(ctl, rows)]))
    if ctl.dist_backend:
        print(f"torch.distributed: {ctl.dist_backend} process group over all ranks")
    elif ctl.dist_error:
        print(f"torch.distributed: {ctl.dist_error}", file=sys.stderr)
    _say_mesh(ctl)
    if ctl.ft is not None:
        print(
            f"torchft: Lighthouse at {ctl.ft.address}; in a cell, ft.wrap(model, opt) and "
            "ft.steps(n) train on through a lost rank"
        )


def _say_quorum(ctl) -> None:
    """``%monarch status``'s line on torchft: the Lighthouse, and the last quorum the ranks
    reported (who is in it, its id, the step)."""
    if ctl.ft is None:
        return
    if not ctl.ft.alive:
        print(
            f"torchft: the Lighthouse (pid {ctl.ft.pid}) is gone; fault-tolerant cells cannot "
            "form a quorum: %monarch down, then %monarch up --ft",
            file=sys.stderr,
        )
        return
    q = ctl.ft_quorum
    if not q:
        print(f"torchft: Lighthouse at {ctl.ft.address}; no quorum yet (no ft.steps loop ran)")
        return
    print(
        f"torchft: quorum {q['quorum']} of {format_ranks(q['ranks'])} "
        f"({q['participants']} participants) at step {q['step']}; Lighthouse at {ctl.ft.address}"
    )


def kill(magics, args):
    ctl = controller()
    guard(lambda: ctl.kill(args.rank))
    print(f"monarch-nb: rank {args.rank}'s worker was sent SIGKILL")


def _mesh_column(ctl, rows: list[dict[str, Any]]) -> list[str]:
    """``["mesh"]`` with each row's coordinates (``dp=1 tp=0``) where the cluster has a mesh."""
    if not ctl.mesh_shape or ctl.mesh_error:
        return []
    for r in rows:
        r["mesh"] = " ".join(f"{k}={v}" for k, v in ctl.coordinates(r["rank"]).items())
    return ["mesh"]


def _say_mesh(ctl) -> None:
    if ctl.mesh_error:
        print(f"torch.distributed: {ctl.mesh_error}", file=sys.stderr)
    elif ctl.mesh_shape:
        print(f"device mesh: {device_mesh.text(ctl.mesh_shape)}, named mesh on every rank")


def up(magics, args):
    ctl = guard(
        lambda: start.up(
            workers=args.workers,
            cpu=args.cpu,
            threads=args.threads,
            dist=args.dist,
            backend=args.backend,
            tls=args.tls,
            mesh=args.mesh,
            keep=args.keep,
            name=args.name,
            ft=args.ft,
        )
    )
    _print_ranks(ctl, "started")
    if ctl.kept is not None:
        name, idle = ctl.kept["name"], keep.duration(ctl.kept["idle_limit"])
        print(
            f"monarch-nb: kept as {name}: it outlives this kernel (%monarch attach {name} after "
            f"a restart) until it goes {idle} without one; %monarch down shuts it down"
        )


def connect(magics, args):
    ctl = guard(
        lambda: start.connect(
            address=args.address,
            scheduler_file=args.scheduler_file,
            cluster=args.cluster,
            timeout=args.timeout,
            dist=args.dist,
            backend=args.backend,
            workers=args.workers,
            wait=args.wait,
            tls=args.tls,
            tls_ca_file=args.tls_ca_file,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            mesh=args.mesh,
            ft=args.ft,
        )
    )
    _print_ranks(ctl, "connected to")
    if ctl.owns_cluster:
        print(f"monarch-nb: {args.cluster} made this cluster; %monarch down shuts it down")


def run(magics, args):
    ctl = controller()
    missing = not args.module and not os.path.exists(args.script)
    if missing and not os.path.isabs(args.script):
        raise UsageError(f"run: no script at {args.script!r} (relative to {os.getcwd()})")
    codes = guard(lambda: run_script(ctl, args.script, args.args, args.targets, args.module))
    what = f"-m {args.script}" if args.module else args.script
    print(f"monarch-nb: {what} exited with code 0 on {format_ranks(codes.ranks)}")


def status(magics, args):
    ctl = controller()
    rows = ctl.status()
    for r in rows:
        r["device"] = _device(r["device"])
        r["pid"] = r["pid"] or "-"
        r["names"] = "-" if r["names"] is None else r["names"]
    columns = ["rank", "host", "pid", "device", *_mesh_column(ctl, rows), "state", "names"]
    mesh_names = set(ctl.mesh_shape or ())
    for r in rows:  # monarch_nb.label()'s; the mesh's coordinates have their own column
        mine = {k: v for k, v in (r.get("labels") or {}).items() if k not in mesh_names}
        r["labels"] = " ".join(f"{k}={v}" for k, v in mine.items()) or "-"
    if any(r["labels"] != "-" for r in rows):
        columns.append("labels")
    print(_table(rows, columns, every=args.ranks))
    _say_quorum(ctl)
    dead = actors.dead_actors(ctl)
    if dead:
        print("dead actors:")
        for mesh, rank, cause in dead:
            print(f"  {mesh} on rank {rank}: {cause}")


def down(magics, args):
    ctl = controller()
    owned = ctl.owns_cluster
    ctl.down()
    print(
        "monarch-nb: cluster shut down"
        if owned
        else "monarch-nb: disconnected; the cluster keeps running"
    )


def restart(magics, args):
    ctl = controller()
    ctl.restart()
    print(
        f"monarch-nb: restarted {format_ranks(range(ctl.world_size))}: fresh worker "
        "processes, same ranks, empty namespaces"
    )


def scale(magics, args):
    ctl = controller()
    done = guard(lambda: ctl.scale(args.n, wait=args.wait))
    print(f"monarch-nb: {done}")
    if done.dist_error:
        print(f"torch.distributed: {done.dist_error}", file=sys.stderr)


def mesh(magics, args):
    ctl = controller()
    if args.shape is not None:
        guard(lambda: ctl.set_mesh(args.shape))
    if not ctl.mesh_shape:
        why = f" ({ctl.mesh_error})" if ctl.mesh_error else ""
        print(f"monarch-nb: no device mesh{why}; %monarch mesh dp={ctl.world_size} builds one")
        return
    rows = [{"rank": r, "mesh": ""} for r in range(ctl.world_size)]
    _mesh_column(ctl, rows)
    done = "built" if args.shape is not None else "is"
    print(f"monarch-nb: device mesh {device_mesh.text(ctl.mesh_shape)} {done} on every rank")
    print(format_table(rows, ["rank", "mesh"]))


def reset(magics, args):
    ranks = guard(lambda: controller().reset(args.targets))
    print(f"monarch-nb: cleared the namespaces of {format_ranks(ranks)}")


def interrupt(magics, args):
    done = guard(lambda: controller().interrupt(args.targets, wait=True))
    print(f"monarch-nb: {done}", file=sys.stderr if done.troubled else sys.stdout)
