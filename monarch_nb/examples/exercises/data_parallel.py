"""Exercises of lesson 07 (data parallelism): count a block's parameters, predict DDP's bytes a
step, FSDP's memory per rank, which rank holds a row, FSDP's bytes beside DDP's, and what DDP
does with per-rank seeds."""

from __future__ import annotations

from monarch_nb.examples.exercises import checker, close, verdict


def _ranks(answer) -> set[int] | None:
    """An answer naming ranks (a set, list, tuple or one int) as a set, or None."""
    if isinstance(answer, int) and not isinstance(answer, bool):
        return {answer}
    try:
        return {int(r) for r in answer}
    except (TypeError, ValueError):
        return None


@checker("replace ... with the number of parameters (entries) of one block")
def block_params(answer, dim=32):
    """A block: attention's q, k, v, o (dim x dim, with biases), two layer norms (a weight and
    a bias of dim each), the MLP's up (dim -> 4 dim) and down (4 dim -> dim), with biases."""
    linear = 4 * (dim * dim + dim) + (dim * 4 * dim + 4 * dim) + (4 * dim * dim + dim)
    expected = linear + 2 * 2 * dim
    if close(answer, 12 * dim * dim, 0):
        return verdict(
            False,
            "that counts the weight matrices only: add every Linear's bias "
            "and the layer norms' weights and biases",
        )
    if close(answer, linear, 0):
        return verdict(False, "the two layer norms have parameters too: a weight and a bias each")
    return verdict(
        close(answer, expected, 0),
        f"4 attention Linears of {dim * dim + dim}, up "
        f"and down of {4 * dim * dim + 4 * dim} and "
        f"{4 * dim * dim + dim}, layer norms {4 * dim}: {expected:,} in all",
    )


@checker("replace ... with the bytes a rank sends a step, a number")
def ddp_bytes(answer, params, ranks=2):
    """DDP all-reduces every gradient (float32) once a step; a ring all-reduce sends
    2(n-1)/n of the tensor from every rank."""
    size = 4 * params
    expected = 2 * (ranks - 1) / ranks * size
    if close(answer, size) and ranks != 2:
        return verdict(
            False,
            "a ring all-reduce does not send the whole tensor from each rank: "
            "it is a reduce-scatter and an all-gather, (n-1)/n of it each",
        )
    if close(answer, (ranks - 1) / ranks * size):
        return verdict(
            False,
            "that is half an all-reduce (a reduce-scatter): the averaged "
            "gradients must also come back to every rank (an all-gather)",
        )
    if close(answer, expected / 4) or close(answer, params):
        return verdict(False, "count bytes, not entries: a float32 is 4 bytes")
    return verdict(
        close(answer, expected),
        f"2(n-1)/n x 4 bytes x {params:,} gradients at n={ranks}: {expected:,.0f} bytes",
    )


@checker("replace ... with the bytes a rank holds, a number")
def fsdp_memory(answer, params, ranks=4, slots=1):
    """FSDP keeps 1/n of every parameter, of its gradient and of its optimizer state on each
    rank (``slots`` tensors of state a parameter: SGD's momentum is 1, Adam's moments 2)."""
    share = 4 * params / ranks
    expected = (2 + slots) * share
    if close(answer, share):
        return verdict(
            False,
            "that is the parameters only: each rank also holds its share of "
            "the gradients and of the optimizer's state",
        )
    if close(answer, (2 + slots) * 4 * params):
        return verdict(False, "that is what DDP holds on every rank: FSDP divides it by n")
    if close(answer, 2 * share):
        return verdict(
            False,
            "parameters and gradients: SGD with momentum keeps one more "
            "tensor a parameter, the momentum, sharded too",
        )
    return verdict(
        close(answer, expected),
        f"(2 + {slots}) x 4 bytes x {params:,} / {ranks}: {expected:,.0f} bytes a rank",
    )


@checker("replace ... with the set of ranks, e.g. {0, 2}")
def fsdp_holders(answer, row, rows=128, ranks=4):
    """FSDP2 shards a weight along its first dimension: rank r holds rows r*rows/n to
    (r+1)*rows/n - 1."""
    got = _ranks(answer)
    expected = {row // (rows // ranks)}
    if got == set(range(ranks)):
        return verdict(
            False,
            "FSDP does not copy a weight to every rank: it cuts it into n "
            "bands of rows, one a rank",
        )
    if got and len(got) == 1 and got != expected:
        return verdict(
            False, f"one rank, yes, but the bands are {rows // ranks} rows each, in rank order"
        )
    return verdict(
        got == expected,
        f"bands of {rows // ranks} rows: row {row} is in band {row} // {rows // ranks}",
    )


@checker("replace ... with a ratio, e.g. 1.0")
def fsdp_over_ddp(answer):
    """FSDP's bytes a step over DDP's by the ring formula: two all-gathers of the parameters
    and a reduce-scatter of the gradients, against one all-reduce (= reduce-scatter +
    all-gather)."""
    if close(answer, 2.0):
        return verdict(
            False,
            "2 is what gloo measures, where the reduce-scatter sends as much "
            "as an all-reduce; by the ring formula a reduce-scatter is half of one",
        )
    if close(answer, 3.0):
        return verdict(
            False,
            "FSDP runs three collectives, but DDP's one all-reduce counts as "
            "two: a reduce-scatter plus an all-gather",
        )
    return verdict(close(answer, 1.5), "three halves of an all-reduce against two: 1.5")


@checker("replace ... with True or False")
def ddp_seeds(answer):
    """DDP with per-rank seeds: its constructor broadcasts rank 0's parameters and buffers, so
    every rank starts from rank 0's weights."""
    if answer is False:
        return verdict(
            False,
            "DDP's constructor broadcasts rank 0's weights to every rank; "
            "FSDP2's fully_shard does not, which is why it diverges",
        )
    return verdict(
        answer is True,
        "DDP starts every rank from rank 0's weights (a broadcast "
        "in its constructor), and rank 0's seed is the reference's",
    )
