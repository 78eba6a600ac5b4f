"""The checkers of notebooks/10-fault-tolerance.ipynb: a right answer, and the likely wrong ones
with the reason each is given."""

from __future__ import annotations

from monarch_nb.examples.exercises import fault_tolerance as check


def said(capsys) -> str:
    return capsys.readouterr().out.strip()


def test_shard_size(capsys):
    assert check.shard_size(449, rank=2, world_size=4, samples=1797)
    assert said(capsys).startswith("right: the same shard rank 2 had")
    assert not check.shard_size(599, rank=2, world_size=4, samples=1797)  # 2::3
    assert "the world did not shrink for it" in said(capsys)
    assert not check.shard_size(450, rank=2, world_size=4, samples=1797)
    assert said(capsys).startswith("not quite: ")


def test_heals_from(capsys):
    assert check.heals_from("c")
    assert said(capsys).startswith("right: it heals in its first quorum")
    assert not check.heals_from("b")
    assert "the survivors did not wait" in said(capsys)
    assert not check.heals_from("A")
    assert "heals instead of redoing" in said(capsys)


def test_quorum_after_kill(capsys):
    assert check.quorum_after_kill(3, world=4, killed=1)
    assert said(capsys).startswith("right: ")
    assert not check.quorum_after_kill(4, world=4, killed=1)
    assert "forms the next quorum without it" in said(capsys)
    assert not check.quorum_after_kill(0, world=4, killed=1)
    assert "the survivors go on" in said(capsys)


def test_steps_redone(capsys):
    assert check.steps_redone(30, every=50, lost_at=130)
    assert said(capsys).startswith("right: from the latest checkpoint, step 100, to step 130")
    assert not check.steps_redone(0, every=50, lost_at=130)
    assert said(capsys) == "not quite: that is torchft; a re-run starts from the latest checkpoint"
    assert not check.steps_redone(130, every=50, lost_at=130)
    assert "not step 0" in said(capsys)


def _result(steps=(600, 600, 600, 600), weights=(1.5, 1.5, 1.5, 1.5)):
    return {
        r: {"steps": s, "weights": w, "pid": 100 + r}
        for r, (s, w) in enumerate(zip(steps, weights, strict=True))
    }


BACK = [{"rank": 1, "event": "back"}, {"rank": 3, "event": "back"}]


def test_two_lost_and_back(capsys):
    assert check.two_lost_and_back(_result(), later=BACK, steps=600)
    assert said(capsys) == (
        "right: ranks 1 and 3 lost and back; every rank ended at step 600 with the same weights"
    )
    assert not check.two_lost_and_back(_result(), later=BACK[:1], steps=600)
    assert said(capsys) == "not quite: two ranks should have come back; ft.history() shows [1]"
    assert not check.two_lost_and_back(_result(weights=(1.5, 1.5, 2.0, 1.5)), later=BACK, steps=600)
    assert "the same weights" in said(capsys)
    assert not check.two_lost_and_back(_result(steps=(600, 600, 580, 600)), later=BACK, steps=600)
    assert "every rank should end at step 600" in said(capsys)
    assert not check.two_lost_and_back("result2", later=BACK, steps=600)
    assert "pass the training cell's result" in said(capsys)
