"""PyTorch Monarch's actor API by its own names (monarch_nb.actor) on the shared 2-rank cluster:
process meshes from this_host() and this_proc(), values by mesh point, ProcMesh.stop and
logging_option, explicit response ports, Channel/Port/send, __supervise__ and MeshFailure, and
RDMABuffer over the actors' connections; each bad input in one line."""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time

import cloudpickle
import pytest
import torch
from _wait import wait_for

import monarch_nb
import monarch_nb.actor as monarch_actor
from monarch_nb.actor import (
    Accumulator,
    Actor,
    Channel,
    Extent,
    Future,
    MeshFailure,
    Point,
    Port,
    ValueMesh,
    context,
    current_rank,
    endpoint,
    send,
    this_host,
    this_proc,
)
from monarch_nb.actors.ports import PortClosedError
from monarch_nb.actors.wire import MeshStopped
from monarch_nb.rdma import RDMABuffer

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Where(Actor):
    def __init__(self, tag="w"):
        self.tag = tag
        self.seen = []

    @endpoint
    def where(self):
        return {
            "rank": context().actor_instance.cluster_rank,
            "pid": os.getpid(),
            "point": dict(current_rank()),
            "daemon": threading.current_thread().daemon,
        }

    @endpoint
    def add(self, x):
        self.seen.append(x)
        return len(self.seen)

    @endpoint
    def say(self, text):
        print(f"{self.tag} says {text}")

    @endpoint
    def fail(self):
        raise ValueError(f"{self.tag} failed")

    @endpoint
    def to_port(self, port, value):
        port.send((current_rank().rank, value))

    @endpoint
    def spawn_here(self):
        child = this_proc().spawn("child", Where, "child")
        return child.where.call_one().get()["pid"], os.getpid()

    @endpoint
    def open_channel(self, other):
        port, receiver = Channel.open()
        other.to_port.call(port, "from a worker").get()
        got = [receiver.recv().get(timeout=10) for _ in range(len(other))]
        return sorted(got)


class Engine(Actor):
    """Answers out of order, as getting_started.py's InferenceEngine does."""

    def __init__(self):
        self.waiting = []

    @endpoint(explicit_response_port=True)
    def later(self, port: Port[int], value):
        self.waiting.append((port, value))

    @endpoint
    def answer_all(self):
        for port, value in reversed(self.waiting):
            port.send(value * 10)
        self.waiting.clear()

    @endpoint(explicit_response_port=True)
    def refuse(self, port):
        port.exception(KeyError("no such weights"))

    @endpoint(explicit_response_port=True)
    def twice(self, port):
        port.send(1)
        try:
            port.send(2)
        except PortClosedError as e:
            return str(e)  # a return value is not the answer: the first send was


class Supervisor(Actor):
    def __init__(self, procs, handle):
        self.children = procs.spawn("children", Where, "child")
        self.handle = handle
        self.failures = []

    def __supervise__(self, failure: MeshFailure):
        self.failures.append((failure.mesh_name, str(failure)))
        if self.handle == "raise":
            raise RuntimeError("supervisor gave up")
        return self.handle == "handle"

    @endpoint
    def fail_children(self):
        self.children.fail.broadcast()

    @endpoint
    def failures_seen(self):
        return list(self.failures)


class Server(Actor):
    def __init__(self):
        self.weights = torch.arange(12, dtype=torch.float32)
        self.buffer = RDMABuffer(self.weights.view(torch.uint8).flatten())

    @endpoint
    def buffer_of(self):
        return self.buffer

    @endpoint
    def weights_now(self):
        return self.weights.tolist()


class Reader(Actor):
    @endpoint
    def read(self, server):
        buffer = server.buffer_of.call_one().get()
        local = torch.zeros(12)
        buffer.read_into(local.view(torch.uint8).flatten()).get(timeout=10)
        local += 1
        buffer.write_from(local.view(torch.uint8).flatten()).get(timeout=10)
        return local.tolist(), os.getpid()


@pytest.fixture(scope="module")
def procs(ctl):
    mesh = this_host().spawn_procs(per_host={"gpus": 2})
    yield mesh
    mesh.stop().get(timeout=10)


