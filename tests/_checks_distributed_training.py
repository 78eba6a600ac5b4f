"""What 04-distributed-training.ipynb must print (tests/_notebook_checks.py)."""

from __future__ import annotations

import re

from _notebook_checks import text_of


def _text(cells: list[dict], marker: str) -> str:
    return next(text_of(c) for c in cells if marker in c["source"])


def _by_rank(text: str, line: str) -> dict[int, str]:
    """What each rank printed after ``line``, whether shown once for several ranks or not."""
    out = {}
    for first, last, value in re.findall(rf"\[ranks? (\d+)(?:-(\d+))?\] {line}(.*)", text):
        for r in range(int(first), int(last or first) + 1):
            out[r] = value.strip()
    return out


def distributed_training(cells: list[dict]) -> None:
    shards = _by_rank(_text(cells, "mine = rest[rank::world_size]"), "")
    assert shards == {0: "719 of 1438 training samples, 359 held out", 1: shards[0]}, shards
    counts = _text(cells, "counts = [len(DistributedSampler")
    assert "1438 samples on 3 ranks: [480, 480, 480] a rank, 2 repeated" in counts, counts
    broadcast = _text(cells, "torch.manual_seed(rank)  # a different seed on every rank")
    assert re.search(
        r"largest difference between ranks: 0\.\d+ before DDP, 0.0 after, 0.0 after", broadcast
    ), broadcast
    # the common mistake, seen: one checksum on every rank (shown once where the lines came
    # together), and one of its own on each rank when sharded
    checksums = _text(cells, "def indices(pick")
    same = _by_rank(checksums, "whole split, one seed: batch checksum ")
    assert len(same) == 2 and len(set(same.values())) == 1, checksums
    own = _by_rank(checksums, "own shard, own seed: batch checksum ")
    assert len(own) == 2 and len(set(own.values())) == 2, checksums
    shared = _text(cells, "def shared(mesh)")
    assert (
        "drawn by another rank too: 100% with one seed over the whole split, 0% with a shard each"
        in shared
    ), shared
    assert "differs from this rank's gradient by 0.0e+00" in _text(cells, "def gradient(idx)")
    table = _text(cells, "m = %monarch pull monarch")
    assert re.search(r"rank 0: monarch \d+ params [\d.]+ ms/step acc [\d.]+ \| dense", table), table
    assert "cluster shut down" in _text(cells, "%monarch down")
    asked = [text_of(c) for c in cells if "check." in c["source"] and "answer = ..." in c["source"]]
    assert len(asked) == 4 and all("not answered yet: " in t for t in asked), asked


CHECKS = {"04-distributed-training.ipynb": distributed_training}
