"""The Slurm site's factory (monarch_nb/examples/slurm_site.py) without a Slurm."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

KEPT = """
import signal
before = signal.getsignal(signal.SIGINT)
from monarch_nb.examples.slurm_site import slurm_cluster
assert slurm_cluster().__name__ == "SLURMCluster"
assert signal.getsignal(signal.SIGINT) is before, signal.getsignal(signal.SIGINT)
"""


@pytest.mark.skipif(importlib.util.find_spec("dask_jobqueue") is None, reason="no dask-jobqueue")
def test_importing_slurm_cluster_keeps_the_processs_sigint_handler():
    # dask_jobqueue's runner module sets a handler that exits the process as it is imported;
    # a fresh process, where dask_jobqueue was never imported
    done = subprocess.run([sys.executable, "-c", KEPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
