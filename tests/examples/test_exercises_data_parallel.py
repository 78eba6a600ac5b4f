"""The checkers of lesson 07 (data parallelism): a right answer and likely wrong ones, each with
the why it prints."""

from __future__ import annotations

import pytest
from _exercise_checks import said

from monarch_nb.examples.exercises import data_parallel as check

PARAMS = 50_816  # the lesson's model: 4 blocks of 12,704


def verdict(capsys, right, answer, f, **kwargs):
    return said(capsys, right, f, answer, **kwargs)


def test_block_params(capsys):
    verdict(capsys, True, 12_704, check.block_params, dim=32)
    assert "add every Linear's bias" in verdict(capsys, False, 12 * 32 * 32, check.block_params)
    assert "layer norms have parameters" in verdict(capsys, False, 12_704 - 128, check.block_params)


def test_ddp_bytes(capsys):
    verdict(capsys, True, 4 * PARAMS, check.ddp_bytes, params=PARAMS, ranks=2)
    out = verdict(capsys, False, 2 * PARAMS, check.ddp_bytes, params=PARAMS, ranks=2)
    assert "half an all-reduce" in out
    out = verdict(capsys, False, PARAMS, check.ddp_bytes, params=PARAMS, ranks=2)
    assert "a float32 is 4 bytes" in out
    out = verdict(capsys, False, 4 * PARAMS, check.ddp_bytes, params=PARAMS, ranks=4)
    assert "does not send the whole tensor" in out


def test_fsdp_memory(capsys):
    verdict(capsys, True, 16 * PARAMS / 8, check.fsdp_memory, params=PARAMS, ranks=8, slots=2)
    out = verdict(capsys, False, 4 * PARAMS / 8, check.fsdp_memory, params=PARAMS, ranks=8)
    assert "parameters only" in out
    out = verdict(capsys, False, 16 * PARAMS, check.fsdp_memory, params=PARAMS, ranks=8, slots=2)
    assert "what DDP holds" in out


@pytest.mark.parametrize("right", [{3}, [3], 3])
def test_fsdp_holders_right(capsys, right):
    verdict(capsys, True, right, check.fsdp_holders, row=100, rows=128, ranks=4)


def test_fsdp_holders_wrong(capsys):
    out = verdict(capsys, False, {0, 1, 2, 3}, check.fsdp_holders, row=100)
    assert "does not copy a weight to every rank" in out
    assert "bands are 32 rows" in verdict(capsys, False, {2}, check.fsdp_holders, row=100)
    verdict(capsys, False, "three", check.fsdp_holders, row=100)  # never raises


def test_fsdp_over_ddp(capsys):
    verdict(capsys, True, 1.5, check.fsdp_over_ddp)
    assert "what gloo measures" in verdict(capsys, False, 2, check.fsdp_over_ddp)
    assert "counts as two" in verdict(capsys, False, 3, check.fsdp_over_ddp)


def test_ddp_seeds(capsys):
    verdict(capsys, True, True, check.ddp_seeds)
    assert "broadcasts rank 0's weights" in verdict(capsys, False, False, check.ddp_seeds)
