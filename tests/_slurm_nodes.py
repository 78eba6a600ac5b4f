"""A real Slurm of several nodes on this machine: munged and slurmctld in the root namespace (the
notebook's host), a slurmd in each of three network-namespace hosts (tests/_netns.py)::

    root namespace: the test (notebook, Dask scheduler), slurmctld, munged   10.77.N.1
    mnb-T-n0 (host name mnb-n0): slurmd -N mnb-n0, its jobs                  10.77.N.11
    mnb-T-n1 (host name mnb-n1): slurmd -N mnb-n1, its jobs                  10.77.N.12
    mnb-T-n2 (host name mnb-n2): slurmd -N mnb-n2, its jobs                  10.77.N.13

Each node has its own NodeAddr, spool directory, pid and log file (``%n`` in slurm.conf); all of
them reach munged's socket by its path and slurmctld at 10.77.N.1. A job runs in its node's
namespace, so a rank's worker listens on that node's address, and the link to a node can be cut.

``make_cluster`` is the site's factory for this Slurm (``%monarch connect --cluster
_slurm_nodes:make_cluster``), the one docs/scaling-out.md shows for a real site with this test's
addresses: one job per rank, ranks spread over the nodes by the partition (``LLN=YES``: the
least loaded node first), workers and gloo on the nodes' shared interface.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import weakref

from _netns import Network
from _slurm import PARTITION, Slurm

from monarch_nb.examples.slurm_site import slurm_cluster

NODES = {"n0": 11, "n1": 12, "n2": 13}  # host role -> the last octet of its address
# Seconds slurmctld waits for a node's slurmd before it sets the node DOWN (300 by default). It
# pings every third of that: a node that died is out of the scheduler's choice (``*`` in sinfo)
# once a ping has failed, within seconds.
SLURMD_TIMEOUT = 8

scheduler_host: str | None = None  # the notebook's address on the nodes' network; see the fixture


class SlurmNodes(Slurm):
    """One Slurm cluster whose nodes are the hosts of ``network``."""

    def __init__(self, network: Network) -> None:
        super().__init__()
        self.network = network
        self.controller_address = network.gateway

    def nodes(self) -> list[str]:
        return [node_name(role) for role in NODES]

    def _nodes(self) -> str:
        # Two CPUs a node: one rank each while every node is up (LLN spreads them), two on a
        # node once one has died. A job whose node died ends (JobRequeue=0): its rank comes back
        # through %monarch scale, as a new job.
        lines = [
            f"NodeName={node_name(role)} NodeAddr={self.network.address(role)} CPUs=2 "
            "RealMemory=4000 State=UNKNOWN"
            for role in NODES
        ]
        names = ",".join(self.nodes())
        return "\n".join(
            [
                f"SlurmdTimeout={SLURMD_TIMEOUT}",
                # a ping to a dead slurmd gives up this soon (connection refused is retried
                # until then): the node is out of the scheduler's choice seconds after it died
                "MessageTimeout=5",
                "JobRequeue=0",
                *lines,
                f"PartitionName={PARTITION} Nodes={names} Default=YES LLN=YES MaxTime=INFINITE "
                "State=UP",
                "",
            ]
        )

    def _start_nodes(self) -> None:
        for role in NODES:
            self.network.start(role, "/usr/sbin/slurmd", "-D", "-N", node_name(role), env=self.env)

    def job_nodes(self) -> dict[str, str]:
        """Each running job's node, as ``squeue`` gives it."""
        out = self.command("squeue", "-h", "-t", "RUNNING", "-o", "%i %N")
        assert out.returncode == 0, out.stderr
        return dict(line.split() for line in out.stdout.splitlines())

    def kill_node(self, role: str) -> list[int]:
        """The node dies: its slurmd, its jobs and their workers, SIGKILLed."""
        return self.network.kill(role)

    def stop(self, cancel: bool = False) -> list[int]:
        """The nodes' processes go first, as if the machines were switched off (a job on a node
        whose link is cut could not be cancelled), then munged and slurmctld."""
        for role in NODES:
            self.network.kill(role)
        return super().stop(cancel=cancel)


def node_name(role: str) -> str:
    """Slurm's name of the node on ``role``'s host: its host name."""
    return f"mnb-{role}"


def make_cluster(jobs: int = 3):
    """``jobs`` Slurm jobs, one rank each, on the nodes of the test's Slurm."""

    class Ranked(slurm_cluster()):
        # worker names 0, 1, 2... are the ranks (job i is rank i)
        def _new_worker_name(self, worker_number):
            return worker_number

    scratch = tempfile.mkdtemp(prefix="monarch-slurm-")
    cluster = Ranked(
        cores=1,
        processes=1,
        memory="1GB",
        walltime="00:30:00",
        job_name="monarch",
        python=sys.executable,
        interface="eth0",  # the nodes' network: the workers listen there
        scheduler_options={"host": scheduler_host, "dashboard_address": "127.0.0.1:0"},
        nanny=True,
        local_directory=scratch,
        log_directory=scratch,
        worker_extra_args=["--no-dashboard"],
        job_script_prologue=[
            "export GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0",
            "export OMP_NUM_THREADS=1",
        ],
    )
    weakref.finalize(cluster, shutil.rmtree, scratch, ignore_errors=True)
    cluster.scale(jobs=jobs)
    return cluster
