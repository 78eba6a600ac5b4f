"""A real Slurm runs the ranks: munged, slurmctld and slurmd on this machine (tests/_slurm.py),
dask-jobqueue's SLURMCluster through monarch_nb/examples/slurm_site.py (the factory notebook 06
uses), one Slurm job per rank.

Skipped, in one line, only where Slurm is not installed or the test is not root; where it is
installed (``make test`` installs it) a Slurm that does not come up fails the test.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest
from _server_helpers import status_of
from _slurm import DOWN_PARTITION, running, wait_until_empty
from _wait import RANK_1_BUSY, wait_for
from nbclient import NotebookClient

import monarch_nb

pytest_plugins = ["pytest_jupyter.jupyter_server"]

NOTEBOOKS = Path(__file__).parent.parent.parent / "notebooks"
SITE = "monarch_nb.examples.slurm_site:make_cluster"


@pytest.fixture(scope="module")
def slurm():
    with running() as s:
        try:
            yield s
        finally:
            sys.modules.pop("stuck_site", None)


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"monarch_nb.server": True}}}


def test_ranks_are_slurm_jobs(slurm, no_current, cell, jp_fetch, jp_asyncio_loop):
    start = time.monotonic()
    cell(f"%monarch connect --cluster {SITE} --workers 2 --wait 60")
    assert "connected to 2 ranks" in cell.out, cell.out
    ctl = monarch_nb.current()
    jobs = {name: job.job_id for name, job in ctl.cluster.workers.items()}
    assert sorted(jobs) == [0, 1] and len(set(jobs.values())) == 2
    assert sorted(line.split()[:2] for line in slurm.squeue()) == sorted(
        [job, "RUNNING"] for job in jobs.values()
    )

    # Worker names 0 and 1 are the ranks: rank r runs in the job the cluster submitted as r.
    where = cell("%%monarch\nimport os\nos.environ['SLURM_JOB_ID']")
    assert where.values() == [jobs[0], jobs[1]]
    reduced = cell(
        "%%monarch\nimport torch, torch.distributed as dist\n"
        "t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\n(dist.get_world_size(), t.item())"
    )
    assert reduced.values() == [(2, 3.0), (2, 3.0)]

    # log() reaches the notebook and the sidebar's metrics route.
    cell("%%monarch\nfrom monarch_nb import log\nlog(step=0, loss=1.5 + rank)")
    assert wait_for(lambda: len(monarch_nb.history()) == 2, timeout=15)
    history = monarch_nb.history()
    assert {r: [row.values["loss"] for row in rows] for r, rows in history.items()} == {
        0: [1.5],
        1: [2.5],
    }

    def route():
        return jp_asyncio_loop.run_until_complete(
            status_of(jp_fetch, "monarch", "api", "clusters", ctl.id, "metrics")
        )

    body: dict = {}

    def logged() -> bool:
        nonlocal body
        code, body = route()
        return code == 200 and [r.get("loss") for r in body["ranks"]] == [1.5, 2.5]

    assert wait_for(logged, timeout=15), body
    assert body["state"] == "up" and [r["rank"] for r in body["ranks"]] == [0, 1]

    # scancel rank 1's job while a cell runs: the cell ends with rank 1's WorkerLost, and
    # rank 0's result is kept.
    timer = threading.Timer(1.5, slurm.command, ("scancel", jobs[1]))
    timer.start()
    t0 = time.monotonic()
    try:
        cell(RANK_1_BUSY, expect_error=True)
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 30
    err = cell.error
    assert isinstance(err, monarch_nb.CellError), repr(err)
    assert list(err.errors) == [1] and err.errors[1].ename == "WorkerLost"
    assert err.results.to_dict() == {0: 0}
    assert "1 of 2 ranks failed" in cell.out and "[rank 1] WorkerLost" in cell.out

    cell("%monarch down")
    assert "cluster shut down" in cell.out
    assert wait_until_empty(slurm), slurm.squeue()
    assert time.monotonic() - start < 60


def test_a_slurm_cluster_scales_down_and_up(slurm, no_current, cell):
    """``%monarch scale`` on SLURMCluster: the job of the rank that leaves ends, a new job
    brings the rank back with an empty namespace, the group forms at each size."""
    start = time.monotonic()
    cell(f"%monarch connect --cluster {SITE} --workers 2 --wait 60")
    ctl = monarch_nb.current()
    jobs = {name: job.job_id for name, job in ctl.cluster.workers.items()}
    cell("%%monarch\nkept = rank")

    cell("%monarch scale 1")
    assert cell.out.splitlines() == [
        "monarch-nb: scaled to 1 rank; rank 1 left (its namespace went with it); "
        "the gloo process group was formed again over 1 rank"
    ]
    assert wait_for(lambda: [j.split()[0] for j in slurm.squeue()] == [jobs[0]], timeout=15), (
        slurm.squeue()
    )
    assert list(ctl.cluster.workers) == [0]
    assert ctl.run(SLURM_ALL_REDUCE).values() == [(1, 1, 1, jobs[0], True)]

    # A new job that never starts (its partition is down): the wait names it with its state,
    # and the cluster is scaled back (the job cancelled).
    template = ctl.cluster.new_spec["options"]
    template["queue"] = DOWN_PARTITION
    try:
        cell("%monarch scale 2 --wait 3", expect_error=True)
    finally:
        template["queue"] = None
    assert re.fullmatch(
        r"only 0 of 1 new workers joined within 3 s \(Slurm job \d+ PENDING \(PartitionDown\)\); "
        r"the cluster was scaled back to 1 \(wait=S waits longer\)",
        str(cell.error),
    ), str(cell.error)
    assert wait_for(lambda: [j.split()[0] for j in slurm.squeue()] == [jobs[0]], timeout=15), (
        slurm.squeue()
    )
    assert ctl.world_size == 1 and list(ctl.cluster.workers) == [0]

    cell("%monarch scale 2 --wait 60")
    assert cell.out.splitlines() == [
        "monarch-nb: scaled to 2 ranks; rank 1 joined with an empty namespace "
        "(%monarch push NAME --targets 1:2 fills it); the gloo process group was formed "
        "again over 2 ranks"
    ]
    new_job = ctl.cluster.workers[1].job_id
    assert new_job not in jobs.values()
    assert sorted(j.split()[:2] for j in slurm.squeue()) == sorted(
        [[jobs[0], "RUNNING"], [new_job, "RUNNING"]]
    )
    assert ctl.run(SLURM_ALL_REDUCE).values() == [
        (2, 2, 2, jobs[0], True),
        (2, 2, 2, new_job, False),
    ]
    cell("%monarch down")
    assert wait_until_empty(slurm), slurm.squeue()
    assert time.monotonic() - start < 60


SLURM_ALL_REDUCE = (
    "import os, torch, torch.distributed as dist\n"
    "t = torch.ones(1)\n"
    "dist.all_reduce(t)\n"
    "(int(t.item()), dist.get_world_size(), world_size, os.environ['SLURM_JOB_ID'], "
    "'kept' in dir())"
)


STUCK = f"""
from monarch_nb.examples.slurm_site import make_cluster


