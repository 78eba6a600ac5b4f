"""A worker's session: its keeper, and its polling threads quieted (issue 24: an idle worker's
CPU), with real processes and the shared cluster's real gloo process group."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import psutil
from _wait import running, wait_for

from monarch_nb.rank import session

CAP_SYS_NICE = 23


def _may_set_others_timer_slack() -> bool:
    with open("/proc/self/status") as f:
        caps = next(line for line in f if line.startswith("CapEff:"))
    return bool(int(caps.split()[1], 16) >> CAP_SYS_NICE & 1)


def test_the_keeper_sleeps_until_the_worker_exits_then_ends_what_it_left():
    # a session leader with a process left in its session, as a worker with a cell's child
    worker = subprocess.Popen(
        ["sh", "-c", "sleep 300 & echo $!; exec sleep 300"],
        start_new_session=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    left = int(worker.stdout.readline())
    keeper = subprocess.Popen([sys.executable, "-S", "-c", session._KEEPER, str(worker.pid)])
    try:
        time.sleep(1)  # started and waiting
        before = psutil.Process(keeper.pid).num_ctx_switches().voluntary
        time.sleep(2)
        woke = psutil.Process(keeper.pid).num_ctx_switches().voluntary - before
        assert woke <= 2, woke  # polling every 0.2 s: 10
        assert running([left]) == [left]
        worker.kill()
        worker.wait()
        assert wait_for(lambda: not running([left]), timeout=10)
        assert keeper.wait(timeout=10) == 0
    finally:
        for p in (worker, keeper):
            p.kill()
            p.wait()
        worker.stdout.close()
        if running([left]):
            psutil.Process(left).kill()


def test_threads_started_under_coarse_timers_inherit_the_slack_and_the_caller_keeps_its_own():
    def own_slack():
        return session._prctl(session._PR_GET_TIMERSLACK)

    mine = own_slack()
    seen = []
    with session.coarse_timers():
        t = threading.Thread(target=lambda: (time.sleep(0.05), seen.append(own_slack())))
        t.start()
    t.join()
    assert seen == [session.INHERITED_SLACK_NS]
    assert own_slack() == mine != session.INHERITED_SLACK_NS


def _gloo_loops(engine) -> dict[int, tuple[int | None, int]]:
    """tid -> (timer slack in ns, or None where not ours to read; voluntary context
    switches) of the gloo loop threads."""
    import os

    from monarch_nb.rank import session

    found = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() not in session.POLLERS:
                continue
        try:
            with open(f"/proc/{tid}/timerslack_ns") as f:
                slack = int(f.read())
        except OSError:
            slack = None
        with open(f"/proc/self/task/{tid}/status") as f:
            line = next(x for x in f if x.startswith("voluntary_ctxt_switches"))
        found[int(tid)] = (slack, int(line.split()[1]))
    return found


def test_the_process_groups_gloo_loop_wakes_seldom_and_still_carries_collectives(clean):
    before = clean.call(_gloo_loops).values()
    assert all(loops for loops in before), before
    if _may_set_others_timer_slack():
        for loops in before:
            assert {slack for slack, _ in loops.values()} == {session.POLLER_SLACK_NS}
    # a 10 ms timeout: 200 wakes in 2 s; with the inherited slack about 65, set: about 20. The
    # quieter of two windows: a burst of another process's (the suite's other half) is not ours.
    # Each loop on its own: a rank holds one per gloo group (a device mesh's groups too), and
    # the groups earlier tests made on the shared cluster add theirs: summed, 93 in one run.
    bound = 60 if _may_set_others_timer_slack() else 120
    for _ in range(2):
        time.sleep(2)
        after = clean.call(_gloo_loops).values()
        woke = [
            max(new[tid][1] - old[tid][1] for tid in old)
            for old, new in zip(before, after, strict=True)
        ]
        if max(woke) < bound:
            break
        before = after
    assert max(woke) < bound, woke
    out = clean.run(
        "import torch, torch.distributed as dist\nt = torch.ones(3) * (rank + 1)\n"
        "dist.all_reduce(t)\nt.tolist()"
    )
    assert out.values() == [[3.0, 3.0, 3.0]] * 2
