"""``%monarch scale`` past what a batch queue can run at once: a real Slurm (tests/_slurm.py,
one node of 2 CPUs) and dask-jobqueue's SLURMCluster (monarch_nb/examples/slurm_site.py),
refused in one line before any job is submitted (controller/queue_limits.py). Skipped, in one
line, where Slurm is not installed or the test is not root."""

from __future__ import annotations

import re

import pytest
from _slurm import running

from monarch_nb.controller import queue_limits


@pytest.fixture(scope="module")
def slurm():
    with running() as s:
        yield s


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
