"""A Slurm site's cluster factory:
``%monarch connect --cluster monarch_nb.examples.slurm_site:make_cluster``.

One Slurm job per worker, one worker (one rank) per job, each a single-threaded worker under a
nanny. This one is written for a Slurm whose node is this machine (the test suite starts one):
the scheduler runs in the notebook's process and everything listens on the loopback interface.
dask-jobqueue is imported only when a cluster is made, so ``here()`` can say where it is missing.
On a real site, copy it and set ``queue``, ``account``, the job's resources
(``--gres=gpu:1``), and ``interface`` to the network the nodes share (``ib0``).
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import weakref

INTERFACE = "lo"


def slurm_cluster():
    """dask-jobqueue's SLURMCluster, imported with the process's SIGINT handler kept: importing
    dask_jobqueue sets one that exits the process (its runner module's), which would end a
    notebook's kernel at the stop button and a script at its first Ctrl-C."""
    sigint = signal.getsignal(signal.SIGINT)
    try:
        from dask_jobqueue import SLURMCluster
    finally:
        if threading.current_thread() is threading.main_thread() and sigint is not None:
            signal.signal(signal.SIGINT, sigint)
    return SLURMCluster


@functools.cache
def ranked_cluster_class():
    """SLURMCluster, naming its workers 0, 1, 2... (``dask worker --name 0``), the names the
    controller takes as ranks; SLURMCluster's own names (``SLURMCluster-0``) would be ranked by
    host and address, an order that changes from one connect to the next."""

    class RankedSLURMCluster(slurm_cluster()):
        def _new_worker_name(self, worker_number):
            return worker_number

    return RankedSLURMCluster


def make_cluster(jobs: int = 2, queue: str | None = None):
    """``jobs`` Slurm jobs (one rank each) in partition ``queue`` (the default one if None)."""
    scratch = tempfile.mkdtemp(prefix="monarch-slurm-")
    cluster = ranked_cluster_class()(
        queue=queue,
        cores=1,
        processes=1,
        memory="1GB",
        walltime="00:30:00",
        job_name="monarch",
        python=sys.executable,  # the notebook's environment, monarch_nb included
        interface=INTERFACE,
        nanny=True,
        local_directory=scratch,
        log_directory=scratch,
        scheduler_options={"dashboard_address": "127.0.0.1:0"},
        worker_extra_args=["--no-dashboard"],
        job_script_prologue=[
            # torch.distributed must use the network Dask uses, not the first one it finds
            f"export GLOO_SOCKET_IFNAME={INTERFACE} NCCL_SOCKET_IFNAME={INTERFACE}",
            "export OMP_NUM_THREADS=1",
        ],
    )
    # the jobs' logs stay until the cluster object goes (at the latest, when Python exits)
    weakref.finalize(cluster, shutil.rmtree, scratch, ignore_errors=True)
    cluster.scale(jobs=jobs)
    return cluster


def here() -> str | None:
    """None when a Slurm controller answers and runs jobs on this machine, else why not."""
    if importlib.util.find_spec("dask_jobqueue") is None:
        return "dask-jobqueue is not installed (pip install dask-jobqueue)"
    if shutil.which("sinfo") is None:
        return "no Slurm here (sinfo is not installed)"
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=10
        )
    except subprocess.TimeoutExpired:
        return "no Slurm controller answers (sinfo timed out)"
    if out.returncode != 0:
        return "no Slurm controller answers (sinfo failed)"
    if socket.gethostname() not in out.stdout.split():
        return f"this machine ({socket.gethostname()}) is not one of Slurm's nodes"
    return None
