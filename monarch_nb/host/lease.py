"""Which kernel holds a kept cluster, on the scheduler of its host.

A kernel's controller asks, through its Dask client, with the token of the kept-cluster file
(kept.py) that only its user can read: ``claim`` (refused while another kernel's client holds
it, unless ``take``, which tells that kernel on the ``monarch-keep`` event topic), ``release``
(``%monarch detach``), ``describe`` (the ranks' devices, once its controller knows them),
``scale`` and ``shutdown``. A holder whose client leaves the scheduler (its kernel exited,
restarted or was killed) lets go by itself; from then on the idle clock runs, and the host
shuts the cluster down once it has run for the cluster's idle limit.

The lease writes the kept-cluster file at each change, from the scheduler's event loop, and
``restore`` writes it again, from the host's main thread, where it is no longer the file last
written (deleted, say, with the runtime directory): a lock keeps the two apart.
"""

from __future__ import annotations

import hmac
import os
import threading
import time
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from monarch_nb import kept, registry

START_GRACE = 120.0  # seconds for the kernel that started the cluster to claim it


class Lease(SchedulerPlugin):
    """The holder of one kept cluster and its idle clock; ``entry`` is its kept-cluster file,
    written again at each change of hands."""

    name = "monarch-keep"

    def __init__(self, entry: dict[str, Any], stop: threading.Event, cluster=None, say=print):
        self.entry = entry
        self.stop = stop
        self.cluster = cluster
        self.say = say
        self.scheduler = None
        self.client: str | None = None  # the holder's Dask client id
        self.claimable_until = time.time() + START_GRACE  # the idle clock waits until then
        self.stop_reason: str | None = None
        self.closing = False  # shutting down: its file removed, and not written again
        self._writing = threading.RLock()  # restore() writes with it held
        self._written: tuple | None = None  # (inode, mtime) of the file as last written
        self._failed = False  # a failure to write is said once, until a write works again
        self.beacon = None  # --ft: torchft's Lighthouse (controller/lighthouse.py), a child

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler

    # -- the idle clock ---------------------------------------------------------------------
    def idle_for(self) -> float | None:
        """Seconds since the last kernel let go; None while one holds it (or the kernel that
        started it may still claim it)."""
        now = time.time()
        if self.client is not None or now < self.claimable_until:
            return None
        return now - (self.entry["detached_since"] or self.entry["started"])

    def _let_go(self, why: str) -> None:
        holder = self.entry["holder"] or {}
        self.client = None
        self.entry["holder"] = None
        self.entry["detached_since"] = time.time()
        self.claimable_until = 0.0
        self._write()
        self.say(f"detached from {kept.holder_text(holder)} ({why})")

    def write_file(self) -> None:
        """Write the kept-cluster file now (raises OSError), unless the host is closing."""
        with self._writing:
            if not self.closing:
                st = os.stat(kept.write(self.entry))
                self._written, self._failed = (st.st_ino, st.st_mtime_ns), False

    def _write(self) -> None:
        with self._writing:
            try:
                self.write_file()
            except OSError as e:  # the cluster goes on; restore() tries again
                if not self._failed:
                    self.say(f"cannot write {kept.kept_dir()}: {e}")
                self._written, self._failed = None, True

    def remove_file(self) -> None:
        """The host shutting down: its file removed, and written no more."""
        with self._writing:
            self.closing = True
            kept.remove(self.entry["id"])

    def restore(self) -> None:
        """Write the file again where it is not the one last written: deleted (the runtime
        directory cleaned, by hand or at logout) or replaced."""
        path = kept.kept_dir() / f"{self.entry['id']}.json"
        with self._writing:
            try:
                st = os.stat(path, follow_symlinks=False)
                there = (st.st_ino, st.st_mtime_ns)
            except OSError:
                there = None
            if there == self._written or self.closing:
                return
            if self._written is not None:
                self.say("its file was deleted or replaced: written again")
            self._write()

    def remove_client(self, scheduler, client: str) -> None:
        if client == self.client:
            self._let_go("its client left: the kernel exited, restarted or was killed")

    # -- what kernels ask ---------------------------------------------------------------------
    def handle(
        self,
        request: str | None = None,
        token: str | None = None,
        client: str | None = None,
        kernel: str | None = None,
        notebook: str | None = None,
        pid: int | None = None,
        take: bool = False,
        devices: str | None = None,
        n: int | None = None,
    ) -> dict[str, Any]:
        if not isinstance(token, str) or not hmac.compare_digest(token, self.entry["token"]):
            return {"ok": False, "why": "the token is not this cluster's"}
        op = request
        if op == "claim":
            return self._claim(client, _who(kernel, notebook, pid), take)
        if op == "release":
            if client is not None and client == self.client:
                self._let_go("the kernel detached")
            return {"ok": True}
        if op == "describe" and client == self.client and kept._text(devices):
            self.entry["devices"] = devices
            self._write()
            return {"ok": True}
        if op == "scale" and isinstance(n, int) and n >= 1:
            return self._scale(n)
        if op == "shutdown":
            who = kept.holder_text(_who(kernel, notebook, pid))
            self.stop_reason = f"{who} shut it down (%monarch down)"
            self.stop.set()
            return {"ok": True}
        return {"ok": False, "why": f"unknown request {op!r}"}

    def _claim(self, client, who: dict[str, Any], take) -> dict[str, Any]:
        if not isinstance(client, str):
            return {"ok": False, "why": "no client id"}
        holder = self.entry["holder"]
        held = self.client is not None and self.client in (self.scheduler.clients or {})
        if held and self.client != client:
            if take is not True:
                self.say(f"refused {kept.holder_text(who)}: {kept.holder_text(holder)} holds it")
                return {"ok": False, "held": holder}
            self.scheduler.log_event(kept.TOPIC, {"taken": self.client, **who})
            self.say(f"{kept.holder_text(who)} took it over from {kept.holder_text(holder)}")
        self.client = client
        self.entry["holder"] = {**who, "since": time.time()}
        self.entry["detached_since"] = None
        self._write()
        self.say(f"attached to {kept.holder_text(who)} (Dask client {client})")
        return {"ok": True}

    def _scale(self, n: int) -> dict[str, Any]:
        """Grow with nannies planned as ``up`` plans them, or drop the specs of the workers the
        controller has retired (the highest ranks)."""
        from monarch_nb.controller.scale import _plan_local_workers

        try:
            if n > len(self.cluster.worker_spec):
                _plan_local_workers(self.cluster, n)
            self.cluster.scale(n)
        except ValueError as e:
            return {"ok": False, "why": str(e)}
        self.entry["ranks"] = n
        self._write()
        return {"ok": True}


def _who(kernel, notebook, pid) -> dict[str, Any]:
    """A kernel's names as the file may hold them (kept.parse): what does not fit is left out
    rather than making the file unreadable."""
    return {
        "kernel": kernel
        if kept._text(kernel, 64) and registry._KERNEL_ID.fullmatch(kernel)
        else None,
        "notebook": notebook if kept._text(notebook) else None,
        "pid": pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None,
    }
