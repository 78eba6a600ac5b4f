"""The figures of notebooks/03-monarch-matrices.ipynb, drawn in the kernel (bokeh is not on the
ranks): a Monarch matrix's factors as heat maps, the projection's error against the number of
blocks, and two training runs' losses.

The factors follow the specification in monarch_kernels: for ``w1`` of shape (k, q, p) and ``w2``
of shape (l, s, r), ``monarch_dense(w1, w2) == P_out @ L @ P @ R``.
"""

from __future__ import annotations

import torch
from bokeh.layouts import row
from bokeh.models import LayoutDOM
from bokeh.plotting import figure

COLORS = ("#1f77b4", "#d62728")


def perm(rows: int, cols: int) -> torch.Tensor:
    """The permutation matrix of the (rows, cols) -> (cols, rows) transpose of a vector:
    ``(P v)[c * rows + r] = v[r * cols + c]``."""
    eye = torch.eye(rows * cols, dtype=torch.float64)
    return eye.view(rows, cols, -1).transpose(0, 1).reshape(rows * cols, -1)


def factors(w1: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
    """The four dense factors of the Monarch matrix of ``w1`` (k, q, p) and ``w2`` (l, s, r), in
    the order they act from the left: output interleave, L, permutation, R."""
    k, q, _p = w1.shape
    l, s, r = w2.shape  # noqa: E741 (the specification's names)
    assert k * q == l * r, f"stage 1 makes k q = {k * q} outputs, stage 2 takes l r = {l * r}"
    return {
        "output interleave": perm(l, s),  # (l s) -> (s l)
        "L = blockdiag(w2)": torch.block_diag(*w2),  # stage 2, (l s, l r)
        "permutation (r l) -> (l r)": perm(r, l),
        "R = blockdiag(w1)": torch.block_diag(*w1),  # stage 1, (k q, k p)
    }


def heat(mat: torch.Tensor, title: str, size: int = 230) -> figure:
    """A matrix's absolute values as a heat map, row 0 at the top (as printed)."""
    a = mat.detach().abs().double().numpy()[::-1]
    f = figure(
        title=title,
        width=size,
        height=size,
        toolbar_location=None,
        x_range=(0, a.shape[1]),
        y_range=(0, a.shape[0]),
    )
    f.image(image=[a], x=0, y=0, dw=a.shape[1], dh=a.shape[0], palette="Viridis256")
    f.axis.visible = False
    return f


def factors_row(mats: dict[str, torch.Tensor]) -> LayoutDOM:
    """A heat map per named matrix, side by side (the product reads right to left)."""
    return row(*[heat(m, title) for title, m in mats.items()])


def error_figure(blocks: list[int], errors: dict[str, list[float]]) -> figure:
    """The projection's relative error against the number of blocks, a line per matrix."""
    fig = figure(
        title="relative Frobenius error of the projection",
        width=480,
        height=280,
        x_axis_type="log",
        x_axis_label="blocks",
        y_axis_label="error",
    )
    for (name, errs), color in zip(errors.items(), COLORS, strict=True):
        fig.line(blocks, errs, legend_label=name, color=color, line_width=2)
        fig.scatter(blocks, errs, color=color, size=6)
    fig.legend.location = "bottom_right"  # clear of both lines: the error grows with the blocks
    return fig


def loss_figure(losses: dict[str, list[float]]) -> figure:
    """Training losses by epoch, a line per run, on a log scale."""
    fig = figure(
        title="training loss (last batch of each epoch)",
        width=480,
        height=280,
        x_axis_label="epoch",
        y_axis_type="log",
    )
    for (name, values), color in zip(losses.items(), COLORS, strict=True):
        fig.line(list(range(len(values))), values, legend_label=name, color=color, line_width=2)
    return fig
