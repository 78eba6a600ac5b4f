"""monarch_nb.log() on workers, batching, the bounded stores, history on the controller."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import threading
import time
import types
import uuid
import warnings

import numpy as np
import pytest
import torch

import monarch_nb
from monarch_nb import CellError
from monarch_nb.telemetry import metrics
from monarch_nb.telemetry import recorder as on_worker
from monarch_nb.telemetry import samplers as telemetry
from monarch_nb.telemetry import store as metrics_store
from monarch_nb.telemetry.samplers import FIELDS


@pytest.fixture(scope="module")
def hub(ctl):
    """The shared cluster's metrics hub (installed here if the controller has none)."""
    existing = getattr(ctl, "metrics", None)
    if isinstance(existing, metrics.MetricsHub):
        yield existing
        return
    hub = metrics.install(ctl.client)
    yield hub
    hub.close()


def wait_for(predicate, timeout=15.0, what="the metrics"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def unique(prefix):
    return f"{prefix}_{uuid.uuid4().hex[:6]}"


# -- through a real cluster ----------------------------------------------------------------------
def test_log_in_a_cell_reaches_history(clean, hub):
    name = unique("loss")
    clean.run(
        "import torch\nimport monarch_nb.telemetry.recorder as m\n"
        "for i in range(5):\n"
        f"    m.log(step=10 * i, {name}=rank + i / 10, lr=torch.tensor(0.5))\n",
        stream=False,
    )

    def rows():
        h = hub.history()
        got = {r: [row for row in h.get(r, []) if name in row.values] for r in (0, 1)}
        return got if all(len(v) == 5 for v in got.values()) else None

    got = wait_for(rows)
    for rank, mine in got.items():
        assert [row.step for row in mine] == [0, 10, 20, 30, 40]
        assert [row.values[name] for row in mine] == [rank + i / 10 for i in range(5)]
        assert all(row.values["lr"] == 0.5 for row in mine)
        assert all(abs(row.time - time.time()) < 60 for row in mine)
    assert hub.latest()[1]["values"][name] == pytest.approx(1.4)
    assert hub.latest()[1]["step"] == 40
    assert metrics.history()[0][-1].values[name] == pytest.approx(0.4)
    series = hub.history().series(name)
    assert series[1] == ([0, 10, 20, 30, 40], [1.0, 1.1, 1.2, 1.3, 1.4])


def test_history_right_after_a_cell_holds_everything_it_logged(clean, hub):
    """No waiting: history() has the workers send what is buffered and waits for it, where
    the periodic flush would leave up to half a second of rows on the way."""
    name = unique("loss")
    clean.run(f"import monarch_nb\nfor i in range(30):\n    monarch_nb.log(step=i, {name}=i)")
    history = hub.history()
    for rank in (0, 1):
        assert [row.step for row in history[rank] if name in row.values] == list(range(30))


def test_history_catches_up_on_a_thread_that_runs_an_event_loop(clean, hub):
    """ipykernel 7 runs a cell's code inside the asyncio loop of the kernel's main thread."""
    name = unique("loss")
    clean.run(f"import monarch_nb\nfor i in range(30):\n    monarch_nb.log(step=i, {name}=i)")

    async def cell():
        return hub.history()

    history = asyncio.run(cell())
    for rank in (0, 1):
        assert [row.step for row in history[rank] if name in row.values] == list(range(30))


def test_step_defaults_to_previous_plus_one(clean, hub):
    name = unique("acc")
    clean.run(
        f"from monarch_nb import log\nlog(step=7, {name}=1)\nlog({name}=2)\nlog({name}=3)",
        stream=False,
    )
    rows = wait_for(
        lambda: (
            (r := [x for x in hub.history().get(0, []) if name in x.values]) and len(r) == 3 and r
        )
    )
    assert [(r.step, r.values[name]) for r in rows] == [(7, 1), (8, 2), (9, 3)]


def test_non_numeric_value_names_the_key(clean, hub):
    with pytest.raises(CellError) as info:
        clean.run("from monarch_nb import log\nlog(step=1, loss=0.5, note='hi')")
    for err in info.value.errors.values():
        assert err.ename == "TypeError"
        assert "note" in err.evalue and "str" in err.evalue and "\n" not in err.evalue


def test_telemetry_samples_flow_for_every_rank(ctl, hub):
    # installing again keeps the hub and sets the workers' sampling up anew, at the new rate
    try:
        assert metrics.install(ctl.client, hz=4) is hub
        assert ctl.call(_worker_hz).values() == [4.0] * ctl.world_size
    finally:
        metrics.install(ctl.client)
    assert ctl.call(_worker_hz).values() == [telemetry.resolve_hz()] * ctl.world_size
    since = time.time()
    fresh = wait_for(
        lambda: all(
            [s for s in hub.samples(r) if s["time"] > since] for r in range(ctl.world_size)
        ),
        what="samples newer than now",
    )
    assert fresh
    for rank in range(ctl.world_size):
        sample = hub.samples(rank)[-1]
        assert tuple(sample) == FIELDS and sample["rank"] == rank and sample["kind"] == "cpu"
        assert sample["rss"] > 0
    table = metrics.format_latest(hub.latest())
    assert table.splitlines()[0].split()[:3] == ["rank", "host", "step"]
    assert len(table.splitlines()) == 1 + ctl.world_size


def _worker_hz(engine):
    return engine.worker.extensions[on_worker.EXTENSION].hz


SPIN_IN_A_THREAD = """
import threading, time
def spin():
    end = time.time() + 3
    while time.time() < end:
        pass
threading.Thread(target=spin, daemon=True).start()
"""


def test_idle_ranks_are_sampled_seldom_and_busy_ones_at_the_full_rate(clean, hub):
    """Every IDLE_EVERY seconds while nothing runs (issue 24: an idle worker's CPU); at the
    full rate while a cell runs, even one that waits, and while a thread a cell left computes."""

    def counts(t0, t1):
        return [
            len([s for s in hub.samples(r) if t0 <= s["time"] < t1])
            for r in range(clean.world_size)
        ]

    time.sleep(1)  # what ran before has ended
    t0 = time.time()
    time.sleep(4)
    idle = counts(t0, time.time())
    t1 = time.time()
    clean.run("import time\ntime.sleep(3)", quiet=True)
    t2 = time.time()
    clean.run(SPIN_IN_A_THREAD, quiet=True)  # returns at once
    time.sleep(3)
    t3 = time.time()
    hub.catch_up()
    waiting, computing = counts(t1 + 0.6, t2), counts(t2 + 1.2, t3)
    # One reading in 4 s at IDLE_EVERY = 5 s, and on a loaded machine up to two more when the
    # worker's own work (Dask's heartbeat, a thread an earlier test's library left) passes
    # BUSY_CPU for half a second; 2 Hz would be 8
    assert all(n <= 3 for n in idle), idle
    assert all(n >= 3 for n in waiting), waiting  # 2 Hz for 2.4 s
    assert all(n >= 2 for n in computing), computing  # 2 Hz for 1.8 s


def test_scheduler_snapshot_is_json(ctl, hub):
    name = unique("gnorm")
    ctl.run(f"import monarch_nb\nmonarch_nb.log({name}=float('nan'), ok=1.5)", quiet=True)
    snap = wait_for(
        lambda: (
            (s := hub.scheduler_snapshot())
            and all(name in r["values"] for r in s["ranks"] if r["rank"] is not None)
            and s
        )
    )
    text = json.dumps(snap, allow_nan=False)  # NaN would not be JSON
    back = json.loads(text)
    assert [r["rank"] for r in back["ranks"]] == list(range(ctl.world_size))
    for r in back["ranks"]:
        assert r["values"][name] is None and r["values"]["ok"] == 1.5
        assert r["samples"] and set(r["samples"][-1]) == set(FIELDS)
    # the controller keeps the real value
    wait_for(lambda: name in hub.latest()[0]["values"])
    assert math.isnan(hub.latest()[0]["values"][name])


def test_store_stays_bounded_under_a_flood(ctl, hub):
    """10,000 log() calls a second on each rank for 5 s: few messages, bounded stores, and
    every call accounted for as a row or as thinned out."""
    keep = 500
    hub.set_limits(scalar_rows=keep)
    batches = []
    unsubscribe = hub.subscribe(batches.append)
    name = unique("flood")
    try:
        before = {r: rs.messages for r, rs in hub.store.ranks.items()}
        start = time.monotonic()
        mesh = ctl.run(
            "import time\nfrom monarch_nb import log\n"
            "t0, n = time.monotonic(), 0\n"
            "while time.monotonic() - t0 < 5.0:\n"
            "    while n < (time.monotonic() - t0) * 10_000:\n"
            f"        log({name}=n * 0.5)\n"
            "        n += 1\n"
            "    time.sleep(0.001)\n"
            "n",
            quiet=True,
        )
        calls = dict(mesh.items())
        last = {r: n - 1 for r, n in calls.items()}
        wait_for(
            lambda: (
                all(hub.latest().get(r, {}).get("values", {}).get(name) for r in last)
                and all(hub.latest()[r]["values"][name] == n * 0.5 for r, n in last.items())
            ),
            what="the last row of the flood",
        )
        window = time.monotonic() - start
        for rank in calls:
            mine = [b for b in batches if b["rank"] == rank and b["scalars"]]
            mine = [b for b in mine if name in b["scalars"][0][2]]
            rows = sum(len(b["scalars"]) for b in mine)
            dropped = sum(b["dropped"] for b in mine)
            assert rows + dropped == calls[rank]  # every call is a row or counted as thinned
            assert max(len(b["scalars"]) for b in mine) <= on_worker.MAX_ROWS_PER_FLUSH + 1
            sent = hub.store.ranks[rank].messages - before.get(rank, 0)
            assert sent <= (window + 1) / on_worker.FLUSH_INTERVAL  # batched, not one per call
            assert len(hub.store.ranks[rank].scalars) == keep  # full, and no fuller
        snap = hub.scheduler_snapshot()
        for r in snap["ranks"]:
            assert len(r["scalars"]) <= keep
            assert len(r["samples"]) <= metrics.SAMPLE_ROWS
        assert [len(r["scalars"]) for r in snap["ranks"] if r["rank"] in calls] == [keep] * len(
            calls
        )
        broker = ctl.client.run_on_scheduler(_broker_length)
        assert broker <= metrics_store.BROKER_KEEP
        rate = min(calls.values()) / 5.0
        print(f"flood: {rate:,.0f} log() calls/s per rank, {len(batches)} batches")
    finally:
        unsubscribe()
        hub.set_limits(scalar_rows=metrics.SCALAR_ROWS)


def _broker_length(dask_scheduler=None):
    return len(dask_scheduler._broker._topics[metrics.TOPIC].events)


# -- without a cluster ---------------------------------------------------------------------------
def test_outside_a_cluster_warns_once_and_does_nothing(monkeypatch, recorder):
    # Even where a worker shares this process, the notebook's main thread is not a rank.
    monkeypatch.setattr(on_worker, "_warned_outside", False)
    with pytest.warns(UserWarning, match="outside a cluster worker"):
        monarch_nb.log(step=1, loss=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        on_worker.log(step=2, loss=0.25)
        on_worker.log(loss="not even checked here")
    assert recorder.drain() is None


class FakeWorker:
    name = 0

    def __init__(self):
        self.extensions = {}
        self.events = []

    def log_event(self, topic, msg):
        self.events.append((topic, msg))


@pytest.fixture
def recorder(monkeypatch):
    rec = on_worker.Recorder(FakeWorker(), hz=0, flush_interval=0.5, max_rows=8)
    monkeypatch.setattr(on_worker, "_recorders", [rec])
    return rec


def off_main(fn):
    """Run ``fn`` in another thread, as a worker's cell would be; re-raise what it raises."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_values_are_checked(recorder):
    off_main(
        lambda: on_worker.log(step=3, a=1, b=2.5, c=True, d=torch.tensor([4.0]), e=np.int64(5))
    )
    with pytest.raises(TypeError, match=r"^log\(\): loss must be a number, got str"):
        off_main(lambda: on_worker.log(loss="high"))
    with pytest.raises(TypeError, match=r"z must be a number or a one-element tensor.*\(3,\)"):
        off_main(lambda: on_worker.log(z=torch.ones(3)))
    with pytest.raises(TypeError, match="w must be a number, got complex"):
        off_main(lambda: on_worker.log(w=1j))
    with pytest.raises(TypeError, match="step must be an integer"):
        off_main(lambda: on_worker.log(step=1.5, a=1))
    msg = recorder.drain()
    assert msg["scalars"] == [
        (3, msg["scalars"][0][1], {"a": 1, "b": 2.5, "c": 1, "d": 4.0, "e": 5})
    ]
    assert all(type(v) in (int, float) for v in msg["scalars"][0][2].values())


def test_fast_logging_is_thinned_evenly_and_bounded(recorder):
    off_main(lambda: [on_worker.log(x=i) for i in range(1000)])
    msg = recorder.drain()
    steps = [s for s, _, _ in msg["scalars"]]
    assert len(steps) <= 9 and steps == sorted(steps)
    assert steps[-1] == 999  # the newest value always goes out
    assert steps[0] < 300  # the kept rows span the interval, not only its end
    assert len(steps) + msg["dropped"] == 1000
    assert recorder.drain() is None
    off_main(lambda: on_worker.log(x=1))
    assert [s for s, _, _ in recorder.drain()["scalars"]] == [1000]


def test_flush_sends_one_event_per_batch(recorder):
    recorder._add_sample({"time": 1.0})
    off_main(lambda: [on_worker.log(step=i, y=i) for i in range(5)])
    recorder.flush()
    recorder.flush()  # nothing new: nothing sent
    [(topic, msg)] = recorder.worker.events
    assert topic == metrics.TOPIC
    assert msg["rank"] == 0 and msg["worker"] == "0" and len(msg["scalars"]) == 5
    assert msg["samples"] == [{"time": 1.0}] and msg["dropped"] == 0


def test_the_first_row_after_a_flush_asks_for_the_next_and_an_idle_loop_sleeps(monkeypatch):
    """No flush wakes an idle worker's event loop; a row (or a reading) has one sent
    FLUSH_INTERVAL later, with everything that came meanwhile."""
    import asyncio

    from tornado.ioloop import IOLoop

    box, ready = {}, threading.Event()

    def run():
        asyncio.set_event_loop(asyncio.new_event_loop())
        box["loop"] = IOLoop.current()
        ready.set()
        box["loop"].start()

    threading.Thread(target=run, daemon=True).start()
    ready.wait(5)
    worker = FakeWorker()
    worker.loop = box["loop"]
    rec = on_worker.Recorder(worker, hz=0, flush_interval=0.3, max_rows=8)
    flushes = []
    flush = rec.flush
    rec.flush = lambda: flushes.append(time.monotonic()) or flush()
    monkeypatch.setattr(on_worker, "_recorders", [])
    started = threading.Event()
    worker.loop.add_callback(lambda: (rec.start(), started.set()))  # as a plugin's setup runs
    assert started.wait(5)  # the one recorder of this process
    try:
        time.sleep(0.8)
        assert flushes == [] and worker.events == []
        t0 = time.monotonic()
        off_main(lambda: [on_worker.log(step=i, y=i) for i in range(5)])
        assert wait_for(lambda: worker.events, timeout=5)
        assert time.monotonic() - t0 >= 0.25
        rec._add_sample({"time": 1.0})
        assert wait_for(lambda: len(worker.events) == 2, timeout=5)
        time.sleep(0.8)
        assert len(flushes) == 2 and len(worker.events) == 2
        first, second = (msg for _, msg in worker.events)
        assert [row[0] for row in first["scalars"]] == [0, 1, 2, 3, 4]
        assert second["samples"] == [{"time": 1.0}] and second["scalars"] == []
    finally:
        rec.close()
        worker.loop.add_callback(worker.loop.stop)


def test_store_is_bounded_whatever_the_rate():
    store = metrics_store.Store(scalar_rows=100, sample_rows=10)
    for i in range(2000):
        store.add(
            {
                "rank": i % 3,
                "worker": str(i % 3),
                "host": "h",
                "scalars": [[i, float(i), {f"n{i % 1000}": i}]],
                "samples": [{"time": float(i)}],
                "dropped": 1,
            }
        )
    for rs in store.ranks.values():
        assert len(rs.scalars) == 100 and len(rs.samples) == 10
        assert len(rs.values) == metrics_store.MAX_NAMES  # names are capped too
        assert rs.rows == rs.dropped == rs.messages
    assert store.snapshot(since=1990.0)["ranks"][0]["scalars"][-1][0] == 1998
    store.resize(scalar_rows=5)
    assert [len(rs.scalars) for rs in store.ranks.values()] == [5, 5, 5]


def test_store_forgets_the_least_recent_rank_beyond_its_limit(monkeypatch):
    monkeypatch.setattr(metrics_store, "MAX_RANKS", 3)
    store = metrics_store.Store()
    for rank in (0, 1, 2, 0, 3, 4):
        store.add({"rank": rank, "scalars": [[1, 1.0, {"x": rank}]]})
    assert sorted(store.ranks) == [0, 3, 4]
    store.add({"rank": None, "worker": "tcp://w:1", "samples": [{"time": 1.0}]})
    assert "worker tcp://w:1" in store.ranks and len(store.ranks) == 3


def test_history_rows_and_pandas(monkeypatch):
    h = metrics.History({0: [metrics.Row(1, 2.0, {"loss": 0.5})], 1: [metrics.Row(1, 2.1, {})]})
    assert h.names() == ["loss"] and h.series("loss") == {0: ([1], [0.5])}
    assert "2 ranks, 2 rows" in repr(h)
    seen = {}
    fake = types.ModuleType("pandas")
    fake.DataFrame = lambda records, columns: seen.update(records=records, columns=columns) or 42
    monkeypatch.setitem(sys.modules, "pandas", fake)
    assert h.to_pandas() == 42
    assert seen["columns"] == ["rank", "step", "time", "loss"]
    assert seen["records"][0] == {"rank": 0, "step": 1, "time": 2.0, "loss": 0.5}
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match="pip install pandas"):
        h.to_pandas()


def test_format_latest_table():
    entries = {
        0: {
            "host": "node1",
            "step": 12,
            "values": {"loss": 0.123456},
            "sample": {
                "kind": "rocm",
                "device": "MI300X",
                "util": 97.0,
                "mem_used": 40 * 2**30,
                "mem_total": 192 * 2**30,
                "power": 612.4,
                "temp": 71.0,
                "cpu": 101.0,
            },
        },
        1: {"host": "node1", "step": None, "values": {}, "sample": None},
    }
    lines = metrics.format_latest(entries).splitlines()
    assert lines[0].split() == [
        "rank", "host", "step", "loss", "device", "util", "mem", "power", "temp", "cpu"
    ]  # fmt: skip
    assert lines[1].split() == [
        "0", "node1", "12", "0.1235", "rocm:", "MI300X", "97%", "40.0G/192.0G", "612W", "71C",
        "101%",
    ]  # fmt: skip
    assert lines[2].split() == ["1", "node1", "-", "-", "-", "-", "-", "-", "-", "-"]
    assert "no metrics yet" in metrics.format_latest({})


# -- last: restarts the shared cluster -------------------------------------------------------------
def test_restart_keeps_telemetry_flowing(ctl, hub):
    ctl.restart()
    after = time.time()
    wait_for(
        lambda: all(
            [s for s in hub.samples(r) if s["time"] > after] for r in range(ctl.world_size)
        ),
        what="samples from the restarted workers",
    )
    name = unique("after_restart")
    ctl.run(f"from monarch_nb import log\nlog(step=1, {name}=rank)", quiet=True)
    wait_for(lambda: all(name in hub.latest()[r]["values"] for r in range(ctl.world_size)))


def test_an_empty_history_says_how_to_fill_it():
    assert repr(metrics.History({})) == (
        "<History: nothing logged yet (log(step=..., loss=...) in a cell logs)>"
    )
    row = metrics.Row(1, 0.0, {"loss": 0.5})
    assert repr(metrics.History({0: [row]})) == "<History: 1 ranks, 1 rows; loss>"
