"""The checkers of notebooks/01-ranks-and-collectives.ipynb: a likely wrong answer to each is not
quite right and says why; the right one is right."""

from __future__ import annotations

from monarch_nb.examples.exercises import collectives as check


def test_last_value(capsys):
    assert not check.last_value([0, 1, 2, 3], world_size=4)
    assert "rank 0 has the largest value" in capsys.readouterr().out
    assert not check.last_value(7, world_size=4)
    assert "one value per rank" in capsys.readouterr().out
    assert check.last_value({0: 4, 1: 3, 2: 2, 3: 1}, world_size=4)
    assert check.last_value([4, 3, 2, 1], world_size=4)
    assert capsys.readouterr().out.startswith("right:")


def test_namespace_value(capsys):
    assert not check.namespace_value(1, rank=3)
    assert "not quite: the first cell's `total` is still there" in capsys.readouterr().out
    assert check.namespace_value(31, rank=3)


def test_all_reduce_sum(capsys):
    assert not check.all_reduce_sum(3, values=[3, 1, 4, 1])
    assert "not quite: that is one rank's own value" in capsys.readouterr().out
    assert not check.all_reduce_sum([9, 9, 9, 9], values=[3, 1, 4, 1])
    assert "give one" in capsys.readouterr().out
    assert not check.all_reduce_sum(2.25, values=[3, 1, 4, 1])
    assert "that is the mean" in capsys.readouterr().out
    assert check.all_reduce_sum(9, values=[3, 1, 4, 1])


def test_broadcast_value(capsys):
    assert not check.broadcast_value(11, values=[5, 7, 9, 11], src=1, rank=3)
    assert "not quite: rank 3's own value is overwritten" in capsys.readouterr().out
    assert not check.broadcast_value(32, values=[5, 7, 9, 11], src=1, rank=3)
    assert "that is an all-reduce" in capsys.readouterr().out
    assert check.broadcast_value(7, values=[5, 7, 9, 11], src=1, rank=3)


def test_all_gather_list(capsys):
    assert not check.all_gather_list([6], values=[2, 4, 6, 8])
    assert "not quite: there is one entry per rank" in capsys.readouterr().out
    assert not check.all_gather_list([8, 6, 4, 2], values=[2, 4, 6, 8])
    assert "they come in rank order" in capsys.readouterr().out
    assert check.all_gather_list([2, 4, 6, 8], values=[2, 4, 6, 8])


def test_stuck_ranks(capsys):
    calls = lambda rank: rank != 3  # noqa: E731
    assert not check.stuck_ranks({3}, calls=calls, world_size=4)
    assert "not quite: the ranks that skip the collective finish" in capsys.readouterr().out
    assert not check.stuck_ranks(3, calls=calls, world_size=4)
    assert "give a set of ranks" in capsys.readouterr().out
    assert check.stuck_ranks({0, 1, 2}, calls=calls, world_size=4)
    assert check.stuck_ranks(set(), calls=lambda rank: True, world_size=4)
    assert "every rank calls it" in capsys.readouterr().out


def test_group_identity(capsys):
    assert not check.group_identity([(0, 4)] * 4, world_size=4)
    assert "not quite: each process is a different rank" in capsys.readouterr().out
    assert not check.group_identity([(r, 1) for r in range(4)], world_size=4)
    assert "counts every rank of the group" in capsys.readouterr().out
    assert check.group_identity([(0, 4), (1, 4), (2, 4), (3, 4)], world_size=4)
