"""A Dask scheduler and workers started as separate processes on this machine, the way they run
on a real cluster (notebooks/06-scaling-out.ipynb): the command lines of its "A scheduler that is
already running" section, on 127.0.0.1. Kernel side only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def scheduler_command(scheduler_file: Path) -> list[str]:
    """``dask scheduler`` on 127.0.0.1, on any free port, writing its address to the file."""
    return [
        *(sys.executable, "-m", "distributed.cli.dask_scheduler"),
        *("--host", "127.0.0.1", "--port", "0", "--dashboard-address", "127.0.0.1:0"),
        *("--scheduler-file", str(scheduler_file)),
    ]


def worker_command(scheduler_file: Path, rank: int) -> list[str]:
    """``dask worker`` with a nanny, named for its rank, one thread, found by the file."""
    return [
        *(sys.executable, "-m", "distributed.cli.dask_worker"),
        *("--scheduler-file", str(scheduler_file), "--nanny", "--name", str(rank)),
        *("--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"),
    ]


def start(scheduler_file: Path, workers: int) -> list[subprocess.Popen]:
    """Start the scheduler and ``workers`` workers, each in a session of its own (so the
    kernel's signals do not reach them); the scheduler first in the list."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    commands = [scheduler_command(scheduler_file)]
    commands += [worker_command(scheduler_file, rank) for rank in range(workers)]
    return [
        subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for command in commands
    ]


def stop(procs: list[subprocess.Popen], timeout: float = 20) -> list[int]:
    """Terminate the processes, the last started first (the workers before their scheduler; a
    nanny stops its worker, then itself), killing any that does not end within ``timeout``
    seconds; their exit codes, in the order given."""
    for proc in reversed(procs):
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [proc.returncode for proc in procs]
