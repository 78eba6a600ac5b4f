"""What a parallel strategy costs: memory per rank, measured from the tensors a rank holds and
predicted by formula, the bytes a ring collective sends, and a pipeline's schedule and bubble.

Imported on every rank and in the kernel alike (torch only): the measurements run on the ranks,
the formulas anywhere.
"""

from __future__ import annotations

import torch

FLOAT32 = 4  # bytes an entry


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank stores: a DTensor's local shard, or ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def memory(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for ``model`` and ``opt``: parameters, gradients and optimizer state
    (SGD's momentum, Adam's two moments), each counted from the local tensors."""
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    return {
        "parameters": _bytes(params),
        "gradients": _bytes(p.grad for p in params),
        "optimizer": _bytes(state),
    }


def predicted_memory(shares: list[float], slots: int = 1) -> dict[str, float]:
    """Bytes a rank holds by formula, from each parameter's entries on the rank (``shares``:
    its size, or its size over the ranks that split it): as many bytes of gradients as of
    parameters, and ``slots`` tensors of optimizer state a parameter (1: SGD's momentum)."""
    params = FLOAT32 * sum(shares)
    return {"parameters": params, "gradients": params, "optimizer": slots * params}


def ring(collective: str, ranks: int, nbytes: float) -> float:
    """Bytes each rank sends in a ring ``collective`` of an ``nbytes`` tensor over ``ranks``: an
    all-gather or a reduce-scatter sends (n-1)/n of it, an all-reduce (one of each) twice that."""
    share = (ranks - 1) / ranks
    return {"all-gather": share, "reduce-scatter": share, "all-reduce": 2 * share}[
        collective
    ] * nbytes


def schedule(kind: str, stages: int, micro: int) -> list[list[tuple[str, int] | None]]:
    """A pipeline schedule, each forward and backward one time slot: for each stage, the slots
    in order, each ``("F", j)``/``("B", j)`` for micro-batch ``j`` or None (waiting). ``kind``:
    "GPipe" (every forward, then every backward) or "1F1B" (after ``stages - s`` forwards, stage
    ``s`` alternates one backward and one forward)."""
    order = []
    for s in range(stages):
        if kind == "GPipe":
            ops = [("F", j) for j in range(micro)] + [("B", j) for j in range(micro)]
        else:
            warm = min(stages - s, micro)
            ops = [("F", j) for j in range(warm)]
            for j in range(micro):
                ops += [("B", j)] + ([("F", warm + j)] if warm + j < micro else [])
        order.append(ops)
    done: dict[tuple[str, int, int], int] = {}  # (F/B, stage, micro-batch) -> slot it ended
    slots: list[list] = [[] for _ in range(stages)]
    t = 0
    while any(order):
        for s, ops in enumerate(order):
            if not ops:
                continue
            op, j = ops[0]
            need = ("F", s - 1, j) if op == "F" else ("B", s + 1, j)
            if op == "B" and s == stages - 1:
                need = ("F", s, j)
            ready = (op == "F" and s == 0) or need in done  # done in an earlier slot
            slots[s].append(ops.pop(0) if ready else None)
        for s in range(stages):
            if slots[s][-1] is not None:
                op, j = slots[s][-1]
                done[(op, s, j)] = t
        t += 1
    for row in slots:  # every stage ends with the step
        row.extend([None] * (t - len(row)))
    return slots


def bubble(stages: int, micro: int) -> float:
    """The share of a step a stage waits in GPipe or 1F1B, forward and backward taking one slot
    each and sending nothing: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro + stages - 1)


def in_flight(slots: list[tuple[str, int] | None]) -> int:
    """The most micro-batches whose activations a stage holds at once (forward run, backward
    not yet) in its ``slots``."""
    held = most = 0
    for slot in slots:
        if slot is not None:
            held += 1 if slot[0] == "F" else -1
            most = max(most, held)
    return most
