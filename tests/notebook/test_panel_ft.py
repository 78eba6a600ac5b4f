"""Fault tolerance in the live panel (a cluster started with --ft): each rank's way out of a
cell and back, the participants per step under the loss, the losses marked on it, in both
layouts; nothing of it elsewhere. And the kernel's feed reaching the scheduler's metrics.json,
where the sidebar reads it. Fake records (a controller's ft_events and ft_steps as healing.py
writes them): a real kill is the fault-tolerance tests' business."""

from __future__ import annotations

import collections
import json
import time
import types
import urllib.request
import xml.etree.ElementTree as ET

import pytest

from monarch_nb import registry
from monarch_nb.notebook import panel_compact, panel_ft, panel_svg
from monarch_nb.notebook.widgets import LivePanel
from monarch_nb.telemetry import figures, ft_feed
from monarch_nb.telemetry.store import Store

SVG = "{http://www.w3.org/2000/svg}"
NOW = time.time()


def records(world: int, up_to: str) -> tuple[list[dict], collections.deque]:
    """Rank 1 lost at step 60 of 120, then as far as ``up_to`` on its way back (back at 80, a
    moment ago);
    every rank's reports of (time, step, participants), a step a second until now."""
    order = ["lost", "joining", "healing", "back"]
    stamps = {"lost": NOW - 50, "joining": NOW - 45, "healing": NOW - 41, "back": NOW - 3}
    steps = {"lost": 60, "joining": None, "healing": 78, "back": 80}
    events = [
        {"time": stamps[e], "rank": 1, "event": e, "step": steps[e],
         "participants": None if e == "joining" else world - (e != "back")}
        for e in order[: order.index(up_to) + 1]
    ]  # fmt: skip
    reports = collections.deque(
        (NOW - 120 + s, s, world - 1 if 60 <= s < 80 else world) for s in range(120)
    )
    return events, reports


def fake_ctl(world: int = 3, up_to: str = "lost", ft: bool = True):
    events, reports = records(world, up_to)
    return types.SimpleNamespace(
        ft=object() if ft else None, ft_events=events, ft_steps=reports, world_size=world
    )


def cell(world: int, t0: float = NOW - 130):
    return types.SimpleNamespace(
        t0=t0, ranks=list(range(world)), remaining=set(range(world)), status={}
    )


def snapshot(world: int) -> dict:
    store = Store()
    for rank in range(world):
        rows = [[s, NOW - 120 + s, {"loss": 2.0 / (1 + s / 20) + 0.01 * rank}] for s in range(120)]
        store.add({"rank": rank, "worker": str(rank), "host": "node", "scalars": rows})
    return store.snapshot(points=400)


def picture(world: int, up_to: str, ft: bool = True) -> tuple[dict, str]:
    ctl = fake_ctl(world, up_to, ft)
    feed = panel_ft.feed(ctl, cell(world), NOW)
    states = {r: ("running", 9.0) for r in range(world)}
    states.update({a["rank"]: (a["state"], None) for a in (feed or {}).get("away", [])})
    view = panel_svg.panel_view(snapshot(world), states, now=NOW, cell=True, ft=feed)
    return view, panel_svg.render(view, "cell", "here")


def svg_of(html: str) -> ET.Element:
    return ET.fromstring(html[html.index("<svg") : html.index("</svg>") + len("</svg>")])


def shown(html: str) -> list[str]:
    return ["".join(t.itertext()) for t in svg_of(html).iter(f"{SVG}text")]


def classed(html: str, name: str) -> list[ET.Element]:
    return [e for e in svg_of(html).iter() if e.get("class") == name]


@pytest.mark.parametrize(
    ("up_to", "state", "note"),
    [
        ("lost", "lost", "lost at step 60"),
        ("joining", "joining", "joining: setup cells"),
        ("healing", "healing", "healing from a peer at step 78"),
    ],
)
def test_a_rank_away_shows_its_state_and_the_participants_under_the_loss(up_to, state, note):
    view, html = picture(3, up_to)
    texts = shown(html)
    assert state in texts and any(t.startswith(note) for t in texts), texts
    assert "participants per step" in texts and "3 of 3 at step 119" in texts
    (line,) = classed(html, "ft-participants")  # 3 up to step 60, 2 until 80, 3 again
    assert line.get("d").count("V") == 3
    assert len(classed(html, "ft-fewer")) == 1
    (mark,) = classed(html, "ft-mark")
    assert mark.find(f"{SVG}title").text == "rank 1 lost"
    # the mark is at step 60 of the loss chart, whose x axis the participants chart shares
    path = line.get("d").split()
    x_fall = float(path[1][1:])  # "H<x>": where 3 becomes 2
    assert float(mark.get("x1")) == pytest.approx(x_fall, abs=0.2)
    assert f"rank 1  {state}" in panel_svg.text(view, "t")


