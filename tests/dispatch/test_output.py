"""Rank output: tags, collapsing, order per rank, --no-stream grouping."""

import time

from monarch_nb.dispatch.output import LiveSink, Renderer


class ListSink:
    def __init__(self):
        self.out: list[tuple[str, str]] = []
        self.progress_seen: list[tuple[int, str | None]] = []

    def lines(self, name, text):
        self.out += [(name, line) for line in text.splitlines()]

    def display(self, ranks, data, metadata, display_id=None, update=False):
        self.out.append(("display", f"{sorted(ranks)} {data['text/plain']}"))

    def progress(self, rank, name, text):
        self.progress_seen.append((rank, text))

    def refresh(self, final=False):
        pass


def stream(lines, name="stdout"):
    return {"ev": "stream", "name": name, "lines": lines}


def test_identical_lines_collapse_and_order_is_kept_per_rank():
    sink = ListSink()
    r = Renderer([0, 1, 2, 3], sink, window=5)
    for rank in range(4):
        r.feed(rank, stream(["epoch 1", f"loss {rank}", "done"]))
    r.close()
    assert sink.out == [
        ("stdout", "[ranks 0-3] epoch 1"),
        ("stdout", "[rank 0] loss 0"),
        ("stdout", "[rank 1] loss 1"),
        ("stdout", "[rank 2] loss 2"),
        ("stdout", "[rank 3] loss 3"),
        ("stdout", "[ranks 0-3] done"),
    ]


def test_a_line_repeated_by_one_rank_is_not_merged_with_itself():
    sink = ListSink()
    r = Renderer([0, 1], sink, window=5)
    r.feed(0, stream(["x", "x"]))
    r.feed(1, stream(["x"]))
    r.close()
    assert sink.out == [("stdout", "[ranks 0-1] x"), ("stdout", "[rank 0] x")]


def test_no_collapse_and_streams_are_separate():
    sink = ListSink()
    r = Renderer([0, 1], sink, collapse=False)
    r.feed(0, stream(["a"]))
    r.feed(1, stream(["a"], "stderr"))
    r.close()
    assert sink.out == [("stdout", "[rank 0] a"), ("stderr", "[rank 1] a")]


def test_window_expiry_flushes_lines_that_only_some_ranks_print():
    sink = ListSink()
    r = Renderer([0, 1], sink, window=0.05)
    r.feed(0, stream(["only rank 0"]))
    assert sink.out == []
    time.sleep(0.06)
    r.tick()
    assert sink.out == [("stdout", "[rank 0] only rank 0")]


def test_display_keeps_its_place_among_lines():
    sink = ListSink()
    r = Renderer([0], sink)
    r.feed(0, stream(["before"]))
    r.feed(0, {"ev": "display", "data": {"text/plain": "<fig>"}, "metadata": {}})
    r.feed(0, stream(["after"]))
    r.close()
    assert sink.out == [
        ("stdout", "[rank 0] before"),
        ("display", "[0] <fig>"),
        ("stdout", "[rank 0] after"),
    ]


def test_no_stream_groups_by_rank_at_the_end():
    sink = ListSink()
    r = Renderer([0, 1, 2], sink, stream=False)
    r.feed(0, stream(["a", "b"]))
    r.feed(1, stream(["c"]))
    r.feed(2, stream(["a"]))
    r.feed(2, stream(["b"]))
    assert sink.out == []
    r.close()
    assert sink.out == [
        ("stdout", "[ranks 0,2] a"),
        ("stdout", "[ranks 0,2] b"),
        ("stdout", "[rank 1] c"),
    ]


def test_progress_lines_go_to_the_live_line_not_the_output():
    sink = ListSink()
    r = Renderer([0], sink)
    r.feed(0, {"ev": "progress", "name": "stdout", "text": "50%"})
    r.feed(0, stream(["100%"]))
    r.close()
    assert sink.out == [("stdout", "[rank 0] 100%")]
    assert sink.progress_seen == [(0, "50%"), (0, None)]


def test_flood_of_identical_lines_stays_linear():
    sink = ListSink()
    r = Renderer([0, 1, 2, 3], sink, window=60)
    n = 20000
    for rank in range(4):
        r.feed(rank, stream(["same"] * n))
    r.close()
    assert len(sink.out) == n
    assert all(line == ("stdout", "[ranks 0-3] same") for line in sink.out)


