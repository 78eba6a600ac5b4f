"""Actor classes for tests/actors/test_actors.py (sent to the workers by value)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

from monarch_nb.actors import Actor, context, current_rank, current_size, endpoint
from monarch_nb.actors.worker import current_host


def divide(x):
    return 1 / x


class Counter(Actor):
    def __init__(self, start=0):
        self.n = start
        self.log = []
        self.spawned_at = dict(current_rank())

    @endpoint
    def incr(self, by=1):
        self.n += by
        return self.n

    @endpoint
    def push(self, x):
        self.log.append(x)

    @endpoint
    def pulled(self):
        return list(self.log)

    @endpoint
    def where(self):
        point = current_rank()
        return {
            "point": dict(point),
            "index": point.rank,
            "size": current_size(),
            "cluster_rank": context().actor_instance.cluster_rank,
            "spawned_at": self.spawned_at,
            "pid": os.getpid(),
            "thread": threading.current_thread().name,
        }

    @endpoint
    def fail(self, x):
        return divide(x)

    @endpoint
    def sleep(self, seconds):
        time.sleep(seconds)
        return context().actor_instance.cluster_rank

    @endpoint
    def sleep_by_rank(self, seconds):
        """Rank 0 sleeps, the others answer at once."""
        rank = context().actor_instance.cluster_rank
        if rank == 0:
            time.sleep(seconds)
        return rank

    @endpoint
    def sleep_on(self, rank, seconds):
        """Only ``rank`` sleeps."""
        if context().actor_instance.cluster_rank == rank:
            time.sleep(seconds)
        return rank

    @endpoint
    def generator(self):
        return (i for i in range(3))

    @endpoint
    def worker_only(self):
        return WorkerOnly()

    def helper(self):
        return "not an endpoint"


class Sleeper(Actor):
    @endpoint
    async def nap(self, seconds, tag):
        await asyncio.sleep(seconds)
        return tag

    @endpoint
    def thread_name(self):
        return threading.current_thread().name


class LoopUser(Actor):
    """Sync code that runs an event loop of its own, as a library's sync API might."""

    def __init__(self):
        self.ready = asyncio.run(_double(21))

    @endpoint
    def run_loop(self, x):
        return self.ready, asyncio.run(_double(x))

    @endpoint
    async def on_the_actors_loop(self):
        await asyncio.sleep(0)
        return asyncio.get_running_loop() is asyncio.get_event_loop()


async def _double(x):
    await asyncio.sleep(0)
    return 2 * x


class Broken(Actor):
    def __init__(self, bad_rank):
        if context().actor_instance.cluster_rank == bad_rank:
            raise ValueError("no accelerator on this rank")


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("str() of this exception raises")


class Refuses(Actor):
    """Raises what a careless library might: exceptions whose str() fails, a result whose
    pickling raises KeyboardInterrupt."""

    def __init__(self, in_init=False):
        if in_init:
            raise Unprintable()

    @endpoint
    def unprintable(self):
        raise Unprintable()

    @endpoint
    async def unprintable_async(self):
        raise Unprintable()

    @endpoint
    def interrupting_result(self):
        return InterruptsPickling()


class InterruptsPickling:
    def __reduce__(self):
        raise KeyboardInterrupt("from __reduce__")


class Inner(Actor):
    @endpoint
    def own_mesh(self):
        from monarch_nb.actors import proc_mesh

        return proc_mesh()

    @endpoint
    def _hidden(self):
        return "found"


class Talker(Actor):
    def __init__(self):
        print("ready")

    @endpoint
    def talk(self, n):
        for i in range(n):
            print("line", i)
        print("oops", file=sys.stderr)
        thread = threading.Thread(target=print, args=("from a thread",))
        thread.start()
        thread.join()
        print("unfinished", end="")
        return n


class Pinger(Actor):
    def __init__(self):
        self.seen = []

    def _other(self, peers):
        return peers.slice(gpus=1 - context().actor_instance.rank["gpus"])

    @endpoint
    def pong(self, n):
        self.seen.append(n)
        return (context().actor_instance.cluster_rank, n)

    @endpoint
    def ping(self, peers, n):
        return self._other(peers).pong.call_one(n).get(timeout=10)

    @endpoint
    async def aping(self, peers, n):
        return await self._other(peers).pong.call_one(n)

    @endpoint
    def burst(self, peers, n):
        """n broadcasts to the other actor, then a call; returns what it saw, in order."""
        other = self._other(peers)
        for i in range(n):
            other.pong.broadcast(i)
        other.pong.call_one(n).get(timeout=10)
        return other.history.call_one().get(timeout=10)

    @endpoint
    def history(self):
        return list(self.seen)

    @endpoint
    def ping_dead(self, peers):
        return self._other(peers).pong.call_one(0).get(timeout=10)


class Slow(Actor):
    def __init__(self, seconds):
        if context().actor_instance.cluster_rank == 1:
            time.sleep(seconds)


class Parent(Actor):
    """Spawns a mesh of its own: a Counter on its own rank."""

    def __init__(self, procs):
        self.procs = procs
        self.kids = self._spawn()

    def _spawn(self):
        me = context().actor_instance.rank["gpus"]
        return self.procs.slice(gpus=slice(me, me + 1)).spawn("kids", Counter)

    @endpoint
    def respawn(self):
        """Stops its mesh and spawns another; returns how many meshes it still tracks."""
        self.kids.stop().get(timeout=10)
        self.kids = self._spawn()
        return len(context().actor_instance._children)


class Loud(Actor):
    @endpoint
    def shout(self):
        print("kid speaking")
        raise ValueError("kid failed")


class Relay(Actor):
    """Spawns a mesh of its own whose output and broadcast failures go up to the notebook."""

    def __init__(self, procs):
        me = context().actor_instance.rank["gpus"]
        self.kids = procs.slice(gpus=slice(me, me + 1)).spawn("kids", Loud)

    @endpoint
    def relay(self):
        self.kids.shout.broadcast()


class NotAnActor:
    pass


class WorkerOnly:
    """Pickles on a worker, but cannot be unpickled on the controller."""

    def __reduce__(self):
        return _rebuild_on_a_worker, ()


def _rebuild_on_a_worker():
    if current_host() is None:
        raise ValueError("only a worker can rebuild this")
    return WorkerOnly()


def actors_here() -> list[str]:
    """For ``client.run``: the names of the actors living in this worker process."""
    host = current_host()
    return sorted(runner.name for runner in host.actors.values()) if host else []


def set_torch_device(device, dask_worker=None):
    """For ``client.run``: the device this worker's actors are given; returns the old one."""
    info = dask_worker.extensions["monarch"].device_info
    old = info.get("torch")
    info["torch"] = device
    return old
