"""The analysis of profiled cells (monarch_nb.telemetry.profile_*) on real torch.profiler traces
of a 3-rank gloo DDP run whose rank 2 sleeps each step, and on a small GPU trace written here
for HolisticTraceAnalysis (this machine has no GPU)."""

from __future__ import annotations

import json
import re
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule

from monarch_nb.telemetry.profile_analysis import analyze
from monarch_nb.telemetry.profile_hta import HTA_SOURCE
from monarch_nb.telemetry.profile_merge import merged
from monarch_nb.telemetry.profile_model import RankTrace
from monarch_nb.telemetry.profile_numbers import CPU_SOURCE
from monarch_nb.telemetry.profile_spans import collective

WORLD = 3
STEPS = 4
SLOW = 2  # the rank that sleeps SLEEP_S in each step
SLEEP_S = 0.03


def _rank(rank: int, world: int, out: Path) -> None:
    before = time.time_ns()
    torch.set_num_threads(1)  # 3 ranks on 2 cores: spinning intra-op threads would swamp the sleep
    # a file store: a free port picked here could be taken by another process before rank 0 binds it
    store = f"file://{out / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model = torch.nn.parallel.DistributedDataParallel(layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 32)

    def profiled(name: str) -> profile:
        return profile(
            activities=[ProfilerActivity.CPU],
            schedule=schedule(wait=0, warmup=0, active=STEPS, repeat=1),
            on_trace_ready=lambda p: p.export_chrome_trace(str(out / f"{name}-{rank}.json")),
        )

    with profiled("rank") as prof:  # as %%monarch --profile runs a cell: steps at optimizer.step
        hook = register_optimizer_step_post_hook(lambda *_: prof.step())
        for _ in range(STEPS):
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            if rank == SLOW:
                time.sleep(SLEEP_S)
            opt.step()
        hook.remove()
    with profiled("once"):  # a cell without an optimizer step: all of it is ProfilerStep#0
        model(x).square().mean().backward()
    (out / f"clock-{rank}.json").write_text(json.dumps([before, time.time_ns()]))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("traces")
    mp.spawn(_rank, args=(WORLD, out), nprocs=WORLD)
    return out


def load(out: Path, name: str = "rank") -> list[RankTrace]:
    return [
        RankTrace(r, "ok", json.loads((out / f"{name}-{r}.json").read_text()), host="vm")
        for r in range(WORLD)
    ]


def rows(analysis) -> dict[int, dict]:
    return {row["rank"]: row for row in analysis.numbers.rows}


def first_bar_us(analysis, rank: int) -> float:
    """The controller's time of the rank's first bar."""
    bars = analysis.timeline.bars
    start = min(s for r, s in zip(bars["rank"], bars["start"], strict=True) if r == rank)
    return analysis.timeline.origin_us + start * 1000


# -- CPU traces ----------------------------------------------------------------------------------
def test_the_sleeping_rank_is_the_straggler(traces):
    a = analyze(load(traces), measured_from=1)
    assert a.numbers.source == CPU_SOURCE
    assert a.numbers.straggler_rank == SLOW
    found = re.fullmatch(
        r"rank 2 is (\d+)% slower per step; the others wait for it in all_reduce",
        a.numbers.straggler,
    )
    assert found and int(found[1]) >= 10, a.numbers.straggler
    assert rows(a)[SLOW]["idle_ms"] >= SLEEP_S * 1000 * 0.9  # the sleep records no op: idle


def test_numbers_add_up_over_the_measured_steps(traces):
    ranks = load(traces)
    a = analyze(ranks, measured_from=1)
    assert sorted(rows(a)) == [0, 1, 2]
    for rt in ranks:
        row = rows(a)[rt.rank]
        durs = {
            e["name"]: e["dur"]
            for e in rt.trace["traceEvents"]
            if e.get("name", "").startswith("ProfilerStep#")
        }
        measured = [durs[f"ProfilerStep#{n}"] for n in (1, 2, 3)]
        assert row["steps"] == 3
        assert row["step_ms"] == pytest.approx(sum(measured) / 3 / 1000)
        assert row["compute_ms"] + row["comm_ms"] + row["idle_ms"] == pytest.approx(row["step_ms"])
        assert row["compute_ms"] > 0 and row["comm_ms"] > 0
        assert 0 <= row["overlap"] <= 1
    assert {row["steps"] for row in analyze(ranks, measured_from=0).numbers.rows} == {4}