# -- 1. process meshes, by Monarch's names --------------------------------------------------------
def test_spawn_procs_shapes_the_clusters_own_ranks(ctl, procs):
    assert procs.extent == Extent(["gpus"], [2]) and str(procs.extent) == "{gpus: 2}"
    shaped = this_host().spawn_procs(per_host={"replica": 1, "shard": 2})
    first, second = procs.spawn("first", Where), shaped.spawn("second", Where)
    try:
        by_point = first.where.call().get(timeout=10)
        assert isinstance(by_point, ValueMesh)
        assert [(dict(p), v["rank"]) for p, v in by_point.items()] == [
            ({"gpus": 0}, 0),
            ({"gpus": 1}, 1),
        ]
        assert repr(next(iter(by_point))[0]) == "{'gpus': 0/2}"
        assert by_point.item(gpus=1)["pid"] == second.slice(shard=1).where.call_one().get()["pid"]
        also = second.where.call().get(timeout=10)
        assert str(also).startswith("ValueMesh({replica: 1, shard: 2}):")
        assert [v["point"] for v in also.values()] == [{"replica": 0, "shard": i} for i in (0, 1)]
        assert ctl.world_size == 2  # two meshes on the same two processes
        single = this_host().spawn_procs().spawn("single", Where)
        assert single.where.call_one().get()["rank"] == 0
        total = Accumulator(first.add, 0, lambda a, b: a + b).accumulate(5)
        assert total.get(timeout=10) == 2
    finally:
        for mesh in (first, second):
            mesh.stop().get(timeout=10)


@pytest.mark.parametrize(
    ("per_host", "error", "text"),
    [
        ({"gpus": 0}, ValueError, "per_host['gpus'] is 0: each dimension needs at least 1"),
        ({"gpus": "2"}, TypeError, "per_host['gpus'] must be a whole number, not '2'"),
        ({"2x": 1}, ValueError, "per_host dimension name '2x' must be a name like 'gpus'"),
        ([("gpus", 2)], TypeError, "per_host takes a dict of dimension sizes"),
        (
            {"gpus": 10**7},
            ValueError,
            "spawn_procs(per_host={'gpus': 10000000}) (10000000 processes) is more than this "
            "machine can hold",
        ),
    ],
)
def test_spawn_procs_refuses_a_shape_in_one_line(ctl, per_host, error, text):
    with pytest.raises(error) as info:
        this_host().spawn_procs(per_host)
    assert str(info.value).startswith(text) and "\n" not in str(info.value)
    assert ctl.world_size == 2


def test_this_proc_runs_actors_in_this_process_on_a_daemon_thread(procs, capfd):
    here = this_proc().spawn("here", Where, "local")
    seen = here.where.call_one().get(timeout=10)
    assert seen["pid"] == os.getpid() and seen["daemon"] and seen["rank"] == -1
    here.say.call_one("hello").get(timeout=10)
    assert "local says hello\n" in capfd.readouterr().out  # its own stdout, untagged
    with pytest.raises(TypeError, match=r"lives in this process \(this_proc\(\) of the notebook"):
        pickle.dumps(here)
    remote = procs.spawn("remote", Where)
    child_pid, its_pid = remote.slice(gpus=1).spawn_here.call_one().get(timeout=10)
    assert child_pid == its_pid != os.getpid()  # an actor's this_proc() is its worker
    remote.stop().get(timeout=10)
    here.stop().get(timeout=10)


def test_future_is_importable_from_the_top_level():
    assert monarch_nb.Future is Future is monarch_actor.Future
    assert Future[int] is not None and Port[int] is not None


def test_a_point_is_monarchs():
    point = Point(4, Extent(["x", "y"], [2, 3]))
    assert repr(point) == "{'x': 1/2, 'y': 1/3}" and point.size("y") == 3


# -- ProcMesh.stop and logging_option -------------------------------------------------------------
def test_a_stopped_proc_mesh_refuses_spawn_and_send_in_one_line(ctl):
    mesh = this_host().spawn_procs(per_host={"gpus": 2})
    actors = mesh.spawn("stopping", Where)
    mesh.stop().get(timeout=10)
    with pytest.raises(RuntimeError) as info:
        mesh.spawn("again", Where)
    assert str(info.value) == (
        "this ProcMesh was stopped (ProcMesh.stop(): stopped by client): spawn on a new one "
        "(this_host().spawn_procs(), or proc_mesh())"
    )
    with pytest.raises(
        MeshStopped, match=r"'stopping' was stopped \(its ProcMesh was stopped: stopped by client\)"
    ):
        send(actors.add, (1,), {})
    with pytest.raises(MeshStopped):
        actors.add.call(1).get(timeout=10)
    assert wait_for(lambda: not any(ctl.client.run(_actors_named, "stopping").values()))


