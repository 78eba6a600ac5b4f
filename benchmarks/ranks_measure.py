"""One system at one size, measured in this process (bench_ranks.py runs each in a fresh one):
monarch-nb, PyTorch Monarch (torchmonarch) and ipyparallel. Each ``measure_*`` returns a dict of
plain numbers for the driver's table; times in seconds."""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import sys
import threading
import time

MiB = 2**20
PRINT_LINES = 100  # lines the printing cell writes on every rank
BROADCASTS = 1000
BLOB = MiB  # bytes pushed to every rank and pulled from each
STORE_MINUTES = 10.0  # telemetry kept by the controller's store, replayed (see _store_bytes)
LOSS_HZ = 1.0  # a training loop's loss, logged once a second in that replay


def quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50": statistics.median(xs), "p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))]}


# -- the controller's CPU -------------------------------------------------------------------------
def _thread_cpu() -> dict[int, tuple[str, float]]:
    """ident -> (name, CPU seconds) of every live Python thread of this process."""
    out = {}
    for t in threading.enumerate():
        with contextlib.suppress(OSError, OverflowError, TypeError):
            out[t.ident] = (t.name, time.clock_gettime(time.pthread_getcpuclockid(t.ident)))
    return out


def _ours(name: str) -> bool:
    return name == "MainThread" or name.startswith("monarch")


class CpuMeter:
    """CPU seconds between ``start()`` and ``stop()``: of the whole process, and of the
    controller's own threads (the notebook's, the Reader's, its writers'). In a local cluster
    the kernel also holds the scheduler and the nannies, on Dask's threads; what threads that
    came and went used (monarch-post writers) counts as the controller's."""

    def start(self) -> None:
        self.wall, self.proc, self.threads = time.perf_counter(), time.process_time(), _thread_cpu()

    def stop(self) -> dict[str, float]:
        wall, proc, threads = time.perf_counter(), time.process_time(), _thread_cpu()
        dask = sum(
            cpu - self.threads[ident][1]
            for ident, (name, cpu) in threads.items()
            if ident in self.threads and not _ours(name)
        )
        used = proc - self.proc
        return {"wall": wall - self.wall, "process": used, "controller": used - dask}


# -- monarch-nb ----------------------------------------------------------------------------------
class _Lines:
    """stdout during the printing cell: counts the lines shown and when the last one came."""

    def __init__(self):
        self.count, self.last, self.merged = 0, 0.0, 0

    def write(self, text: str) -> int:
        for line in text.splitlines():
            self.count += 1
            self.merged += line.startswith("[ranks ")
        self.last = time.perf_counter()
        return len(text)

    def flush(self) -> None:
        pass


def _printing(ctl, n: int) -> dict[str, float]:
    code = f"for i in range({PRINT_LINES}):\n    print(f'step {{i}} of the loop')"
    sink = _Lines()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sink):
        ctl.run(code, quiet=True)
    return {"print_last_s": sink.last - t0, "print_shown": sink.count, "print_of": n * PRINT_LINES}


def _data(ctl) -> dict[str, float]:
    blob = bytes(BLOB)
    pushes, pulls = [], []
    for _ in range(5):
        t = time.perf_counter()
        ctl.push({"blob": blob})
        pushes.append(time.perf_counter() - t)
        t = time.perf_counter()
        got = ctl.pull("blob")
        pulls.append(time.perf_counter() - t)
        if any(len(v) != BLOB for v in got.values()):
            raise RuntimeError("pull gave back the wrong bytes")
    ctl.run("del blob", quiet=True)
    return {"push_s": statistics.median(pushes), "pull_s": statistics.median(pulls)}


def _actors(ctl) -> dict[str, float]:
    from monarch_nb.actors import Actor, endpoint, proc_mesh

    class Nop(Actor):
        @endpoint
        def nop(self) -> int:
            return 0

    actors = proc_mesh(ctl).spawn("nop", Nop)
    for _ in range(10):
        actors.nop.call().get()
    t = time.perf_counter()
    for _ in range(BROADCASTS):
        actors.nop.broadcast()
    actors.nop.call().get()
    return {"broadcast_s": time.perf_counter() - t}


def _interrupt(ctl) -> dict[str, float]:
    """Ctrl-C (SIGINT to this process, as the kernel's interrupt sends it) one second into a
    cell that keeps every rank's Python busy: the time until ``run`` has returned with every
    rank interrupted."""
    from monarch_nb import CellError

    pressed = []

    def press() -> None:
        time.sleep(1.0)
        pressed.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=press, daemon=True).start()
    try:
        ctl.run("x = 0\nwhile True:\n    x += 1", quiet=True)
    except CellError as e:
        took = time.perf_counter() - pressed[0]
        stopped = sum(err.ename == "KeyboardInterrupt" for err in e.errors.values())
        return {"interrupt_s": took, "interrupted": stopped}
    raise RuntimeError("the busy cell ended without the interrupt")