def test_warm_up_steps_are_drawn_but_not_counted(traces):
    tl = analyze(load(traces), measured_from=1).timeline
    for rank in range(WORLD):
        mine = [i for i, r in enumerate(tl.steps["rank"]) if r == rank]
        assert [tl.steps["step"][i] for i in mine] == [0, 1, 2, 3]
        assert [tl.steps["warmup"][i] for i in mine] == [True, False, False, False]
        assert all(tl.steps["start"][i] < tl.steps["end"][i] for i in mine)
    assert {0, 1, 2, 3} <= set(tl.bars["step"])
    assert tl.hosts == {0: "vm", 1: "vm", 2: "vm"}
    assert tl.status == {0: "ok", 1: "ok", 2: "ok"}


def test_times_are_the_controllers_clock(traces):
    """baseTimeNanoseconds / 1000 + ts is Unix time: every event lies within the span each
    process measured around its profiling (offsets are 0 on one machine)."""
    ranks = load(traces)
    clocks = {r: json.loads((traces / f"clock-{r}.json").read_text()) for r in range(WORLD)}
    whole = merged(ranks)
    for e in whole["traceEvents"]:
        if e.get("ph") == "X":
            before, after = clocks[e["pid"]]
            at = whole["baseTimeNanoseconds"] / 1000 + e["ts"]
            assert before / 1000 <= at <= at + e["dur"] <= after / 1000, e
    origin = analyze(ranks, measured_from=1).timeline.origin_us
    assert min(c[0] for c in clocks.values()) / 1000 <= origin


def test_an_offset_moves_its_rank_in_the_timeline_and_the_merged_trace(traces):
    ranks = load(traces)
    moved = [replace(rt, offset_ns=5_000_000) if rt.rank == 1 else rt for rt in ranks]
    a, b = analyze(ranks, measured_from=1), analyze(moved, measured_from=1)
    assert first_bar_us(b, 1) - first_bar_us(a, 1) == pytest.approx(5000, abs=1)
    assert first_bar_us(b, 0) - first_bar_us(a, 0) == pytest.approx(0, abs=1)

    def step_1_at(trace: dict, pid: int) -> float:
        (e,) = [
            e
            for e in trace["traceEvents"]
            if e.get("pid") == pid and e.get("name") == "ProfilerStep#1"
        ]
        return trace["baseTimeNanoseconds"] / 1000 + e["ts"]

    m, n = merged(ranks), merged(moved)
    assert step_1_at(n, 1) - step_1_at(m, 1) == pytest.approx(5000, abs=1e-3)
    assert step_1_at(n, 0) - step_1_at(m, 0) == pytest.approx(0, abs=1e-3)


