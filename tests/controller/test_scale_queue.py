"""``%monarch scale`` past what a batch queue can run at once: a real Slurm (tests/_slurm.py,
one node of 2 CPUs) and dask-jobqueue's SLURMCluster (monarch_nb/examples/slurm_site.py),
refused in one line before any job is submitted (controller/queue_limits.py). Skipped, in one
line, where Slurm is not installed or the test is not root."""

from __future__ import annotations

import re
import signal

import pytest
from _slurm import Slurm, why_not

from monarch_nb.controller import queue_limits


@pytest.fixture(scope="module")
def slurm():
    reason = why_not()
    if reason:
        pytest.skip(reason)
    # dask_jobqueue's runner module makes SIGINT exit the process as it is imported: the
    # suite's later Ctrl-C tests need Python's own handler back
    sigint = signal.getsignal(signal.SIGINT)
    try:
        pytest.importorskip("dask_jobqueue", reason="dask-jobqueue is not installed (dev extra)")
    finally:
        signal.signal(signal.SIGINT, sigint)
    s = Slurm()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", str(s.conf))  # for scontrol, sbatch and squeue
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


def test_more_ranks_than_the_partition_runs_at_once_are_refused_in_one_line(slurm):
    from monarch_nb.examples.slurm_site import make_cluster

    cluster = make_cluster(jobs=0)  # no job yet: one rank a job, 1 CPU and 1 GB each
    try:
        queue_limits.check(cluster, 2)  # the partition's 2 CPUs run 2 at once
        for n in (3, 64):
            with pytest.raises(ValueError) as err:
                queue_limits.check(cluster, n)
            message = str(err.value)
            assert "\n" not in message
            assert re.fullmatch(
                rf"scale {n} is more than Slurm partition debug can run at once: {n} jobs of "
                r"1 CPU and \d+ MiB each, and it has 2 CPUs and [\d.]+ GiB in all \(scontrol "
                r"show partition debug\); their jobs would wait for ever; scale to 2 at most, "
                r"or use a larger partition",
                message,
            ), message
        assert slurm.squeue() == []  # nothing was submitted
    finally:
        cluster.close()