def _store_bytes(ctl, n: int) -> int:
    """Bytes of the controller's telemetry store after STORE_MINUTES with n ranks: each rank's
    real samples (read from the running cluster's store) replayed at the sampler's rate, and a
    loss logged LOSS_HZ times a second, into a fresh Store of the same bounds (the scheduler's
    store holds the same). Replayed, not waited for: ten minutes per size is an hour a run."""
    from monarch_nb.telemetry import recorder
    from monarch_nb.telemetry.store import Store

    hz = ctl.call(lambda engine: engine.worker.extensions[recorder.EXTENSION].hz).item(0)
    sample = None
    deadline = time.monotonic() + 30
    while sample is None and time.monotonic() < deadline:
        ranks = ctl.metrics.store.sorted()
        sample = next((rs.sample for rs in ranks if rs.sample), None)
        time.sleep(0.2)
    if sample is None:
        raise RuntimeError("no telemetry sample arrived in 30 s")
    store = Store()
    t0 = time.time()
    samples = int(STORE_MINUTES * 60 * hz)
    per_loss = max(1, round(hz / LOSS_HZ))
    for i in range(samples):
        for rank in range(n):
            s = {**sample, "time": t0 + i / hz, "util": float(i % 100)}
            msg = {"rank": rank, "worker": f"w{rank}", "host": "h", "samples": [s]}
            if i % per_loss == 0:
                msg["scalars"] = [[i // per_loss, s["time"], {"loss": 1.0 / (i + 1)}]]
            store.add(msg)
    return _deep_size(store)


def _deep_size(obj, seen: set | None = None) -> int:
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(_deep_size(k, seen) + _deep_size(v, seen) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset)) or type(obj).__name__ == "deque":
        size += sum(_deep_size(x, seen) for x in obj)
    elif hasattr(obj, "__dict__"):
        size += _deep_size(vars(obj), seen)
    return size


def measure_monarch(n: int, cells: int, warmup: int, idle: float) -> dict:
    import psutil

    import monarch_nb

    t0 = time.perf_counter()
    ctl = monarch_nb.up(workers=n, cpu=True)
    try:
        ctl.run("import torch", quiet=True)
        out: dict = {"up_s": time.perf_counter() - t0}
        for _ in range(warmup):
            ctl.run("1", quiet=True)
        me = psutil.Process()
        meter = CpuMeter()
        meter.start()
        time.sleep(idle)
        rest = meter.stop()
        out["idle_cpu"] = rest["process"] / rest["wall"]
        out["idle_rss"] = me.memory_info().rss
        times = []
        relay = psutil.Process(ctl._relay.proc.pid) if ctl._relay is not None else None
        relay_cpu = sum(relay.cpu_times()[:2]) if relay is not None else 0.0
        meter.start()
        for _ in range(cells):
            t = time.perf_counter()
            ctl.run("1", quiet=True)
            times.append(time.perf_counter() - t)
        cpu = meter.stop()
        out.update(quantiles(times))
        out["ctl_cpu"] = cpu["controller"] / cells
        # the request relay (dispatch/relaying.py), a process of its own, from 16 ranks
        relay_cpu = sum(relay.cpu_times()[:2]) - relay_cpu if relay is not None else 0.0
        out["with_relay_cpu"] = out["ctl_cpu"] + relay_cpu / cells
        out["relayed"] = relay is not None
        # the kernel process's CPU per cell beyond what it uses idle in the same time
        out["proc_cpu"] = (cpu["process"] - out["idle_cpu"] * cpu["wall"]) / cells
        out.update(_printing(ctl, n))
        out.update(_data(ctl))
        out.update(_actors(ctl))
        out.update(_interrupt(ctl))
        out["store_bytes"] = _store_bytes(ctl, n)
    finally:
        ctl.down()
    return out


# -- the peers -----------------------------------------------------------------------------------
def measure_torchmonarch(n: int, cells: int, warmup: int) -> dict:
    from monarch.actor import Actor, endpoint, this_host

    class Nop(Actor):
        @endpoint
        def nop(self) -> int:
            return 0

    t0 = time.perf_counter()
    procs = this_host().spawn_procs(per_host={"gpus": n})
    try:
        actors = procs.spawn("nop", Nop)
        actors.nop.call().get()
        out: dict = {"up_s": time.perf_counter() - t0}
        for _ in range(warmup):
            actors.nop.call().get()
        times = []
        for _ in range(cells):
            t = time.perf_counter()
            actors.nop.call().get()
            times.append(time.perf_counter() - t)
        out.update(quantiles(times))
        t = time.perf_counter()
        for _ in range(BROADCASTS):
            actors.nop.broadcast()
        actors.nop.call().get()
        out["broadcast_s"] = time.perf_counter() - t
    finally:
        procs.stop().get()
    return out


def measure_ipyparallel(n: int, cells: int, warmup: int) -> dict:
    import ipyparallel as ipp

    t0 = time.perf_counter()
    cluster = ipp.Cluster(n=n, log_level=40)
    client = cluster.start_and_connect_sync()
    try:
        client.wait_for_engines(n, timeout=300)
        view = client[:]
        view.execute("1", block=True)
        out: dict = {"up_s": time.perf_counter() - t0}
        for _ in range(warmup):
            view.execute("1", block=True)
        times = []
        for _ in range(cells):
            t = time.perf_counter()
            view.execute("1", block=True)  # what %%px does
            times.append(time.perf_counter() - t)
        out.update(quantiles(times))
    finally:
        client.close()
        cluster.stop_cluster_sync()
    return out