def test_the_merged_trace_has_a_process_per_rank(traces):
    ranks = load(traces)
    m = json.loads(json.dumps(merged(ranks)))
    events = m["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1, 2}
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    assert all(isinstance(e["tid"], int) and e["tid"] < 2**32 for e in events)  # Perfetto's
    for rt in ranks:  # every op, and torch's thread names, still there
        for ph in ("X", "M"):
            was = [e for e in rt.trace["traceEvents"] if e.get("ph") == ph]
            now = [e for e in events if e["pid"] == rt.rank and e.get("ph") == ph]
            if ph == "X":
                assert Counter(e["name"] for e in now) == Counter(e["name"] for e in was)
            else:
                threads = {e["args"]["name"] for e in was if e["name"] == "thread_name"}
                assert threads <= {e["args"]["name"] for e in now if e["name"] == "thread_name"}
    flows = [{e["id"] for e in events if e["pid"] == r and e.get("ph") == "s"} for r in range(3)]
    assert flows[0] and not flows[0] & flows[1] and not flows[1] & flows[2]


def test_bars_stay_under_the_bound(traces):
    ranks = load(traces)
    full = analyze(ranks, measured_from=1).timeline
    kinds = Counter(full.bars["kind"])
    assert full.left_out is None and kinds["compute"] > 50 and kinds["comm"] >= 3 * WORLD
    small = analyze(ranks, measured_from=1, max_bars=50).timeline
    assert len({len(column) for column in small.bars.values()}) == 1
    assert len(small.bars["rank"]) <= 50
    assert re.fullmatch(
        r"To stay under 50 bars, ops less than 50 µs apart are drawn as one bar and [\d,]+ ops "
        r"of [\d.]+ [mµ]s or shorter are left out; the trace files hold them all\.",
        small.left_out,
    ), small.left_out
    # collectives and idle gaps go last: a bound with room for them and 10 more keeps them all
    room = kinds["comm"] + kinds["idle"] + 10
    some = analyze(ranks, measured_from=1, max_bars=room).timeline
    assert len(some.bars["rank"]) == room
    assert Counter(some.bars["kind"]) == {**kinds, "compute": 10}


def test_a_lost_rank_is_listed_without_bars(traces):
    ranks = load(traces)
    ranks[1] = RankTrace(1, "lost", None, host="vm")
    a = analyze(ranks, measured_from=1)
    assert a.timeline.ranks == [0, 1, 2] and a.timeline.status[1] == "lost"
    assert 1 not in a.timeline.bars["rank"] and 1 not in a.timeline.steps["rank"]
    assert set(a.timeline.bars["rank"]) == {0, 2}
    assert sorted(rows(a)) == [0, 2]
    assert "rank 1 left no trace (lost)." in a.numbers.notes
    assert {e["pid"] for e in merged(ranks)["traceEvents"]} == {0, 2}


def test_a_cell_without_an_optimizer_step_still_gets_numbers(traces):
    a = analyze(load(traces, "once"), measured_from=1)
    assert a.timeline.steps["step"] == [0, 0, 0]
    assert a.timeline.steps["warmup"] == [False, False, False]
    for row in a.numbers.rows:
        assert row["steps"] == 1 and row["compute_ms"] > 0
        assert row["compute_ms"] + row["comm_ms"] + row["idle_ms"] == pytest.approx(row["step_ms"])


@pytest.mark.parametrize(
    ("name", "plain"),
    [
        ("gloo:all_reduce", "all_reduce"),
        ("c10d::allreduce_", "all_reduce"),
        ("c10d::_allgather_base_", "all_gather"),
        ("nccl:reduce_scatter", "reduce_scatter"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_reduce"),
        ("ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWorkElem)", "all_gather"),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "send_recv"),
    ],
)
def test_collectives_are_named_plainly(name, plain):
    assert collective(name) == plain


# -- GPU traces (written here) -------------------------------------------------------------------
LATE_US = 2000  # rank 1 reaches each all_reduce this late; rank 0's kernel waits for it
ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def event(cat: str, name: str, pid: int, tid: int, ts: float, dur: float, **args) -> dict:
    """A complete event ("ph": "X") as torch exports it."""
    head = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid}
    return {**head, "ts": ts, "dur": dur, "args": args}


def gpu_trace(rank: int) -> dict:
    """Per step: three 300 µs compute kernels 50 µs apart on stream 7, then the all_reduce
    (300 µs, plus LATE_US on rank 0) and a 100 µs kernel on stream 13 under its start; each
    kernel launched from the CPU (a cudaLaunchKernel with its correlation id)."""
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": 9, "tid": 0, "args": {"name": "python"}},
        {"ph": "M", "name": "process_labels", "pid": 0, "tid": 0, "args": {"labels": "GPU 0"}},
    ]
    t, corr = 1000, 0
    late = LATE_US if rank == 1 else 0
    for step in range(STEPS):
        kernels = [
            ("aten::mm", "void gemm<float>(float*)", 7, 20, 300),
            ("aten::relu", "void relu<float>(float*)", 7, 370, 300),
            ("aten::mm", "void gemm<float>(float*)", 7, 720, 300),
            ("aten::add", "void bias<float>(float*)", 13, 1070 + late, 100),
            ("nccl:all_reduce", ALL_REDUCE, 7, 1070 + late, 300 + LATE_US - late),
        ]
        for i, (op, kernel, stream, at, dur) in enumerate(kernels):
            corr += 1
            on_cpu = t + 20 * i
            events += [
                event("cpu_op", op, 9, 9, on_cpu, 15),
                event("cuda_runtime", "cudaLaunchKernel", 9, 9, on_cpu + 2, 8, correlation=corr),
                event(
                    "kernel",
                    kernel,
                    0,
                    stream,
                    t + at,
                    dur,
                    device=0,
                    stream=stream,
                    correlation=corr,
                ),
            ]
        end = t + 1070 + 300 + LATE_US
        events.append(event("user_annotation", f"ProfilerStep#{step}", 9, 9, t, end + 60 - t))
        t = end + 80
    return {
        "schemaVersion": 1,
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2},
        "baseTimeNanoseconds": 1_700_000_000_000_000_000,
        "traceEvents": events,
    }


