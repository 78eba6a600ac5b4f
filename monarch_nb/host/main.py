"""A kept cluster's host process, from start to shutdown.

``%monarch up --keep`` (controller/hosting.py) starts it with ``BOOT`` in a session of its own,
so that neither the kernel's death nor JupyterLab's signals to the kernel's process group
(SIGINT for the stop button, SIGKILL for a restart that hangs) reach it, and hands it the plan
on its stdin (the token never shows in ``ps``). It starts the cluster as ``up`` does in the
kernel (cluster.py's SpecCluster: the scheduler and a nanny per rank here, the workers forked
from a forkserver of its own), puts the lease on the scheduler (lease.py), writes the
kept-cluster file (kept.py) and tells the kernel on the ready pipe. It holds the cluster's
name (the lock the kernel claimed, inherited) for as long as it runs. Then it waits, writing
its file and its name's lock file again where they were deleted, and shuts the cluster down
when asked (SIGTERM: ``%monarch down``, the sidebar's "Shut down"), when its scheduler is
closed, or when no kernel has held it for its idle limit; it says why in its log.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from monarch_nb import kept

TICK = 0.5  # seconds between looks at the idle clock and the scheduler


def say(text: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"{stamp} monarch-nb host {os.getpid()}: {text}", file=sys.stderr, flush=True)


def main(ready_fd: int) -> None:
    stop = threading.Event()
    reason: dict[str, str] = {}

    def on_term(signum, frame) -> None:
        reason.setdefault("why", "asked to shut down (SIGTERM: %monarch down or the sidebar)")
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    from monarch_nb.controller import forkserver

    spec = json.loads(sys.stdin.read())
    sys.stdin.close()
    name = Name(spec["name"], spec["claim_fd"])
    forkserver.start()  # first: the workers' imports run there while this process imports Dask
    say(f"starting kept cluster {spec['name']} ({len(spec['plans'])} workers)")
    try:
        cluster, entry, lease = _start(spec, stop)
    except BaseException as e:  # the kernel shows it in one line
        say(f"could not start: {type(e).__name__}: {e}")
        name.release()
        _tell(ready_fd, {"ok": False, "error": f"{type(e).__name__}: {e}"})
        raise SystemExit(1) from None
    _tell(ready_fd, {"ok": True})
    say(f"up at {entry['scheduler_address']}: {entry['ranks']} ranks")
    why = _serve(cluster, lease, name, stop)
    if lease.beacon is not None:
        lease.beacon.close()
    asked = stop.is_set()  # by a user (SIGTERM, %monarch down), not the idle limit
    why = reason.get("why") or lease.stop_reason or why
    lease.remove_file()  # first: no kernel attaches to a cluster going down
    name.release()
    from monarch_nb.controller import cluster as clusters

    gone = cluster.scheduler.status.name in ("closing", "closed", "failed")
    with contextlib.suppress(Exception):
        clusters.close_cluster(cluster, gone)
    say(f"shut down: {why}")
    if asked:  # what a user asked for: nothing to read later
        with contextlib.suppress(OSError):
            os.unlink(kept.log_path(entry["id"]))


def _tell(fd: int, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, json.dumps(message).encode() + b"\n")
    with contextlib.suppress(OSError):
        os.close(fd)


def _start(spec: dict[str, Any], stop: threading.Event):
    from monarch_nb.controller import certificates
    from monarch_nb.controller import cluster as clusters
    from monarch_nb.host.lease import Lease

    plans = [clusters.WorkerPlan(p["name"], p["env"], p["gpu"]) for p in spec["plans"]]
    security = certificates.temporary_security() if spec["tls"] else None
    cluster = clusters.start_local(plans, threads=spec["threads"], security=security)
    beacon = None
    try:
        scheduler = cluster.scheduler
        deadline = time.monotonic() + 120
        while len(scheduler.workers) < len(plans):
            if time.monotonic() > deadline or stop.is_set():
                raise RuntimeError(f"{len(scheduler.workers)} of {len(plans)} workers started")
            time.sleep(0.05)
        beacon = _lighthouse() if spec.get("ft") else None
        now = time.time()
        entry = {
            "id": spec["id"],
            "name": spec["name"],
            "scheduler_address": scheduler.address,
            "dashboard_url": _dashboard(cluster, scheduler.address),
            "token": spec["token"],
            "ranks": len(plans),
            "devices": spec["devices"],
            "started": now,
            "pid": os.getpid(),
            "pid_started": registry_started(),
            "idle_limit": spec["idle_limit"],
            "dist": spec["dist"],
            "group": [socket.gethostname(), os.getpgid(0), os.getpid()],
            "tls": _pems(security),
            "holder": None,
            "detached_since": None,
            "ft": None if beacon is None else {"address": beacon.address, "pid": beacon.pid},
        }
        lease = Lease(entry, stop, cluster, say)
        lease.beacon = beacon

        async def install() -> None:
            await scheduler.register_scheduler_plugin(lease, name=Lease.name, idempotent=False)
            scheduler.handlers["monarch_keep"] = lease.handle

        cluster.sync(install)
        lease.write_file()
    except BaseException:
        with contextlib.suppress(Exception):
            cluster.close(timeout=10)
        if beacon is not None:
            beacon.close()
        raise
    return cluster, entry, lease


def _lighthouse():
    """torchft's Lighthouse for a cluster kept with ``--ft``: this process's child, so that it
    outlives the kernel as the workers do (controller/lighthouse.py)."""
    from monarch_nb.controller import lighthouse

    lighthouse.check_installed()
    return lighthouse.Lighthouse()


def _renew_lighthouse(lease) -> None:
    """A Lighthouse that exited is started again, and the file says where: the next cell of
    the kernel attached (or the next to attach) tells the ranks (lighthouse.renew)."""
    old = lease.beacon
    if old is None or old.alive:
        return
    old.close()
    lease.beacon = beacon = _lighthouse()
    lease.entry["ft"] = {"address": beacon.address, "pid": beacon.pid}
    lease.write_file()
    say(f"torchft's Lighthouse (pid {old.pid}) exited; a new one runs at {beacon.address}")


def registry_started() -> float | None:
    from monarch_nb import registry

    return registry._process_started(os.getpid())


def _dashboard(cluster, address: str) -> str | None:
    from monarch_nb import registry

    try:
        link = cluster.dashboard_link
    except Exception:  # no dashboard
        return None
    return registry.dashboard_for(link, address)


def _pems(security) -> dict[str, str] | None:
    """The temporary certificate and key as PEM text, for the kernels that attach: in the
    kept-cluster file, which only this user can read."""
    if security is None:
        return None
    return {
        "ca": security.tls_ca_file,
        "cert": security.tls_client_cert,
        "key": security.tls_client_key,
    }


class Name:
    """The cluster's name, held with the lock the kernel claimed (kept.claim_name) and handed
    on; claimed again where its lock file is deleted (a runtime directory cleaned), so that
    no second cluster takes the name while this one runs."""

    def __init__(self, name: str, fd: int):
        self.name, self.fd = name, fd
        os.set_inheritable(fd, False)  # this process's alone: its children exec without it
        self.lost = False  # said once: another cluster claimed the name after the file went

    def keep(self) -> None:
        if kept.holds_name(self.fd, self.name):
            return
        try:
            fd = kept.claim_name(self.name)
            why = f"another kept cluster has claimed {self.name} since"
        except OSError as e:
            fd, why = None, f"claiming it again failed: {e}"
        if fd is None:
            if not self.lost:
                say(f"its name's lock file {self.name}.lock was deleted, and {why}")
            self.lost = True
            return
        os.close(self.fd)  # a lock on a file no longer there
        self.fd, self.lost = fd, False
        say(f"its name's lock file {self.name}.lock was deleted: claimed again")

    def release(self) -> None:
        kept.release_name(self.fd, self.name)


def _serve(cluster, lease, name: Name, stop: threading.Event) -> str:
    """Wait until the cluster is to go, keeping its file and its name's lock; why it goes."""
    limit = lease.entry["idle_limit"]
    while not stop.wait(TICK):
        try:
            lease.restore()
            name.keep()
            _renew_lighthouse(lease)
        except Exception as e:  # the cluster matters more than its files
            say(f"keeping its files: {type(e).__name__}: {e}")
        if cluster.scheduler.status.name in ("closing", "closed", "failed"):
            return "its scheduler was closed (the sidebar's Shut down, or scheduler.close())"
        idle = lease.idle_for()
        if idle is not None and idle >= limit:
            return f"no kernel held it for its idle limit of {_duration(limit)}"
    return "asked to shut down"


def _duration(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"
