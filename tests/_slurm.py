"""A real Slurm on this machine for the tests: munged, slurmctld and slurmd as root, one node
(this host) with at least two job slots, everything they write under one temporary directory.

``Slurm.start()`` writes the config and a munge key, starts the three daemons and waits until
``sinfo`` shows the node idle; ``stop()`` cancels every job, stops the daemons and kills whatever
still carries this instance's ``SLURM_CONF`` in its environment (job steps, workers), so that no
process is left. The Slurm commands (sbatch, squeue, scancel) find this instance through
``SLURM_CONF``, which the caller puts in the environment. tests/_slurm_nodes.py makes a Slurm
of several nodes from this one: its own node lines (``_nodes``) and slurmds (``_start_nodes``);
each slurmd's spool directory, pid and log file are named after its node (``%n``).

Debian's slurm-wlm 22.05 in a container without systemd: no cgroup plugin is configured
(proctrack/linuxproc tracks a job's processes by parentage, task/none binds nothing), and
``SlurmdParameters=config_overrides`` lets the node offer two CPUs on a one-CPU machine.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

from _wait import wait_for

DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")
PARTITION = "debug"  # the default partition: the node, up
DOWN_PARTITION = "closed"  # the same node in a partition that is DOWN: its jobs stay PENDING


def why_not() -> str | None:
    """Why this machine cannot run the test Slurm, or None: the one line a skip gives."""
    missing = [d for d in DAEMONS if not os.access(d, os.X_OK)]
    if missing:
        return f"{', '.join(missing)} not installed (`make slurm` installs slurm-wlm and munge)"
    if os.geteuid() != 0:
        return "the test Slurm runs its daemons as root; this user is not root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _total_memory_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 4096


class Slurm:
    """One Slurm cluster of one node, all of it under ``self.root``."""

    def __init__(self) -> None:
        # short: the munge socket's path must fit a sockaddr_un (108 bytes)
        self.root = Path(tempfile.mkdtemp(prefix="mnb-slurm-"))
        self.node = socket.gethostname()
        self.controller_address = "127.0.0.1"  # where slurmctld listens for the nodes
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.sock"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []

    def command(self, *argv: str, timeout: float = 20) -> subprocess.CompletedProcess:
        return subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )

    def squeue(self) -> list[str]:
        """``JOBID STATE REASON`` of every job in the queue."""
        out = self.command("squeue", "-h", "-o", "%i %T %r")
        assert out.returncode == 0, out.stderr
        return out.stdout.split("\n")[:-1]

    def log(self) -> str:
        """The end of each daemon's log."""
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            if path.suffix in (".log", ".out"):
                parts.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-2000:])
        return "\n".join(parts)

    def _write_config(self) -> None:
        for sub in ("munge", "key", "state", "spool", "log", "run"):
            (self.root / sub).mkdir()
        for node in self.nodes():
            (self.root / "spool" / node).mkdir()
        (self.root / "key").chmod(0o700)  # munged refuses a key others can read
        key = self.root / "key" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        r = self.root
        self.conf.write_text(
            f"""ClusterName=monarchtest
SlurmctldHost={socket.gethostname()}({self.controller_address})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
{self._nodes()}"""
        )

    def nodes(self) -> list[str]:
        return [self.node]

    def _nodes(self) -> str:
        """slurm.conf's lines for the nodes and partitions (and what differs with them)."""
        cpus, memory = max(2, os.cpu_count() or 1), _total_memory_mb()
        return f"""NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory}
PartitionName={PARTITION} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
PartitionName={DOWN_PARTITION} Nodes={self.node} MaxTime=INFINITE State=DOWN
"""

    def _spawn(self, name: str, *argv: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(
            argv,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self.procs.append(proc)

    def start(self, timeout: float = 60) -> None:
        """Start the daemons; a RuntimeError with their logs when the node is not idle in time."""
        self._write_config()
        r = self.root
        self._spawn(
            "munged",
            "/usr/sbin/munged",
            "--foreground",
            "--force",  # root, and a socket directory under /tmp
            f"--key-file={r}/key/munge.key",
            f"--socket={self.munge_socket}",
            f"--log-file={r}/log/munged.log",
            f"--pid-file={r}/run/munged.pid",
            f"--seed-file={r}/run/munged.seed",
        )
        if not wait_for(self.munge_socket.exists, timeout=20, interval=0.1):
            raise RuntimeError(f"munged did not start\n{self.log()}")
        self._spawn("slurmctld", "/usr/sbin/slurmctld", "-D", "-i")
        self._start_nodes()

        def idle() -> bool:
            return set(self.states().values()) == {"idle"}

        if not wait_for(idle, timeout=timeout, interval=0.5):
            raise RuntimeError(
                f"the Slurm nodes did not become idle in {timeout:g} s: {self.states()}\n"
                f"{self.log()}"
            )

    def _start_nodes(self) -> None:
        self._spawn("slurmd", "/usr/sbin/slurmd", "-D", "-N", self.node)

    def states(self) -> dict[str, str]:
        """Each node's state as ``sinfo`` gives it (``idle``, ``mixed``, ``down*``...)."""
        out = self.command("sinfo", "-h", "-N", "-p", PARTITION, "-o", "%N %T", timeout=10)
        if out.returncode != 0:
            return {}
        return dict(line.split() for line in out.stdout.splitlines())

    def _ours(self) -> list[int]:
        """Processes (other than this one) whose environment names this instance's config."""
        mark = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
        return found

    def stop(self, cancel: bool = True) -> list[int]:
        """Cancel the jobs (unless ``cancel`` is false: their nodes are gone), stop the
        daemons, kill what is left; the pids that outlived the SIGKILL (an empty list: no
        process is left)."""
        with contextlib.suppress(Exception):
            if cancel:
                self.command("scancel", "--full", "--user", "root", timeout=10)
                wait_for(lambda: not self.squeue(), timeout=15, interval=0.3)
        for proc in reversed(self.procs):  # slurmd, slurmctld, then munged
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for pid in self._ours():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not _living(self._ours()), timeout=10, interval=0.1)
        left = _living(self._ours())
        shutil.rmtree(self.root, ignore_errors=True)
        return left


def _living(pids: list[int]) -> list[int]:
    """The pids that have not exited (a zombie waits only to be reaped by its parent)."""
    alive = []
    for pid in pids:
        with contextlib.suppress(OSError):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                alive.append(pid)
    return alive


def wait_until_empty(slurm: Slurm, timeout: float = 30) -> bool:
    return wait_for(lambda: not slurm.squeue(), timeout=timeout, interval=0.3)


@contextlib.contextmanager
def running():
    """A Slurm started for a test module and stopped after it, leaving no process behind;
    skipped where Slurm cannot run here. ``SLURM_CONF`` points scontrol, sbatch, squeue and
    scancel at it meanwhile."""
    import pytest

    reason = why_not()
    if reason:
        pytest.skip(reason)
    if importlib.util.find_spec("dask_jobqueue") is None:
        pytest.skip("dask-jobqueue is not installed (dev extra)")
    s = Slurm()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", str(s.conf))
        try:
            s.start()
        except RuntimeError as e:
            s.stop()
            pytest.fail(str(e))
        try:
            yield s
        finally:
            left = s.stop()
    assert left == [], f"processes of the test Slurm left running: {left}"
