"""The checkers of notebooks/06-scaling-out.ipynb: a right answer, and the likely wrong ones with
the reason each is given."""

from __future__ import annotations

from monarch_nb.examples.exercises import scaling_out as check


def said(capsys) -> str:
    return capsys.readouterr().out.strip()


def test_ranks_from_jobs(capsys):
    assert check.ranks_from_jobs(3, jobs=3, processes=1, cores=4)
    assert said(capsys).startswith("right: one rank per worker")
    assert not check.ranks_from_jobs(12, jobs=3, processes=1, cores=4)
    assert said(capsys) == ("not quite: cores are what a job may use; a rank is a worker process")


def test_fresh_ranks(capsys):
    assert check.fresh_ranks({1, 2}, start=2, sizes=[1, 3])
    assert said(capsys).startswith("right: ranks leave from the top")
    assert not check.fresh_ranks({2}, start=2, sizes=[1, 3])
    assert "a rank that left and came back under the same number is a new worker" in said(capsys)
    assert not check.fresh_ranks({0, 1, 2}, start=2, sizes=[1, 3])
    assert said(capsys) == "not quite: the ranks that never left keep their namespaces"
    assert check.fresh_ranks({1}, start=2, sizes=[1, 2])  # the notebook's own 2 -> 1 -> 2
    assert check.fresh_ranks(set(), start=4, sizes=[2])  # shrinking makes nobody new
    said(capsys)


def test_all_reduce_after_scale(capsys):
    assert check.all_reduce_after_scale(6.0, world=3)
    assert said(capsys).startswith("right: the sum of rank + 1 over 3 ranks")
    assert not check.all_reduce_after_scale(3.0, world=3)
    assert said(capsys) == ("not quite: each rank adds rank + 1, not 1: 1 + 2 + ... + world")
    assert not check.all_reduce_after_scale(3.0, world=4)
    assert "the process group forms again at the new size" in said(capsys)


def test_workers_to_start(capsys):
    assert check.workers_to_start(8, nodes=2, gpus_per_node=4)
    assert said(capsys).startswith("right: ")
    assert not check.workers_to_start(2, nodes=2, gpus_per_node=4)
    assert "one worker per GPU, not per node" in said(capsys)
    assert not check.workers_to_start(9, nodes=2, gpus_per_node=4)
    assert "the scheduler is not a dask worker" in said(capsys)


def test_still_running(capsys):
    assert check.still_running(3, workers=2)
    assert said(capsys).startswith("right: down only disconnects")
    assert not check.still_running(0, workers=2)
    assert "stops only what the notebook started" in said(capsys)
    assert not check.still_running(2, workers=2)
    assert "the scheduler runs on too" in said(capsys)
