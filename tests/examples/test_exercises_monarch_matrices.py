"""The checkers of notebooks/03-monarch-matrices.ipynb: a right answer, and the likely mistakes
each met with ``not quite:`` and why."""

from __future__ import annotations

from _exercise_checks import table_tests

from monarch_nb.examples.exercises import monarch_matrices as check

WRONG = [
    (check.output_index, (2 * 2 + 1,), {"a": 1, "j": 2, "l": 4, "s": 2}, "side by side"),
    (check.output_index, (3,), {"a": 1, "j": 2, "l": 4, "s": 2}, "count l per element"),
    (check.monarch_params, (2048**2 // 8,), {"n": 2048, "b": 8}, "that is one factor"),
    (check.monarch_params, (2048**2,), {"n": 2048, "b": 8}, "dense layer's count"),
    (check.blocks_saving_nothing, (1,), {}, "two dense n x n factors"),
    (check.blocks_saving_nothing, (4,), {}, "half of dense"),
    (check.monarch_flops, (64 * 2 * 1024**2 / 32,), {"batch": 64, "n": 1024, "b": 32}, "as 1 FLOP"),
    (check.monarch_flops, (2 * 64 * 1024**2,), {"batch": 64, "n": 1024, "b": 32}, "dense layer"),
    (check.block_pair_rank, (1,), {"n": 256, "b": 4}, "b = √n"),
    (check.block_pair_rank, (64,), {"n": 256, "b": 4}, "the side of a pair"),
    (check.hidden_layer_params, (2 * 256**2 // 4,), {"n": 256, "b": 4}, "a bias too"),
    (check.hidden_layer_params, (256**2 + 256,), {"n": 256, "b": 4}, "nn.Linear's count"),
]
RIGHT = [
    (check.output_index, (6,), {"a": 1, "j": 2, "l": 4, "s": 2}),
    (check.monarch_params, (2 * 2048**2 // 8,), {"n": 2048, "b": 8}),
    (check.blocks_saving_nothing, (2,), {}),
    (check.monarch_flops, (2 * 64 * 2 * 1024**2 / 32,), {"batch": 64, "n": 1024, "b": 32}),
    (check.block_pair_rank, (16,), {"n": 256, "b": 4}),
    (check.hidden_layer_params, (33024,), {"n": 256, "b": 4}),
]


test_a_likely_mistake_is_not_quite_and_says_why, test_the_answer_is_right = table_tests(
    WRONG, RIGHT
)


def test_unanswered_and_nonsense_answers_are_not_right(capsys):
    assert not check.monarch_params(..., n=16, b=4)
    assert capsys.readouterr().out.startswith("not answered yet: ")
    assert not check.block_pair_rank("sixteen", n=256, b=4)
    assert capsys.readouterr().out.startswith("not quite: ")