def test_a_value_mesh_shows_every_value_in_full_where_repr_stays_short():
    """IPython's display (text and HTML) shows each rank's value whole, as a dict's would;
    ``repr()`` keeps its short form for logs and messages."""
    import html

    import torch
    from IPython.lib.pretty import pretty

    from monarch_nb.dispatch.results import ValueMesh

    values = {0: torch.arange(40.0).view(4, 10), 1: "x" * 100}
    mesh = ValueMesh(values)
    shown = pretty(mesh)
    assert all(line.strip() in shown for line in repr(values[0]).splitlines())
    assert "x" * 100 in shown and shown.startswith("ValueMesh({0: tensor(")
    assert pretty(ValueMesh({0: 105, 1: 105})) == "ValueMesh({0: 105, 1: 105})"
    assert len(repr(mesh)) < 200
    assert html.escape(repr(values[0])) in mesh._repr_html_()


def clear(wait=False):
    return {"ev": "clear", "wait": wait}


class ClearingSink(ListSink):
    def clear(self, wait):
        self.out.append(("clear", "wait" if wait else "now"))


def test_clear_output_comes_after_what_the_rank_printed_before_it_and_ranks_clear_once():
    sink = ClearingSink()
    r = Renderer([0, 1], sink, window=5)
    for events in (
        lambda rank: stream([f"epoch 1 of rank {rank}"]),
        lambda rank: {"ev": "progress", "name": "stdout", "text": "50%"},
        lambda rank: clear(wait=True),
        lambda rank: stream(["epoch 2"]),
    ):
        for rank in (0, 1):
            r.feed(rank, events(rank))
    r.close()
    assert sink.out == [
        ("stdout", "[rank 0] epoch 1 of rank 0"),
        ("stdout", "[rank 1] epoch 1 of rank 1"),
        ("clear", "wait"),
        ("stdout", "[ranks 0-1] epoch 2"),
    ]
    cleared = [(0, None), (0, None), (1, None), (1, None)]  # the live lines go with the output
    assert sink.progress_seen[2:8] == [(0, "50%"), (1, "50%"), *cleared]

    sink = ClearingSink()
    r = Renderer([0, 1], sink, window=5)
    for rank in (0, 1):  # rank 0 is a whole cell ahead: rank 1's first line is cleared too
        r.feed(rank, stream([f"epoch 1 of rank {rank}"]))
        r.feed(rank, clear(wait=True))
        r.feed(rank, stream(["epoch 2"]))
    r.close()
    assert sink.out == [
        ("stdout", "[rank 0] epoch 1 of rank 0"),
        ("clear", "wait"),
        ("stdout", "[rank 1] epoch 1 of rank 1"),
        ("clear", "wait"),
        ("stdout", "[ranks 0-1] epoch 2"),
    ]


def test_clear_output_of_one_rank_clears_once_and_without_stream_clears_that_rank():
    sink = ClearingSink()
    r = Renderer([0, 1], sink, window=0.01)
    r.feed(0, clear())
    time.sleep(0.02)
    r.tick()
    assert sink.out == [("clear", "now")]

    sink = ClearingSink()
    r = Renderer([0, 1], sink, stream=False)
    r.feed(0, stream(["old"]))
    r.feed(1, stream(["kept"]))
    r.feed(0, clear())
    r.feed(0, stream(["new"]))
    r.close()
    assert sink.out == [("stdout", "[rank 0] new"), ("stdout", "[rank 1] kept")]


def test_a_noblock_cells_display_shows_what_came_after_clear_output_and_keeps_every_line():
    shown = []

    class Handle:
        def update(self, bundle, raw):
            shown.append(bundle["text/plain"])

    sink = LiveSink(lambda bundle, raw, display_id: Handle(), "cell on ranks 0-1")
    r = Renderer([0], sink)
    r.feed(0, stream(["epoch 1"]))
    r.feed(0, clear())
    r.feed(0, stream(["epoch 2"]))
    r.close()
    assert shown[-1].splitlines() == [
        "... clear_output() hid 1 line (handle.output has all)",
        "[rank 0] epoch 2",
    ]
    assert sink.lines_out == ["[rank 0] epoch 1", "[rank 0] epoch 2"]


def test_a_noblock_cells_display_ends_saying_how_it_ended():
    shown = []

    class Handle:
        def update(self, bundle, raw):
            shown.append(bundle["text/plain"])

    sink = LiveSink(lambda bundle, raw, display_id: Handle(), "[ranks 0-1] running")
    sink.finish("[ranks 0-1] 2 of 2 ranks failed: handle.result() raises it")
    assert shown[-1] == "[ranks 0-1] 2 of 2 ranks failed: handle.result() raises it"
    assert sink.lines_out == []  # not a line the cell printed


