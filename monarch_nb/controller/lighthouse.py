"""torchft's Lighthouse for a cluster started with ``--ft``: the quorum server every rank's
Manager asks, each step, who takes part (torchft's own, from its package: no quorum protocol
of ours).

It runs as a child of the kernel (``python -c BOOT``), not as a thread of it: a kernel's Ctrl-C
or a hung cell never stops it, it can be watched and stopped as a process, and it ends with the
kernel (it exits when its stdin, a pipe from the kernel, closes). A kept cluster's is a child of
its host process instead (host/main.py), so that it outlives the kernel as the workers do; a
kernel attached to it sees it as ``Kept``.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time

# Seconds without a heartbeat after which the Lighthouse counts a rank's Manager gone, and the
# survivors' next quorum forms without it (torchft's default is 5 s: the survivors' wait).
HEARTBEAT_TIMEOUT_MS = 1000
# How long a quorum waits for every rank that heartbeats to ask for it (a replacement asks
# a moment after its Manager starts heartbeating).
JOIN_TIMEOUT_MS = 5000
START_TIMEOUT = 20.0

BOOT = """
import sys, time
from torchft._torchft import LighthouseServer
server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms={join},
                          heartbeat_timeout_ms={heartbeat})
print(server.address(), flush=True)
sys.stdin.read()  # until the kernel goes, or closes the pipe
server.shutdown()
"""

INSTALL = "pip install torchft (make lab and make test install it)"


def check_installed() -> None:
    """One line where torchft cannot be imported, before anything starts. Its Rust side reads
    its log level once, as it is first imported, and the workers forked after from this process
    keep it: below warnings, every quorum of every step would be a line of the cells' output."""
    import os

    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft._torchft  # noqa: F401
    except ImportError as e:
        from monarch_nb.errors import ClusterError

        raise ClusterError(
            f"--ft needs torchft, which cannot be imported here ({e}): {INSTALL}"
        ) from None


class Lighthouse:
    """The Lighthouse process and its address (``http://host:port``)."""

    def __init__(self):
        check_installed()
        self.closing = False
        code = BOOT.format(join=JOIN_TIMEOUT_MS, heartbeat=HEARTBEAT_TIMEOUT_MS)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=_quiet_env(),
            start_new_session=True,  # the stop button's SIGINT is the kernel's, not its
        )
        self.address = self._read_address()

    def _read_address(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT
        line = b""
        while time.monotonic() < deadline and not line:
            line = self.proc.stdout.readline()
            if self.proc.poll() is not None:
                break
        address = line.decode().strip()
        if not address.startswith("http"):
            self.close()
            from monarch_nb.errors import ClusterError

            raise ClusterError(
                "torchft's Lighthouse did not start (its process exited or printed no address "
                f"within {START_TIMEOUT:.0f} s)"
            )
        return address

    def watch(self, on_exit) -> None:
        """Call ``on_exit(self)`` from a thread of its own if the process exits unasked."""

        def wait() -> None:
            self.proc.wait()
            if not self.closing:
                on_exit(self)

        threading.Thread(target=wait, daemon=True, name="monarch-lighthouse").start()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def successor(self) -> Lighthouse:
        """A new one, where this one exited."""
        return Lighthouse()

    def close(self) -> None:
        self.closing = True
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


class Kept:
    """The Lighthouse of a kept cluster, as a kernel attached to it sees it: a child of the
    cluster's host process (host/main.py), which starts it with the cluster, starts another where
    it exits, and stops it at ``down``; its address and pid are in the kept-cluster file."""

    POLL = 0.25  # seconds between two looks at whether it still runs

    def __init__(self, entry: dict):
        self.entry = entry
        self.address, self.pid = entry["ft"]["address"], entry["ft"]["pid"]
        self.closing = False

    @property
    def alive(self) -> bool:
        import psutil

        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def watch(self, on_exit) -> None:
        def wait() -> None:
            while not self.closing and self.alive:
                time.sleep(self.POLL)
            if not self.closing:
                on_exit(self)

        threading.Thread(target=wait, daemon=True, name="monarch-lighthouse").start()

    def close(self) -> None:
        """Stop watching: the host, not this kernel, stops it."""
        self.closing = True

    def successor(self) -> Kept:
        """The one the host started in its place (within ``START_TIMEOUT``)."""
        from monarch_nb import kept
        from monarch_nb.errors import ClusterError

        self.close()
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                entry = kept.load(self.entry["id"])
                if entry and entry.get("ft") and entry["ft"]["pid"] != self.pid:
                    beacon = Kept(entry)
                    if beacon.alive:
                        return beacon
            time.sleep(0.1)
        raise ClusterError(
            f"the kept cluster's host started no new Lighthouse within {START_TIMEOUT:.0f} s "
            f"(its log: {kept.log_path(self.entry['id'])})"
        )


def _quiet_env() -> dict[str, str]:
    import os

    # one thread for its async runtime, as each rank's Manager has (rank/ft_torch.py says why)
    return {**os.environ, "RUST_LOG": "warn", "TOKIO_WORKER_THREADS": "1"}


def exited(ctl, beacon: Lighthouse) -> None:
    """The Lighthouse of ``ctl`` exited unasked: its fault-tolerant cells still running are
    released with that reason (their quorums could never form again); the next cell starts a
    new one (``renew``)."""
    reason = (
        f"torchft's Lighthouse (pid {beacon.pid}) exited, so no quorum can form; the next "
        "cell starts a new one, and ft.wrap goes on from the step reached"
    )
    for req in list(ctl._router.live.values()):
        if req.on_lost is not None and req.on_failure is not None:
            req.on_failure.because(reason)


def renew(ctl) -> None:
    """Before a cell: a Lighthouse that exited is started again, and every rank told where."""
    old = ctl.ft
    if old is None or old.alive:
        return
    old.close()  # its pipe
    beacon = old.successor()
    beacon.watch(lambda b: exited(ctl, b))
    ctl.ft = beacon
    ctl.rank_env["TORCHFT_LIGHTHOUSE"] = beacon.address
    ctl.call(_set_env, dict(ctl.rank_env))
    ctl._notice(
        f"torchft's Lighthouse (pid {old.pid}) had exited; a new one runs at {beacon.address}"
    )


def _set_env(engine, env: dict[str, str]) -> None:
    import os

    os.environ.update(env)
