"""Several hosts on one machine, each a network namespace: the tests build the network themselves
and remove it afterwards, whatever happens::

    root namespace (the test: the controller)  10.77.N.1  ─┐
    mnb-T-ROLE (host name mnb-ROLE)           10.77.N.X  ─┤ bridge br0 in mnb-T-hub
    ...                                                    ─┘

N is a /24 that no route of this machine uses yet, T a tag of this network; each role's last
octet is given. Every host has its own host name (``unshare --uts``) and sees the machine's
file system: a Unix-domain socket by path (munge's) is reachable from all of them.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def why_not() -> str | None:
    """Why this machine cannot build namespaces, or None: the one line a skip gives."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"util-linux's {tool} is not installed (a host's processes start with it)"
    probe = f"mnb-probe-{secrets.token_hex(2)}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace (needs CAP_NET_ADMIN): {made.stderr.strip()}"
    ip("netns", "delete", probe, check=False)
    return None


def _free_subnet() -> int:
    """A third octet N such that no route of this machine touches 10.77.N.0/24."""
    routes = ip("-4", "route", "show", "table", "all", check=False).stdout
    taken = {int(p.split(".")[2]) for p in routes.split() if p.startswith("10.77.")}
    free = [n for n in range(1, 255) if n not in taken]
    if not free:
        pytest.skip("no free 10.77.N.0/24 subnet on this machine")
    return random.choice(free)


class Network:
    """The namespaces, links and processes of one test; ``close()`` removes all of them."""

    def __init__(self, hosts: Mapping[str, int], logs: Path):
        self.hosts = dict(hosts)  # role -> the last octet of its address
        self.tag = secrets.token_hex(2)
        self.net = f"10.77.{_free_subnet()}"
        self.logs = logs
        self.namespaces: list[str] = []
        self.root_link = f"mnb{self.tag}r"
        self.procs: list[subprocess.Popen] = []

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge (where the controller is)."""
        return f"{self.net}.1"

    def ns(self, role: str) -> str:
        return f"mnb-{self.tag}-{role}"

    def address(self, role: str) -> str:
        return f"{self.net}.{self.hosts[role]}"

    def build(self) -> None:
        hub = self.ns("hub")
        self._add_ns(hub)
        ip("-n", hub, "link", "add", "br0", "type", "bridge")
        ip("-n", hub, "link", "set", "br0", "up")
        ip("link", "add", self.root_link, "type", "veth", "peer", "name", "p-root", "netns", hub)
        ip("addr", "add", f"{self.gateway}/24", "dev", self.root_link)
        ip("link", "set", self.root_link, "up")
        self._plug(hub, "p-root")
        for role in self.hosts:
            ns = self.ns(role)
            self._add_ns(ns)
            ip("-n", hub, "link", "add", f"p-{role}", "type", "veth", "peer", "name", "eth0")
            ip("-n", hub, "link", "set", "eth0", "netns", ns)
            self._plug(hub, f"p-{role}")
            ip("-n", ns, "addr", "add", f"{self.address(role)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def _add_ns(self, name: str) -> None:
        ip("netns", "add", name)
        self.namespaces.append(name)

    @staticmethod
    def _plug(hub: str, port: str) -> None:
        ip("-n", hub, "link", "set", port, "master", "br0")
        ip("-n", hub, "link", "set", port, "up")

    def start(self, role: str, *argv: str, env: Mapping[str, str]) -> subprocess.Popen:
        """``argv`` in ``role``'s namespace with host name ``mnb-ROLE``, in its own session,
        its output in ``logs/ROLE.log``."""
        log = open(self.logs / f"{role}.log", "wb")  # noqa: SIM115 (closed with the process)
        own_name = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', f"mnb-{role}"]
        # nsenter, not `ip netns exec`: that one mounts a /sys of its own, without the cgroup
        # file systems slurmd needs
        proc = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.ns(role)}", *own_name, *argv],
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def build_or_skip(self) -> None:
        """``build``, or skip the test where this machine cannot."""
        try:
            self.build()
        except subprocess.CalledProcessError as e:
            pytest.skip(f"this machine cannot build the test network: {e.cmd}: {e.stderr}")

    def dask_scheduler(self, role: str, port: int, env: Mapping[str, str], *extra: str) -> None:
        """A Dask scheduler in ``role``'s namespace, on its address and ``port``."""
        command = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
        self.start(
            role, *command, "--host", self.address(role), "--port", str(port), *extra, env=env
        )

    def link(self, role: str, state: str) -> None:
        """Take ``role``'s link to the bridge ``down`` or bring it ``up``."""
        ip("-n", self.ns(role), "link", "set", "eth0", state)

    def kill(self, role: str) -> list[int]:
        """SIGKILL every process in ``role``'s namespace (the host dies); their pids."""
        pids = [int(p) for p in ip("netns", "pids", self.ns(role), check=False).stdout.split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def log(self, role: str) -> str:
        path = self.logs / f"{role}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for ns in self.namespaces:
            # Whatever a process of ours left running in the namespace (a nanny's child).
            for pid in ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for ns in reversed(self.namespaces):
            ip("netns", "delete", ns, check=False)
        ip("link", "delete", self.root_link, check=False)