def test_at_64_ranks_numbers_merge_and_a_rank_that_diverges_stands_out():
    sink = ListSink()
    r = Renderer(list(range(64)), sink, window=5)
    for rank in range(64):
        loss = 9.73 if rank == 12 else 0.48 + rank * 0.0005
        last = "loss is nan, stopping" if rank == 32 else "saved"
        r.feed(rank, stream(["epoch 1", f"loss {loss:.4f}", last]))
    r.close()
    assert sink.out == [
        ("stdout", "[ranks 0-63] epoch 1"),
        ("stdout", "[ranks 0-11,13-63] loss 0.4800..0.5115"),
        ("stdout", "[rank 12] loss 9.7300"),
        ("stdout", "[ranks 0-31,33-63] saved"),
        ("stdout", "[rank 32] loss is nan, stopping"),
    ]


def test_under_16_ranks_every_rank_keeps_its_own_numbers():
    sink = ListSink()
    r = Renderer(list(range(15)), sink, window=5)
    for rank in range(15):
        r.feed(rank, stream([f"loss {rank}"]))
    r.close()
    assert sink.out == [("stdout", f"[rank {rank}] loss {rank}") for rank in range(15)]


def test_a_line_that_ranks_print_over_several_windows_stays_one_line(monkeypatch):
    from types import SimpleNamespace

    from monarch_nb.dispatch import output

    now = [0.0]
    monkeypatch.setattr(output, "time", SimpleNamespace(monotonic=lambda: now[0]))
    sink = ListSink()
    r = Renderer(list(range(32)), sink, window=0.2)
    for rank in range(7):  # a rank every 0.15 s, each within the window of the one before
        now[0] = 0.15 * rank
        r.feed(rank, stream(["step 1 done"]))
    assert sink.out == [], "held while ranks keep joining it"
    now[0] = 1.0  # a second after the first: shown without the ranks still to come
    r.tick()
    assert sink.out == [("stdout", "[ranks 0-6] step 1 done")]


def test_a_noblock_cell_that_floods_keeps_its_last_lines_and_says_how_many_went(monkeypatch):
    monkeypatch.setattr(LiveSink, "MAX_KEPT", 2 << 20)
    shown = []

    class Handle:
        def update(self, bundle, raw):
            shown.append(bundle["text/plain"])

    sink = LiveSink(lambda bundle, raw, display_id: Handle(), "cell on ranks 0-1")
    r = Renderer([0, 1], sink)
    line = "x" * 1000
    for i in range(3000):  # 6 MB from two ranks, against 2 MiB kept
        r.feed(i % 2, stream([f"{i:04d} {line}"]))
    r.close()
    output = sink.output()
    given_up = sink.given_up
    assert output[0] == f"... {given_up} earlier lines given up: only the last 2 MiB kept"
    assert given_up + len(output) - 1 == 3000
    assert sum(map(len, output[1:])) <= 2 << 20
    assert output[-1] == f"[rank 1] 2999 {line}"
    assert output[1] == f"[rank {given_up % 2}] {given_up:04d} {line}"  # none skipped after it
    assert shown[-1].splitlines()[0] == "... 2500 earlier lines (handle.output has the last 2 MiB)"


def test_a_no_stream_cell_past_its_bound_shows_what_it_held_then_streams(monkeypatch):
    monkeypatch.setattr(Renderer, "MAX_HELD", 1 << 20)
    sink = ListSink()
    r = Renderer([0, 1], sink, stream=False, window=0)
    line = "y" * 99_990  # with its number, 100 KB
    r.feed(0, stream([f"{i:03d} {line}" for i in range(4)]))
    r.feed(1, stream(["only once"]))
    r.feed(0, clear())  # what a rank cleared stops counting
    r.feed(0, stream([f"{i:03d} {line}" for i in range(4, 8)]))
    assert sink.out == []
    r.feed(1, stream([f"{i:03d} {line}" for i in range(8, 16)]))  # past 1 MiB at the 7th
    note = "monarch-nb: --no-stream held 1 MiB of output: it is shown here, and the rest as it"
    assert sink.out[0] == ("stderr", note + " comes")
    held = [f"[rank 0] {i:03d} {line}" for i in range(4, 8)]  # grouped by rank, as at the end
    held += ["[rank 1] only once"] + [f"[rank 1] {i:03d} {line}" for i in range(8, 15)]
    r.feed(0, stream(["after"]))
    r.close()
    shown = [text for _, text in sink.out[1:]]
    assert shown == [*held, f"[rank 1] 015 {line}", "[rank 0] after"]
