"""Checkers for notebooks/03-monarch-matrices.ipynb: where a Monarch matrix puts its outputs, what
it costs against a dense layer, and the rank of its block pairs."""

from __future__ import annotations

from monarch_nb.examples.exercises import checker, close, verdict


@checker("replace ... with the output index of element a of stage 2's block j")
def output_index(answer, a: int, j: int, l: int, s: int) -> bool:  # noqa: E741 (the spec's name)
    """Step 4's interleave: element ``a`` of block ``j`` (of ``l`` blocks of ``s``) goes to
    ``a * l + j``."""
    expected = a * l + j
    if close(answer, expected, 0):
        return verdict(True, f"the outputs are interleaved: a * l + j = {a} * {l} + {j}")
    if close(answer, j * s + a, 0):
        return verdict(
            False,
            "j * s + a keeps block j's outputs side by side; the last step "
            "interleaves them, so consecutive outputs come from consecutive blocks",
        )
    return verdict(False, "step 4 puts element a of block j at a * l + j: count l per element")


@checker("replace ... with the number of parameters of the Monarch matrix (no bias)")
def monarch_params(answer, n: int, b: int) -> bool:
    """A square Monarch matrix of width ``n`` with ``b`` blocks per factor: two factors of ``b``
    blocks of (n / b)², so 2 n² / b."""
    expected = 2 * n * n // b
    if close(answer, expected, 0):
        return verdict(True, f"two factors of {b} blocks of ({n // b})²: 2 n² / b = {expected:,}")
    if close(answer, n * n // b, 0):
        return verdict(False, "that is one factor; a Monarch matrix has two (w1 and w2)")
    if close(answer, n * n, 0):
        return verdict(False, "that is the dense layer's count, n²")
    return verdict(False, "each factor has b blocks of (n / b) by (n / b) entries")


@checker("replace ... with the number of blocks at which Monarch saves nothing")
def blocks_saving_nothing(answer) -> bool:
    """2 n² / b = n² at b = 2: two blocks cost what the dense layer costs."""
    if close(answer, 2, 0):
        return verdict(True, "2 n² / 2 = n²: at 2 blocks both factors together are as big as dense")
    if close(answer, 1, 0):
        return verdict(False, "1 block is worse than nothing: two dense n x n factors, 2 n²")
    if close(answer, 4, 0):
        return verdict(False, "at 4 blocks Monarch has 2 n² / 4, half of dense: it saves already")
    return verdict(False, "solve 2 n² / b = n² for b")


@checker("replace ... with the FLOPs of the call (a multiply and an add count as 2)")
def monarch_flops(answer, batch: int, n: int, b: int) -> bool:
    """A forward pass of ``batch`` rows: each parameter is used once per row in a multiply and an
    add, 2 FLOPs, so 2 * batch * 2 n² / b."""
    expected = 2 * batch * 2 * n * n / b
    if close(answer, expected):
        return verdict(
            True,
            f"2 FLOPs per parameter per row: 2 * {batch} * 2 n² / b "
            f"= {expected:,.0f}, {2 / b:.1%} of dense",
        )
    if close(answer, expected / 2):
        return verdict(
            False, "that counts a multiply-add as 1 FLOP; count the multiply and the add, 2"
        )
    if close(answer, 2 * batch * n * n):
        return verdict(False, "that is the dense layer's count; the Monarch one has 2 / b of it")
    return verdict(False, "every parameter takes part once per row of the batch")


@checker("replace ... with the rank of one (output block, input block) pair")
def block_pair_rank(answer, n: int, b: int) -> bool:
    """Input block i reaches output block j through n / b² of stage 1's values: the pair's rank."""
    expected = n // b**2
    if close(answer, expected, 0):
        return verdict(
            True,
            f"input block i reaches output block j through n / b² = {expected} "
            "of stage 1's values, so the pair has that rank",
        )
    if close(answer, 1, 0):
        return verdict(
            False,
            "rank 1 holds only in the paper's case b = √n; count how many of "
            "stage 1's values a stage-2 block takes from each stage-1 block",
        )
    if close(answer, n // b, 0):
        return verdict(
            False,
            "n / b is the side of a pair, its rank at most; the values between "
            "them are fewer: stage 1's block i deals its n / b outputs to b blocks",
        )
    return verdict(
        False, "stage 1's block i deals its n / b outputs out to the b blocks of stage 2"
    )


@checker("replace ... with the number of parameters of the hidden layer, bias included")
def hidden_layer_params(answer, n: int, b: int) -> bool:
    """``MonarchLinear(n, n, nblocks=b)``: 2 n² / b weights and n biases."""
    expected = 2 * n * n // b + n
    if close(answer, expected, 0):
        return verdict(
            True,
            f"2 n² / b weights and n biases: {expected:,}, against {n * n + n:,} for nn.Linear",
        )
    if close(answer, 2 * n * n // b, 0):
        return verdict(False, "that is the weights; the layer has a bias too, one per output")
    if close(answer, n * n + n, 0):
        return verdict(False, "that is nn.Linear's count; MonarchLinear keeps 2 / b of the weights")
    return verdict(False, "count the two factors' blocks and the bias")
