"""The checkers of notebooks/04-distributed-training.ipynb: a right answer, and the likely
mistakes each met with ``not quite:`` and why."""

from __future__ import annotations

from _exercise_checks import table_tests

from monarch_nb.examples.exercises import distributed_training as check

WRONG = [
    (check.samples_per_rank, (1438,), {"n": 1438, "world_size": 3}, "the whole split"),
    (check.samples_per_rank, (479,), {"n": 1438, "world_size": 3}, "it pads, it does not drop"),
    (check.samples_per_rank, (480,), {"n": 1438, "world_size": 3, "drop_last": True}, "drops"),
    (check.distinct_samples, (128,), {"batch": 64, "world_size": 2}, "draw the same indices"),
    (check.weights_differ_after_step, (True,), {"wrapper": "DDP"}, "broadcasts rank 0's"),
    (check.weights_differ_after_step, ("no",), {"wrapper": "FSDP2"}, "broadcasts nothing"),
    (check.weights_differ_after_step, ("maybe",), {}, "answer True"),
    (check.global_batch, (64,), {"batch": 64, "world_size": 2}, "one rank's batch"),
]
RIGHT = [
    (check.samples_per_rank, (480,), {"n": 1438, "world_size": 3}),
    (check.samples_per_rank, (479,), {"n": 1438, "world_size": 3, "drop_last": True}),
    (check.distinct_samples, (64,), {"batch": 64, "world_size": 2}),
    (check.weights_differ_after_step, (False,), {"wrapper": "DDP"}),
    (check.weights_differ_after_step, ("yes",), {"wrapper": "FSDP2"}),
    (check.global_batch, (128,), {"batch": 64, "world_size": 2}),
]


test_a_likely_mistake_is_not_quite_and_says_why, test_the_answer_is_right = table_tests(
    WRONG, RIGHT
)


def test_unanswered_is_not_right(capsys):
    assert not check.global_batch(..., batch=64, world_size=2)
    assert capsys.readouterr().out.startswith("not answered yet: ")
