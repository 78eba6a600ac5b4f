"""A kept cluster seen from the kernel: asking its host's lease (host/lease.py) for it, the
object that stands for it as ``ctl.cluster``, letting go of it (``%monarch detach``), and being
taken over by another kernel (``%monarch attach --take`` there).

Letting go closes this kernel's side only: its links, its Dask client, its actor mailbox and its
registry entry. The ranks keep their namespaces, process group, device mesh and actors, and the
host starts the cluster's idle clock. A kernel taken over is told on the scheduler's
``monarch-keep`` event topic and lets go at once, in the background; its next command says so
in one line.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from monarch_nb import kept, registry
from monarch_nb.controller import cluster as clusters
from monarch_nb.controller import hosting, lifecycle
from monarch_nb.dispatch.targets import format_ranks
from monarch_nb.errors import ClusterError, current

if TYPE_CHECKING:
    from monarch_nb.controller.controller import Controller

_taken: list[str] = []  # what this kernel's next command says, once taken over


def security(entry: dict[str, Any]):
    """The ``distributed.Security`` to reach a kept TLS cluster (its certificate, from its
    owner-only file); None for plain TCP."""
    if entry["tls"] is None:
        return None
    from distributed import Security

    pems = entry["tls"]
    return Security(
        require_encryption=True,
        tls_ca_file=pems["ca"],
        tls_client_cert=pems["cert"],
        tls_client_key=pems["key"],
    )


def ask(client, entry: dict[str, Any], request: str, **fields) -> dict[str, Any]:
    """One request to the host's lease, with the cluster's token and this kernel's names."""
    return client.sync(
        client.scheduler.monarch_keep,
        request=request,
        token=entry["token"],
        client=client.id,
        kernel=registry.kernel_id(),
        notebook=hosting.notebook(),
        pid=os.getpid(),
        **fields,
    )


def claim(client, entry: dict[str, Any], take: bool) -> None:
    """Hold the cluster for this kernel; one line naming the kernel that holds it, unless
    ``take``."""
    said = ask(client, entry, "claim", take=take)
    if said.get("ok"):
        return
    holder = said.get("held")
    if holder:
        raise ClusterError(
            f"kept cluster {entry['name']} is attached to {kept.holder_text(holder)}; "
            f"%monarch attach {entry['name']} --take detaches it there and attaches here"
        )
    raise ClusterError(f"kept cluster {entry['name']} refused this kernel: {said.get('why')}")


class KeptCluster:
    """``ctl.cluster`` of a kept cluster: ``close()`` shuts its host down (``%monarch down``),
    ``scale(n)`` has the host add or drop nannies."""

    def __init__(self, entry: dict[str, Any], client):
        self.entry = entry
        self.client = client
        self.name = entry["name"]
        self.scheduler_address = entry["scheduler_address"]

    def scale(self, n: int) -> None:
        said = ask(self.client, self.entry, "scale", n=n)
        if not said.get("ok"):
            raise ValueError(said.get("why"))

    def close(self, timeout: float | None = None) -> None:
        if not kept.stop_host(self.entry):
            raise ClusterError(
                f"the host of kept cluster {self.name} (pid {self.entry['pid']}) did not exit "
                f"within {kept.STOP_WAIT:g} s of SIGTERM; kill -KILL {self.entry['pid']} ends it"
            )

    def __repr__(self) -> str:
        return f"<KeptCluster {self.name} at {self.scheduler_address}>"


def say_busy(client) -> None:
    """Before attaching: one line naming the ranks still running what the last kernel sent
    them (a cell when it was killed), which the attach waits for."""

    def running(dask_worker):  # by value: the workers need not import this module
        engine = dask_worker.extensions.get("monarch")
        return None if engine is None or engine.busy_since is None else engine.busy_since

    since = {w["name"]: t for w, t in _by_worker(client, client.run(running)) if t is not None}
    if since:
        ranks = format_ranks(sorted(r for r in since if isinstance(r, int)) or list(since))
        started = duration(time.time() - min(since.values()))
        print(
            f"monarch-nb: {ranks} still run what the last kernel sent them ({started} so far); "
            "attaching waits until it ends (interrupt to stop waiting)",
            file=sys.stderr,
            flush=True,
        )


