"""The parallelism lessons' pictures (notebooks 07 and 08), drawn in the kernel with bokeh: which
ranks hold each entry of a weight, a pipeline's schedule, the bytes and memory of each strategy,
and each strategy's losses less those of one process."""

from __future__ import annotations

from bokeh.models import ColumnDataSource
from bokeh.palettes import Category10
from bokeh.plotting import figure

from monarch_nb.examples.parallel_costs import schedule

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]  # one a rank
SHARED = ["#9467bd", "#8c564b", "#e377c2", "#bcbd22"]  # sets of some of the ranks
EVERY = "#bbbbbb"  # every rank holds a copy

Held = dict[int, dict[str, tuple[tuple[int, ...], list[int]]]]  # rank -> who_holds()


def owners(held: Held, name: str) -> dict[int, frozenset[int]]:
    """Which ranks hold each entry of weight ``name``: {entry index: frozenset of ranks}."""
    who: dict[int, set[int]] = {}
    for rank, h in held.items():
        for i in h.get(name, ((), []))[1]:
            who.setdefault(i, set()).add(rank)
    return {i: frozenset(ranks) for i, ranks in who.items()}


def holders(held: Held, name: str, title: str):
    """A picture of weight ``name``: each entry coloured by the set of ranks that hold it; grey
    only where every rank holds it, a colour of its own for a set of some of the ranks."""
    shape = next(h[name][0] for h in held.values() if name in h)
    rows, cols = shape if len(shape) == 2 else (1, shape[0])
    owner = owners(held, name)
    f = figure(
        title=title,
        width=300,
        height=max(110, min(280, 200 * rows // cols)),
        toolbar_location=None,
        x_range=(0, cols),
        y_range=(rows, 0),
    )
    shared = iter(SHARED)
    for who in sorted(set(owner.values()), key=lambda w: (len(w), sorted(w))):
        cells = [i for i, o in owner.items() if o == who]
        if who == {rank for rank, _ in held.items()}:
            color, label = EVERY, "every rank"
        elif len(who) == 1:
            color, label = COLORS[min(who)], f"rank {min(who)}"
        else:
            color, label = next(shared), "ranks " + ",".join(map(str, sorted(who)))
        f.rect(
            x=[i % cols + 0.5 for i in cells],
            y=[i // cols + 0.5 for i in cells],
            width=1,
            height=1,
            color=color,
            legend_label=label,
        )
    f.axis.visible = False
    f.grid.visible = False
    f.legend.label_text_font_size = "8pt"
    f.legend.glyph_width = f.legend.glyph_height = 12
    f.add_layout(f.legend[0], "right")  # beside the picture, not over it
    return f


def legend_labels(picture) -> list[str]:
    """The sets of ranks a picture of ``holders`` names, in its legend's order."""
    return [item.label.value for item in picture.legend[0].items]


def block_diagonal(held: Held, name: str, blocks: int, rows: int, cols: int) -> Held:
    """Entry indices of a Monarch factor (blocks, rows, cols) as those of the block-diagonal
    matrix it stands for, (blocks * rows, blocks * cols)."""
    out: Held = {}
    for rank, h in held.items():
        where = []
        for i in h[name][1]:
            b, rest = divmod(i, rows * cols)
            row_, col = divmod(rest, cols)
            where.append((b * rows + row_) * blocks * cols + b * cols + col)
        out[rank] = {name: ((blocks * rows, blocks * cols), where)}
    return out


def pipeline(kind: str, stages: int, micro: int):
    """A pipeline schedule drawn: a row per stage, a column per time slot; forwards blue,
    backwards orange, each marked with its micro-batch; the empty slots are the bubble."""
    slots = schedule(kind, stages, micro)
    cells = {"x": [], "y": [], "color": [], "text": []}
    for s, row in enumerate(slots):
        for t, slot in enumerate(row):
            if slot is not None:
                cells["x"].append(t + 0.5)
                cells["y"].append(s + 0.5)
                cells["color"].append(COLORS[0] if slot[0] == "F" else COLORS[1])
                cells["text"].append(f"{slot[0]}{slot[1]}")
    idle = sum(slot is None for row in slots for slot in row) / (stages * len(slots[0]))
    f = figure(
        title=f"{kind}: {stages} stages, {micro} micro-batches, waiting {idle:.0%}",
        width=520,
        height=40 * stages + 60,
        toolbar_location=None,
        x_range=(0, len(slots[0])),
        y_range=(stages, 0),
        x_axis_label="time slot (one forward or one backward)",
    )
    source = ColumnDataSource(cells)
    f.rect(x="x", y="y", width=0.95, height=0.9, color="color", source=source)
    f.text(
        x="x",
        y="y",
        text="text",
        source=source,
        text_align="center",
        text_baseline="middle",
        text_color="white",
        text_font_size="9pt",
    )
    f.yaxis.ticker = [s + 0.5 for s in range(stages)]
    f.yaxis.major_label_overrides = {s + 0.5: f"stage {s}" for s in range(stages)}
    f.grid.visible = False
    return f


def costs(sent: dict[str, float], memory: dict[str, dict[str, int]], other: set[str] = frozenset()):
    """Two bar charts side by side: the bytes the busiest rank sent per step, and the memory a
    rank holds (parameters, gradients, optimizer state, stacked), per strategy; a strategy in
    ``other`` trains another model and is grey, its name marked."""
    from bokeh.layouts import row

    label = {n: f"{n} (other model)" if n in other else n for n in sent}
    names = [label[n] for n in sent]
    bars = figure(
        x_range=names,
        title="KiB the busiest rank sent a step",
        width=380,
        height=300,
        toolbar_location=None,
    )
    for group, color in (([n for n in sent if n not in other], COLORS[0]), (other, "#7f7f7f")):
        group = [n for n in group if n in sent]
        bars.vbar(
            x=[label[n] for n in group], top=[sent[n] / 1024 for n in group], width=0.6, color=color
        )
    kinds = ["parameters", "gradients", "optimizer"]
    held = {"name": [label[n] for n in memory]}
    held.update({k: [memory[n][k] / 1024 for n in memory] for k in kinds})
    mem = figure(
        x_range=held["name"], title="KiB a rank holds", width=420, height=300, toolbar_location=None
    )
    mem.vbar_stack(kinds, x="name", width=0.6, color=COLORS[:3], source=held, legend_label=kinds)
    mem.add_layout(mem.legend[0], "right")
    for f in (bars, mem):
        f.xaxis.major_label_orientation = 0.5
    return row(bars, mem)


def loss_gaps(losses: dict[str, list[float]], reference: list[float]):
    """Each strategy's losses less the one-process run's, drawn side by side at each step (a
    little apart) so that equal differences do not hide each other; a colour a strategy."""
    f = figure(
        title="each strategy's loss minus one process's",
        width=520,
        height=260,
        toolbar_location=None,
        x_axis_label="step",
        y_axis_label="difference",
    )
    for k, (name, color) in enumerate(zip(losses, Category10[10], strict=False)):
        steps = [s + 0.08 * (k - (len(losses) - 1) / 2) for s in range(len(reference))]
        gap = [a - b for a, b in zip(losses[name], reference, strict=True)]
        f.line(steps, gap, color=color, legend_label=name)
        f.scatter(steps, gap, color=color, size=5, legend_label=name)
    f.legend.label_text_font_size = "8pt"
    f.add_layout(f.legend[0], "right")
    return f