@pytest.fixture
def gpu_ranks(tmp_path) -> list[RankTrace]:
    ranks = [RankTrace(r, "ok", gpu_trace(r)) for r in range(2)]
    for rt in ranks:
        (tmp_path / f"rank-{rt.rank}.json").write_text(json.dumps(rt.trace))
    return ranks


def test_gpu_traces_get_hta_numbers(gpu_ranks, tmp_path):
    a = analyze(gpu_ranks, measured_from=1, trace_dir=tmp_path)
    assert a.numbers.source == HTA_SOURCE, a.numbers.notes
    r0, r1 = rows(a)[0], rows(a)[1]
    assert r0["steps"] == r1["steps"] == 3
    # compute: 3 x 300 + 100 µs; communication not hidden: the all_reduce less the 100 µs under
    # it; idle: 3 x 50 µs between kernels, 100 µs between steps (twice in three), LATE_US on 1
    assert r0["compute_ms"] == pytest.approx(1.0) and r1["compute_ms"] == pytest.approx(1.0)
    assert r0["comm_ms"] == pytest.approx((300 + LATE_US - 100) / 1000)
    assert r1["comm_ms"] == pytest.approx(0.2)
    assert r0["idle_ms"] == pytest.approx(0.65 / 3)
    assert r1["idle_ms"] == pytest.approx((0.65 + 3 * LATE_US / 1000) / 3)
    assert r0["overlap"] == pytest.approx(100 / (300 + LATE_US), abs=1e-4)
    assert r1["overlap"] == pytest.approx(1 / 3, abs=1e-4)
    assert r0["step_ms"] == pytest.approx((1070 + 300 + LATE_US + 60) / 1000)
    slower = round(100 * ((1 + r1["idle_ms"]) / (1 + r0["idle_ms"]) - 1))
    assert a.numbers.straggler == (
        f"rank 1 is {slower}% slower per step; the others wait for it in all_reduce"
    )
    assert a.numbers.straggler_rank == 1
    bars = a.timeline.bars
    mine = Counter(
        (r, k, n) for r, k, n in zip(bars["rank"], bars["kind"], bars["name"], strict=True)
    )
    assert mine[(0, "comm", ALL_REDUCE)] == mine[(1, "comm", ALL_REDUCE)] == STEPS
    assert mine[(1, "compute", "void gemm<float>(float*)")] == 2 * STEPS
    late_gaps = [
        d
        for r, k, d in zip(bars["rank"], bars["kind"], bars["dur"], strict=True)
        if (r, k) == (1, "idle") and d >= LATE_US / 1000
    ]
    assert len(late_gaps) == STEPS


def test_without_hta_the_note_says_how_to_get_it(gpu_ranks, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "hta", None)
    a = analyze(gpu_ranks, measured_from=1, trace_dir=tmp_path)
    assert a.numbers.rows == [] and a.numbers.straggler is None
    assert any("pip install HolisticTraceAnalysis" in note for note in a.numbers.notes)
    assert Counter(a.timeline.bars["kind"])["comm"] == 2 * STEPS


def test_gpu_traces_without_files_say_so(gpu_ranks):
    a = analyze(gpu_ranks, measured_from=1)
    assert a.numbers.rows == [] and a.numbers.source == HTA_SOURCE
    assert a.numbers.notes == [
        "HolisticTraceAnalysis reads the trace files (rank-<N>.json); none were written."
    ]


def test_gpu_streams_merge_as_named_threads(gpu_ranks):
    events = merged(gpu_ranks)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert {e["pid"] for e in kernels} == {0, 1}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {names[(e["pid"], e["tid"])] for e in kernels} == {"GPU 0 7", "GPU 0 13"}
    assert all(isinstance(e["tid"], int) and e["tid"] < 2**32 for e in events)