def test_back_then_running_and_the_picture_keeps_its_size():
    _, lost = picture(3, "lost")
    _, back = picture(3, "back")
    texts = shown(back)
    assert texts.count("running 9.0 s") == 3  # the states went back to running
    assert any(t.startswith("back at step 80 · loss") for t in texts)  # briefly, on its row
    assert any("rank 1 back at step 80; 3 of 3 train" in t for t in texts)
    assert svg_of(lost).get("viewBox") == svg_of(back).get("viewBox")
    _, plain = picture(3, "back", ft=False)
    assert svg_of(plain).get("viewBox") != svg_of(back).get("viewBox")  # the strip under


def test_the_compact_panel_names_the_ranks_away_and_draws_participants():
    _, html = picture(32, "healing")
    texts = shown(html)
    assert "running ranks 0,2-31 (9.0 s) · healing rank 1" in texts
    assert "32 of 32 at step 119" in texts
    assert classed(html, "ft-participants") and classed(html, "ft-mark")
    assert len(html) <= panel_compact.MAX_BYTES


def test_without_ft_nothing_of_it_is_drawn():
    for ctl in (fake_ctl(ft=False), types.SimpleNamespace(world_size=3)):  # no attributes
        assert panel_ft.feed(ctl, cell(3), NOW) is None
        assert panel_ft.away(ctl, cell(3)) == {}
    _, html = picture(3, "lost", ft=False)
    texts = shown(html)
    assert "participants per step" not in texts and "fault tolerance" not in texts
    assert not classed(html, "ft-mark") and not classed(html, "ft-participants")


def test_participants_keep_the_changes_and_a_rank_done_is_not_away():
    reports = [(1.0, 0, 3), (1.1, 0, 3), (2.0, 1, 3), (3.0, 2, 2), (3.1, 3, 2), (4.0, 4, 3)]
    assert ft_feed.participants(reports) == [[0, 3], [2, 2], [4, 3]]
    assert ft_feed.participants(reports, since=3.0) == [[2, 2], [4, 3]]
    req = cell(3)
    req.status[1] = "lost"  # given up on: the cell's own state says so
    assert panel_ft.away(fake_ctl(3, "joining"), req) == {}
    assert panel_ft.away(fake_ctl(3, "joining"), cell(3, t0=NOW - 10)) == {}  # another cell's


def tuples(x):
    if isinstance(x, dict):
        return {k: tuples(v) for k, v in x.items()}
    return tuple(tuples(v) for v in x) if isinstance(x, list) else x


def test_the_scheduler_keeps_only_a_well_formed_feed():
    feed = panel_ft.feed(fake_ctl(3, "joining"), cell(3), NOW)
    assert ft_feed.bounded(json.loads(json.dumps(feed))) == feed
    assert ft_feed.bounded(tuples(feed)) == feed  # as Dask's msgpack hands it over
    assert ft_feed.bounded({"world": "3"}) is None
    odd = ft_feed.bounded({"world": 2, "participants": [[0, 2], ["x", 1], [1]], "away": [
        {"rank": 1, "state": "exploded"}, {"rank": 0, "state": "lost", "step": 4}]})  # fmt: skip
    assert odd["participants"] == [[0, 2]]
    assert odd["away"] == [{"rank": 0, "state": "lost", "step": 4}]


def test_a_cell_panel_publishes_its_feed_to_metrics_json(ctl, monkeypatch):
    """The live panel of an ft cell sends its feed to the scheduler, whose metrics.json (what
    the Jupyter server proxies to the sidebar) carries it; the rank away has that state."""
    events, reports = records(ctl.world_size, "lost")
    monkeypatch.setattr(ctl, "ft", object())
    monkeypatch.setattr(ctl, "ft_events", events)
    monkeypatch.setattr(ctl, "ft_steps", reports)
    panel = LivePanel(ctl)
    try:
        panel.track(cell(ctl.world_size))
        assert panel.cell_states()[1] == ("lost", None)
        panel.publish()
    finally:
        panel.close()
    url = registry.dashboard_for(ctl.client.dashboard_link, ctl.scheduler_address)
    deadline = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(url + "monarch/metrics.json?points=1&samples=1") as r:
            payload = json.loads(r.read())
        if payload["metrics"].get("ft") or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    ft = payload["metrics"]["ft"]
    assert ft["away"] == [{"rank": 1, "state": "lost", "step": 60}]
    assert ft["lost"] == [[60, 1]] and ft["participants"][-1] == [119, ctl.world_size]
    view = figures.rank_view(payload)  # what the server sends the sidebar
    assert [r["status"] for r in view["ranks"]][:2] == ["running", "lost"]
    assert view["ft"] == ft