def _actors_named(name, dask_worker=None):
    from monarch_nb.actors.here import current_host

    host = current_host()
    return [r.name for r in host.actors.values() if r.name == name] if host else []


def test_logging_option_keeps_or_streams_what_actors_print(procs, capfd):
    import asyncio

    talkers = procs.spawn("talkers", Where, "talker")
    try:
        asyncio.run(procs.logging_option(stream_to_client=False))
        talkers.say.call("quietly").get(timeout=10)
        assert "quietly" not in capfd.readouterr().out
        asyncio.run(procs.logging_option(stream_to_client=True, aggregate_window_sec=3))
        talkers.say.call("aloud").get(timeout=10)
        assert "[talkers rank 1] talker says aloud" in capfd.readouterr().out
        with pytest.raises(ValueError, match="aggregate_window_sec needs stream_to_client=True"):
            asyncio.run(procs.logging_option(stream_to_client=False, aggregate_window_sec=3))
    finally:  # the shared workers' root logger as it was
        asyncio.run(procs.logging_option(stream_to_client=True, level=logging.WARNING))
        talkers.stop().get(timeout=10)


# -- explicit response ports, Channel, Port and send ----------------------------------------------
def test_an_explicit_response_port_answers_out_of_order(procs):
    engine = procs.slice(gpus=1).spawn("engine", Engine)
    try:
        first, second = engine.later.call_one(1), engine.later.call_one(2)
        engine.answer_all.call_one().get(timeout=10)  # answers the second first
        assert (second.get(timeout=10), first.get(timeout=10)) == (20, 10)
        with pytest.raises(monarch_actor.ActorError, match="KeyError: 'no such weights'"):
            engine.refuse.call_one().get(timeout=10)
        assert engine.twice.call_one().get(timeout=10) == 1
    finally:
        engine.stop().get(timeout=10)


def test_channels_ports_and_send(procs):
    actors = procs.spawn("porting", Where)
    try:
        port, receiver = Channel.open()
        port.send("from here")
        assert receiver.recv().get(timeout=10) == "from here"
        actors.to_port.broadcast(port, "hi")  # each actor sends to the notebook's port
        assert sorted(receiver.recv().get(timeout=10) for _ in range(2)) == [(0, "hi"), (1, "hi")]
        ranked_port, ranked = Channel.open_ranked()
        send(actors.add, ("x",), {}, port=ranked_port)  # every actor's answer, to the port
        assert sorted(ranked.recv().get(timeout=10) for _ in range(2)) == [(0, 1), (1, 1)]
        send(actors.add, ("y",), {}, port=ranked_port, selection="choose")
        assert ranked.recv().get(timeout=10)[1] == 2
        send(actors.fail, (), {}, port=port, selection="choose")
        with pytest.raises(ValueError, match="w failed"):
            receiver.recv().get(timeout=10)
        # a worker's actor opens a channel and another worker's actor sends to it
        got = actors.slice(gpus=0).open_channel.call_one(actors.slice(gpus=1)).get(timeout=10)
        assert got == [(0, "from a worker")]
        with pytest.raises(ValueError, match="selection is 'all' or 'choose', not 'some'"):
            send(actors.add, (), {}, selection="some")
        with pytest.raises(TypeError, match="send takes an endpoint of an actor mesh"):
            send(print, (), {})
    finally:
        actors.stop().get(timeout=10)


def test_a_port_whose_receiver_is_gone_says_so(procs, capfd):
    port, receiver = Channel.open()
    receiver.close()
    with pytest.raises(PortClosedError) as info:
        port.send(1)
    assert str(info.value) == (
        "this Port's receiver is gone (its PortReceiver was dropped or closed): open a new "
        "Channel and send to its port"
    )
    actors = procs.spawn("late", Where)
    try:
        actors.slice(gpus=0).to_port.call_one(port, 2).get(timeout=10)
        assert wait_for(lambda: "arrived after its receiver was dropped" in capfd.readouterr().err)
        assert actors.add.call(1).get(timeout=10).item(gpus=0) == 1  # the actors go on
    finally:
        actors.stop().get(timeout=10)