def _by_worker(client, results: dict) -> list[tuple[dict, Any]]:
    workers = clusters.workers(client)
    return [(workers[a], v) for a, v in results.items() if a in workers]


def watch(ctl: Controller) -> None:
    """Once attached: the ranks' devices to the host (for the lists), and an ear for being
    taken over."""
    names = sorted({str(i.get("device", {}).get("name", "?")) for i in ctl._known.values()})
    devices = f"{ctl.world_size} x {', '.join(names)}" if names else f"{ctl.world_size} ranks"
    ask(ctl.client, ctl.kept, "describe", devices=devices[: kept.MAX_TEXT])

    def on_event(event) -> None:
        _, msg = event
        if isinstance(msg, dict) and msg.get("taken") == ctl.client.id and not ctl.closed:
            name = ctl.kept["name"]
            by = kept.holder_text(msg)
            ctl.taken = (
                f"{by} took kept cluster {name} over (%monarch attach --take); this kernel "
                f"is detached from it: %monarch attach {name} --take takes it back"
            )
            threading.Thread(
                target=_let_go, args=(ctl, ctl.taken), name="monarch-taken", daemon=True
            ).start()

    ctl.client.subscribe_topic(kept.TOPIC, on_event)


def detach(ctl: Controller) -> None:
    """``%monarch detach``: let the kept cluster go; it keeps running, with the ranks' state."""
    if ctl.closed:
        raise ClusterError("this cluster is down; start one with %monarch up")
    if ctl.kept is None:
        raise ClusterError(
            "this cluster runs inside this kernel and goes with it (it was started without "
            "--keep): %monarch up --keep starts one that outlives the kernel"
        )
    busy = sorted(ctl._router.busy())
    if busy:
        raise ClusterError(
            f"a %%monarch cell is running on {format_ranks(busy)}; detach once it has ended "
            "(handle.wait() waits for a --noblock one, %monarch interrupt stops it)"
        )
    ask(ctl.client, ctl.kept, "release")
    _let_go(ctl, f"this kernel detached from kept cluster {ctl.kept['name']}")


def _let_go(ctl: Controller, why: str) -> None:
    """This kernel's side of the cluster closed; the cluster and its actors go on."""
    name = ctl.kept["name"]
    drives_the_magics = current() is ctl  # a controller of a script's own is not the notebook's
    lifecycle.closing(
        ctl,
        f"detached: {why}; its actors live on: %monarch attach {name}, then "
        "monarch_nb.actor_mesh(NAME) gives a handle again",
    )
    ctl.owns_cluster = False  # down() leaves the cluster alone
    try:
        lifecycle.down(ctl)
    except Exception as e:  # the cluster is let go of all the same
        print(f"monarch-nb: letting go of {name}: {e}", file=sys.stderr)
    if ctl.taken and drives_the_magics:
        _taken.append(ctl.taken)


def taken_notice() -> str | None:
    """Once, after this kernel was taken over: what its next command says instead of "no
    cluster is up"."""
    return _taken.pop() if _taken else None


# -- the list ``%monarch attach`` shows -----------------------------------------------------
def rows(entries: list[dict[str, Any]]) -> list[dict[str, str]]:
    now = time.time()
    out = []
    for e in entries:
        detached = e["detached_since"]
        out.append(
            {
                "name": e["name"],
                "ranks": str(e["ranks"]),
                "devices": e["devices"],
                "age": duration(now - e["started"]),
                "idle": duration(now - detached) if detached else "-",
                "held by": kept.holder_text(e["holder"]) if e["holder"] else "detached",
                "idle limit": duration(e["idle_limit"]),
            }
        )
    return out


def duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"