def make():
    return make_cluster(queue={DOWN_PARTITION!r})
"""


def test_a_job_that_never_starts_is_named_with_its_slurm_state(
    slurm, no_current, cell, tmp_path, monkeypatch
):
    (tmp_path / "stuck_site.py").write_text(STUCK)
    monkeypatch.syspath_prepend(str(tmp_path))
    start = time.monotonic()
    cell("%monarch connect --cluster stuck_site:make --workers 2 --wait 5", expect_error=True)
    message = str(cell.error)
    took = time.monotonic() - start
    # one line: each job the wait ended without, with its state (a DOWN partition holds it)
    named = re.fullmatch(
        r"only 0 of 2 workers joined within 5 s \(Slurm job (\d+) PENDING \((\w+)\), "
        r"job (\d+) PENDING \((\w+)\)\); --wait S \(wait=S\) waits longer",
        message,
    )
    assert named, message
    assert named[1] != named[3] and named[2] == named[4] == "PartitionDown", message
    assert took < 30, f"the connect took {took:.1f} s"
    # the cluster the factory made is closed, and its jobs cancelled
    assert wait_until_empty(slurm, timeout=15), slurm.squeue()


def test_notebook_06_runs_its_slurm_part_on_slurm(slurm, tmp_path):
    """tests/browser/test_notebooks_browser.py runs all of notebook 06 where no Slurm answers
    (its Slurm part on a local cluster); here its Slurm part, the ``%monarch scale`` cells
    included, runs on Slurm, up to the ``%monarch down`` that ends it (the rest, a scheduler
    and workers as processes, is the same either way). From a directory with nothing beside
    it, as a notebook handed out runs."""
    nb = nbformat.read(NOTEBOOKS / "06-scaling-out.ipynb", as_version=4)
    end = next(i for i, c in enumerate(nb.cells) if c.source.strip() == "%monarch down")
    nb.cells = nb.cells[: end + 1]
    NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]

    def shown(snippet: str) -> str:
        return next(_text(c) for c in code if snippet in c.source)

    connect = shown(SITE)
    assert "connected to 2 ranks" in connect and "local cluster" not in connect, connect
    ranks = shown("SLURM_JOB_ID")
    assert "None" not in ranks and ranks.count(", 3.0)") == 2, ranks
    assert "scaled to 1 rank; rank 1 left" in shown("%monarch scale 1")
    assert "None" not in shown("dist.get_world_size(), os.environ")
    assert "scaled to 2 ranks; rank 1 joined" in shown("%monarch scale 2")
    regrown = shown("fresh =")
    assert "(2, 2, False," in regrown and "(2, 2, True," in regrown, regrown
    assert "None" not in regrown and regrown.count(", 3.0)") == 2, regrown
    assert "cluster shut down" in _text(code[-1])
    assert wait_until_empty(slurm), slurm.squeue()


def _text(cell) -> str:
    """What a cell showed, its error included."""
    parts = []
    for out in cell.outputs:
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif out["output_type"] == "error":
            parts.append("\n".join(out["traceback"]))
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return "".join(parts)
