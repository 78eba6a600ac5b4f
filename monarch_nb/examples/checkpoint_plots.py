"""Kernel-side helpers of lesson 09 (checkpoints and faults): the rows each rank holds, the
bands a checkpoint was saved in, and the picture of a run that lost a rank and went on.

Imports bokeh: the notebook's kernel has it, ranks need not (they never import this module).
"""

from __future__ import annotations

from bokeh.models import BoxAnnotation, Span
from bokeh.plotting import figure


def rows_held(held: dict, name: str) -> dict[int, tuple[int, int]]:
    """{rank: (first row, last row + 1)} of weight ``name``, from ``who_holds`` on every rank
    (a ValueMesh or dict of {name: (shape, flat indices held)}); FSDP holds whole rows."""
    rows = {}
    for rank, h in dict(held.items()).items():
        shape, indices = h[name]
        cols = shape[1] if len(shape) == 2 else 1
        held_rows = sorted({i // cols for i in indices})
        rows[rank] = (held_rows[0], held_rows[-1] + 1) if held_rows else (0, 0)
    return rows


def saved_bands(step_dir: str, name: str) -> list[tuple[int, int]]:
    """The bands of rows ``name`` was saved in (one a saving rank, in order): read from the
    metadata torch.distributed.checkpoint writes beside the shards, as a load reads it."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata[f"model.{name}"]
    bands = [(c.offsets[0], c.offsets[0] + c.sizes[0]) for c in meta.chunks]
    return sorted(bands)


def resume_figure(
    first: dict[int, float],
    resumed: dict[int, float],
    reference: list[float],
    every: int,
    killed_at: int,
):
    """The loss by step: the uninterrupted run (grey), the run that lost a rank (up to the
    kill, red), the run that went on from the last checkpoint (blue); the saves as dashed
    lines and the steps thrown away shaded."""
    f = figure(
        title=f"a rank killed as step {killed_at} began; saves every {every} steps",
        width=640,
        height=300,
        x_axis_label="step",
        y_axis_label="loss",
        toolbar_location=None,
    )
    f.line(
        list(range(len(reference))),
        reference,
        color="#bbbbbb",
        line_width=6,
        legend_label="uninterrupted, one process",
    )
    for run, color, label, size in (
        (first, "#d62728", "first run, until rank 3 died", 11),
        (resumed, "#1f77b4", "resumed from the checkpoint", 6),
    ):
        steps = sorted(run)
        f.line(steps, [run[s] for s in steps], color=color, line_width=2, legend_label=label)
        # the first run's markers larger: where both runs went, both show
        f.scatter(steps, [run[s] for s in steps], color=color, size=size, fill_alpha=0.5)
    for save in range(every, len(reference) + 1, every):
        f.add_layout(
            Span(location=save - 0.5, dimension="height", line_dash="dashed", line_color="#2ca02c")
        )
    last = killed_at // every * every
    if killed_at > last:
        f.add_layout(
            BoxAnnotation(
                left=last - 0.5, right=killed_at - 0.5, fill_color="#d62728", fill_alpha=0.12
            )
        )
    f.legend.location = "bottom_left"
    return f


def interval_table(step_s: float, save_s: float, intervals: list[int]) -> list[dict]:
    """For each interval ``k`` (steps between saves): the time saving adds to each step, as a
    share of the step, and the steps a failure throws away, on average ((k - 1) / 2: a kill
    as any of the k steps after a save begins) and at most (k - 1). Printed, and returned."""
    rows = []
    print(f"{'save every':>10}  {'saving adds':>11}  {'steps lost: average':>19}  {'at most':>7}")
    for k in intervals:
        row = {"every": k, "overhead": save_s / (k * step_s), "mean": (k - 1) / 2, "most": k - 1}
        rows.append(row)
        print(f"{k:>10}  {row['overhead']:>10.0%}  {row['mean']:>19.1f}  {row['most']:>7}")
    return rows
