"""The checkers of notebooks/02-working-with-the-cluster.ipynb: a likely wrong answer to each is
not quite right and says why; the right one is right."""

from __future__ import annotations

from monarch_nb.examples.exercises import cluster as check


def test_scatter_shard(capsys):
    assert not check.scatter_shard([1, 3, 5, 7, 9], n=10, world_size=2, rank=1)
    assert "not quite: that is every other item" in capsys.readouterr().out
    assert not check.scatter_shard(list(range(10)), n=10, world_size=2, rank=1)
    assert "that is push" in capsys.readouterr().out
    assert check.scatter_shard([5, 6, 7, 8, 9], n=10, world_size=2, rank=1)
    assert check.scatter_shard([4, 5, 6], n=10, world_size=3, rank=1)  # 4, 3, 3


def test_partial_value(capsys):
    assert not check.partial_value(1.0)
    assert "not quite: rank 0 divides by rank - 1" in capsys.readouterr().out
    assert not check.partial_value("error")
    assert "rank 0 did not fail" in capsys.readouterr().out
    assert check.partial_value(-1.0)


def test_background_result(capsys):
    assert not check.background_result([2, 2])
    assert "not quite: the printed steps are output" in capsys.readouterr().out
    assert not check.background_result(100)
    assert "one value per rank" in capsys.readouterr().out
    assert check.background_result({0: 0, 1: 100})


def test_debug_scaled(capsys):
    assert not check.debug_scaled(10)
    assert "not quite: v is rank + 1" in capsys.readouterr().out
    assert check.debug_scaled(20)


def test_kept_sum(capsys):
    assert not check.kept_sum(None)
    assert "not quite: the ranks' namespaces outlive the detach" in capsys.readouterr().out
    assert not check.kept_sum(1.0)
    assert "weights has 3 entries" in capsys.readouterr().out
    assert check.kept_sum(3.0)


def test_targeted_values(capsys):
    assert not check.targeted_values({0: 0, 1: 7})
    assert "not quite: --targets 1 runs the cell on rank 1 only" in capsys.readouterr().out
    assert not check.targeted_values(7)
    assert "keyed by rank" in capsys.readouterr().out
    assert check.targeted_values({1: 7})


def test_shell_lines(capsys):
    assert not check.shell_lines("1")
    assert "not quite: out = !cmd keeps a list of lines" in capsys.readouterr().out
    assert not check.shell_lines([1])
    assert "the lines are strings" in capsys.readouterr().out
    assert check.shell_lines(["1"])


def test_count_survives(capsys):
    assert not check.count_survives(False)
    assert "not quite: the interrupt ends the loop, not the process" in capsys.readouterr().out
    assert check.count_survives(True)


def test_workers_after_down(capsys):
    assert not check.workers_after_down(2)
    assert "not quite: that is %monarch connect's cluster" in capsys.readouterr().out
    assert not check.workers_after_down(False)  # a bool is no count
    assert check.workers_after_down(0)