# -- supervision ----------------------------------------------------------------------------------
@pytest.fixture
def hook_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(monarch_actor, "unhandled_fault_hook", calls.append)
    return calls


@pytest.mark.parametrize("handle", ["handle", "pass", "raise"])
def test_supervise_sees_its_meshes_failures_first(procs, hook_calls, handle):
    supervisor = procs.slice(gpus=0).spawn("supervisor", Supervisor, procs.slice(gpus=1), handle)
    try:
        supervisor.fail_children.call_one().get(timeout=10)
        assert wait_for(lambda: supervisor.failures_seen.call_one().get(timeout=10))
        (mesh_name, text), *_ = supervisor.failures_seen.call_one().get(timeout=10)
        assert mesh_name == "children" and "ValueError: child failed" in text
        if handle == "handle":
            time.sleep(0.3)
            assert hook_calls == []
        else:
            assert wait_for(lambda: hook_calls)
            failure = hook_calls[0]
            assert isinstance(failure, MeshFailure) and failure.mesh_name == "supervisor"
            assert "broadcast to Where.fail failed on rank 1: ValueError: child failed" in str(
                failure
            )
            raised = "(and Supervisor.__supervise__ raised RuntimeError: supervisor gave up)"
            assert (raised in str(failure)) == (handle == "raise")
    finally:
        supervisor.stop().get(timeout=10)


def test_an_unhandled_broadcast_failure_reaches_the_hook(procs, hook_calls):
    actors = procs.spawn("failing", Where, "f")
    try:
        actors.fail.broadcast()
        assert wait_for(lambda: len(hook_calls) == 2)
        assert {f.rank for f in hook_calls} == {0, 1}
        assert all(f.mesh_name == "failing" and f.mesh is actors for f in hook_calls)
    finally:
        actors.stop().get(timeout=10)


# -- RDMABuffer over the actors' connections ------------------------------------------------------
def test_rdma_buffer_reads_and_writes_between_actors(procs):
    server = procs.slice(gpus=0).spawn("server", Server)
    reader = procs.slice(gpus=1).spawn("reader", Reader)
    try:
        values, reader_pid = reader.read.call_one(server).get(timeout=20)
        assert values == [float(i + 1) for i in range(12)]
        assert server.weights_now.call_one().get(timeout=10) == values  # written back
        buffer = server.buffer_of.call_one().get(timeout=10)
        assert buffer.size() == 48 and reader_pid != os.getpid()
        into = torch.zeros(12)
        buffer.read_into(into.view(torch.uint8).flatten()).get(timeout=10)  # from the notebook
        assert into.tolist() == values
        with pytest.raises(ValueError) as info:
            buffer.read_into(torch.zeros(3).view(torch.uint8).flatten())
        assert str(info.value) == (
            "read_into's destination holds 12 bytes, and this RDMABuffer has 48: read into a "
            "tensor of at least 48 bytes"
        )
        with pytest.raises(ValueError, match=r"must be 1-D and contiguous, not of shape \(3, 4\)"):
            buffer.read_into(torch.zeros(3, 4))
        buffer.drop().get(timeout=10)
        with pytest.raises(RuntimeError, match="its owner dropped it"):
            buffer.read_into(into.view(torch.uint8).flatten()).get(timeout=10)
    finally:
        server.stop().get(timeout=10)
        reader.stop().get(timeout=10)


def test_rdma_buffer_of_this_process():
    data = torch.arange(4, dtype=torch.uint8)
    buffer = RDMABuffer(data)
    out = torch.zeros(4, dtype=torch.uint8)
    buffer.read_into(out).get(timeout=5)
    assert out.tolist() == [0, 1, 2, 3]
    buffer.write_from(torch.tensor([9, 9], dtype=torch.uint8)).get(timeout=5)
    assert data.tolist() == [9, 9, 2, 3]
    with pytest.raises(ValueError, match="Cannot create RDMABuffer with size 0"):
        RDMABuffer(torch.zeros(0))
