"""The picture and the text under a profiled cell, from hand-built analyses (4 ranks on one
host, 32 ranks on 4 hosts): the timeline's renderers, rows, legend and hover, the numbers'
table and text, the rank that left no trace; and both drawn in headless Chromium, with the
screenshots in tests/artifacts/timeline-*.png."""

from __future__ import annotations

import pytest
from _lab import ARTIFACTS, chromium, requires_chromium
from bokeh.models import Div, GlyphRenderer, HoverTool, Legend, LinearAxis, Plot

from monarch_nb.notebook import bokeh_display, profile_view
from monarch_nb.telemetry import timeline_figure as tf
from monarch_nb.telemetry.profile_model import Analysis, Numbers, Timeline

STRAGGLER = "rank 1 is 40% slower per step; the others wait for it in all_reduce"


def analysis(ranks: int, hosts: int = 1, status: dict[int, str] | None = None) -> Analysis:
    """Five steps per rank (the first a warm-up) of compute overlapping an all_reduce, then
    idle; rank 1 the straggler, with an all_gather in step 2; a rank "lost" has no trace, one
    "error" stopped after two steps."""
    status = {r: (status or {}).get(r, "ok") for r in range(ranks)}
    bars = {k: [] for k in ("rank", "start", "end", "kind", "name", "step", "dur")}
    steps = {k: [] for k in ("rank", "step", "start", "end", "warmup")}
    rows = []

    def bar(rank, start, end, kind, name, step):
        for k, v in zip(bars, (rank, start, end, kind, name, step, end - start), strict=True):
            bars[k].append(v)

    for r in range(ranks):
        if status[r] == "lost":
            continue
        length = 14.0 if r == 1 else 10.0
        for k in range(2 if status[r] == "error" else 5):
            s = 1.0 + k * length
            for key, v in zip(steps, (r, k, s, s + length, k == 0), strict=True):
                steps[key].append(v)
            bar(r, s, s + 0.6 * length, "compute", "aten::mm", k)
            bar(r, s + 0.5 * length, s + 0.8 * length, "comm", "gloo:all_reduce", k)
            bar(r, s + 0.8 * length, s + length, "idle", "idle", k)
            if r == 1 and k == 2:
                bar(r, s + 0.1, s + 0.4, "comm", "nccl:all_gather_into_tensor", k)
        length_ms = 14.0 if r == 1 else 10.0
        rows.append(
            {
                "rank": r,
                "steps": 4,
                "step_ms": length_ms,
                "compute_ms": 0.6 * length_ms,
                "comm_ms": 0.3 * length_ms,
                "idle_ms": 0.2 * length_ms,
                "overlap": 1 / 3,
            }
        )
    per_host = max(ranks // hosts, 1)
    timeline = Timeline(
        ranks=list(range(ranks)),
        status=status,
        hosts={r: f"node-{r // per_host}" for r in range(ranks)},
        origin_us=1.7e15,
        bars=bars,
        steps=steps,
        align_error_us=12.5,
        left_out="1,204 ops under 5 µs were left out of the picture",
    )
    numbers = Numbers(
        source="CPU ops and collectives",
        rows=rows,
        straggler=STRAGGLER,
        straggler_rank=1,
        notes=["GPU kernels: pip install HolisticTraceAnalysis"],
    )
    return Analysis(timeline, numbers)


FOUR = {2: "error", 3: "lost"}


def plot_of(layout) -> Plot:
    return next(iter(layout.select({"type": Plot})))


def test_four_ranks_rows_renderers_legend_and_hover():
    layout = tf.layout(analysis(4, status=FOUR), "profile of cell 3")
    fig = plot_of(layout)
    assert fig.title.text == "profile of cell 3"
    names = {r.name for r in fig.select({"type": GlyphRenderer}) if r.name}
    assert names == {"compute", "idle", "all_reduce", "all_gather"}
    labels = fig.left[0].major_label_overrides
    assert labels == {
        0: "rank 0",
        -1: "rank 1",
        -2: "rank 2 · error",
        -3: "rank 3 · lost (no trace)",
    }
    (legend,) = fig.select({"type": Legend})
    assert legend in fig.right  # beside the plot, never over its bars
    assert [i.label.value for i in legend.items] == [
        "compute",
        "all_reduce",
        "all_gather",
        "idle",
        "warm-up (not counted)",
    ]
    (hover,) = fig.select({"type": HoverTool})
    assert " ".join(name for name, _ in hover.tooltips) == "op kind duration step rank start"
    gather = next(r for r in hover.renderers if r.name == "all_gather").data_source.data
    assert gather["name"] == ["nccl:all_gather_into_tensor"]
    assert gather["dur_text"] == ["0.300 ms"] and gather["step_text"] == ["2"]
    assert gather["rank_text"] == ["rank 1"]
    compute = next(r for r in hover.renderers if r.name == "compute").data_source.data
    allreduce = next(r for r in hover.renderers if r.name == "all_reduce").data_source.data
    # compute above the collectives within a row, so that overlap shows
    assert min(compute["bottom"][:5]) > max(allreduce["top"][:5])
    # it opens on the measured steps (from 10.5 ms); the warm-up is a pan away, within bounds
    assert 10.0 < fig.x_range.start < 10.5 and fig.x_range.end > 71.0
    assert fig.x_range.bounds[0] < 1.0
    assert not any(isinstance(a, LinearAxis) for a in fig.right)  # one host: no host axis
    texts = [r.data_source.data.get("text") for r in fig.select({"type": GlyphRenderer})]
    assert ["no trace"] in texts
    assert any(t and "step 3" in t and "warm-up" in t for t in texts)


def test_the_table_names_the_straggler():
    div = next(iter(tf.layout(analysis(4, status=FOUR), "p").select({"type": Div})))
    assert STRAGGLER in div.text
    assert 'style="background:#fdecea;font-weight:600"><td style="padding:1px 8px">1<' in div.text
    for words in (
        "numbers from: CPU ops and collectives",
        "clocks aligned within ±12.5 µs",
        "1,204 ops under 5 µs were left out",
        "pip install HolisticTraceAnalysis",
        "rank 3 · lost (no trace)",
        '<td style="padding:1px 8px">14.0</td>',
    ):
        assert words in div.text


def test_the_table_escapes():
    a = analysis(2)
    a.numbers.straggler = "rank <1> & co"
    div = next(iter(tf.layout(a, "p").select({"type": Div})))
    assert "rank &lt;1&gt; &amp; co" in div.text and "<1>" not in div.text


def test_no_rank_left_a_trace():
    a = analysis(2, status={0: "lost", 1: "lost"})
    a.numbers.straggler = a.numbers.straggler_rank = None
    assert tf.text(a, None).splitlines()[:2] == [
        "no rank left a trace",
        "numbers from: CPU ops and collectives · clocks aligned within ±12.5 µs",
    ]
    layout = tf.layout(a, "p")
    assert "no rank left a trace" in next(iter(layout.select({"type": Div}))).text
    texts = [r.data_source.data.get("text") for r in plot_of(layout).select(GlyphRenderer)]
    assert ["no trace", "no trace"] in texts


def test_text_lines():
    lines = tf.text(analysis(4, status=FOUR), "/tmp/traces/cell-3").splitlines()
    assert lines[0] == STRAGGLER
    words = [" ".join(line.split()) for line in lines]
    assert words[1] == "rank steps step ms compute ms % comm ms % idle ms % overlap"
    assert words[3] == "1 4 14.0 8.40 60% 4.20 30% 2.80 20% 33%"
    assert len(lines[2]) == len(lines[1])  # fixed width
    assert "clocks aligned within ±12.5 µs" in lines[5]
    assert lines[6] == "not ok: rank 2 · error, rank 3 · lost (no trace)"
    assert lines[-1] == "traces: /tmp/traces/cell-3"
    assert "traces:" not in tf.text(analysis(2), None)


def test_thirty_two_ranks_grouped_by_host():
    a = analysis(32, hosts=4, status={9: "lost"})
    fig = plot_of(tf.layout(a, "32 ranks"))
    (hosts,) = [a for a in fig.right if isinstance(a, LinearAxis)]
    assert sorted(hosts.major_label_overrides.values()) == [f"node-{h} · 8" for h in range(4)]
    labels = fig.left[0].major_label_overrides
    assert labels[0] == "rank 0" and labels[-9] == "rank 9 · lost (no trace)"
    assert len(labels) == 32  # 18 px rows: every rank written
    assert 500 <= fig.frame_height <= tf.MAX_FRAME_PX
    lines = tf.text(a, None).splitlines()
    table = [line.split()[0] for line in lines[2:6]]
    assert table == ["0", "1", "31", "median"]  # the fastest, the slowest two, the median
    assert lines[6] == "3 of 31 ranks: the fastest and slowest"


def test_many_ranks_label_every_kth_and_stay_under_the_cap():
    a = analysis(256, hosts=8)
    fig = plot_of(tf.layout(a, "256 ranks"))
    assert fig.frame_height <= tf.MAX_FRAME_PX
    labels = fig.left[0].major_label_overrides
    assert 0 in labels and -32 in labels  # each host's first rank
    assert len(labels) < 256


def test_collective_names():
    for name, kind in (
        ("gloo:all_reduce", "all_reduce"),
        ("c10d::allreduce_", "all_reduce"),
        ("nccl:_reduce_scatter_base", "reduce_scatter"),
        ("c10d::_allgather_base_", "all_gather"),
        ("nccl:all_to_all", "all_to_all"),
        ("c10d::broadcast_", "broadcast"),
        ("nccl:send", "send/recv"),
        ("gloo:barrier", "barrier"),
        ("record_param_comms", "other"),
    ):
        assert tf.collective(name) == kind, name
    assert [tf.ms(x) for x in (1234.4, 12.34, 0.01234, 0)] == ["1234", "12.3", "0.0123", "0"]


def test_show_prints_and_draws_only_under_ipython(monkeypatch, capsys):
    shown = []
    monkeypatch.setattr(bokeh_display, "show", shown.append)
    monkeypatch.setattr("IPython.get_ipython", lambda: None)
    profile_view.show(analysis(4, status=FOUR), "p", "/tmp/t")
    assert capsys.readouterr().out.startswith(f"profile of p\n{STRAGGLER}") and shown == []
    monkeypatch.setattr("IPython.get_ipython", lambda: object())
    profile_view.show(analysis(4, status=FOUR), "p", "/tmp/t")
    assert "traces: /tmp/t" in capsys.readouterr().out
    assert len(shown) == 1 and plot_of(shown[0]).title.text == "p"


# Where a point of the data is on the page: the plot's view (bokeh draws in a shadow root).
PAGE_XY = """([x, y]) => {
  const find = (v) => v.frame ? v : [...(v.child_views ?? [])].map(find).find(Boolean);
  const v = Object.values(Bokeh.index).map(find).find(Boolean);
  const box = v.canvas_view.el.getBoundingClientRect();
  return [box.left + v.frame.x_scale.compute(x), box.top + v.frame.y_scale.compute(y)];
}"""


@requires_chromium
@pytest.mark.timeout(120)
def test_drawn_in_chromium(tmp_path):
    from bokeh.embed import file_html
    from bokeh.resources import INLINE

    with chromium() as browser:
        # taller than either page: a full-page shot of a taller one catches bokeh mid-relayout
        page = browser.new_page(viewport={"width": 1200, "height": 1300})
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
        for ranks, hosts, status in ((4, 1, FOUR), (32, 4, {9: "lost", 20: "interrupted"})):
            path = tmp_path / f"timeline-{ranks}.html"
            layout = tf.layout(analysis(ranks, hosts, status), f"profile: {ranks} ranks")
            path.write_text(file_html(layout, INLINE, "timeline"))
            page.goto(path.as_uri())
            plot = page.locator(".bk-Figure").first
            plot.wait_for()
            page.wait_for_timeout(300)
            assert _colours(plot.screenshot()) > 10, "the plot's canvas is blank"
            page.screenshot(path=ARTIFACTS / f"timeline-{ranks}-ranks.png", full_page=True)
            # rank 1's all_gather in step 2 (from 29.1 to 29.4 ms, in the row's lower half)
            page.mouse.move(*page.evaluate(PAGE_XY, [29.25, -1.3]))
            tip = page.locator("div.bk-tooltip-content")
            tip.first.wait_for()
            assert "op:\tnccl:all_gather_into_tensor\nkind:\tcomm (all_gather)" in tip.inner_text()
            assert "duration:\t0.300 ms\nstep:\t2\nrank:\trank 1" in tip.inner_text()
        assert errors == []


def _colours(png: bytes) -> int:
    """How many colours a screenshot has (a blank canvas: one)."""
    import io

    from PIL import Image

    return len(Image.open(io.BytesIO(png)).convert("RGB").getcolors(1 << 24))
