"""Monarch-style actors on a real cluster of worker processes: adverbs, ordering, async
endpoints, actors calling actors, errors, slicing, bad input and a worker killed mid-call."""

from __future__ import annotations

import _thread
import os
import pickle
import re
import signal
import threading
import time
import traceback

import _actor_helpers as helpers
import cloudpickle
import pytest
from _wait import wait_for

import monarch_nb
from monarch_nb import errors as controller_errors
from monarch_nb.actors import ActorError, SupervisionError
from monarch_nb.actors import actor as actors_context
from monarch_nb.actors import mesh as actors
from monarch_nb.actors.wire import MAX_SPANS, Future, MeshStopped, _Sources
from monarch_nb.dispatch.results import ValueMesh

cloudpickle.register_pickle_by_value(helpers)


@pytest.fixture(scope="module")
def mesh(ctl):
    return actors.proc_mesh(ctl)


@pytest.fixture
def counters(mesh):
    spawned = mesh.spawn("counters", helpers.Counter, 10)
    yield spawned
    spawned.stop().get(timeout=10)


def test_proc_mesh_has_hosts_and_gpus(mesh, ctl):
    assert mesh.extent == {"hosts": 1, "gpus": 2}
    assert len(mesh) == 2 and mesh.size("gpus") == 2
    assert repr(mesh) == "<ProcMesh hosts=1, gpus=2>"


def test_call_returns_a_value_mesh_by_rank_with_dims(counters):
    result = counters.incr.call(5).get(timeout=10)
    assert isinstance(result, ValueMesh)
    assert result.items() == [(0, 15), (1, 15)]
    assert result.dims == {"hosts": 1, "gpus": 2}
    assert result.item(hosts=0, gpus=1) == 15
    where = counters.where.call().get(timeout=10)
    for rank, info in where.items():
        assert info["cluster_rank"] == rank
        assert info["point"] == {"hosts": 0, "gpus": rank}
        assert info["index"] == rank
        assert info["size"] == {"hosts": 1, "gpus": 2}
        assert info["spawned_at"] == {"hosts": 0, "gpus": rank}
        assert info["thread"].startswith("monarch-actor-counters")
    assert where.item(0)["pid"] != where.item(1)["pid"] != os.getpid()


def test_call_one_and_slicing(counters):
    one = counters.slice(gpus=1)  # an int drops its dimension, as in torchmonarch
    assert one.extent == {"hosts": 1}
    assert one.incr.call_one(1).get(timeout=10) == 11
    info = counters.slice(hosts=0, gpus=1).where.call_one().get(timeout=10)
    assert info["cluster_rank"] == 1 and info["point"] == {} and info["size"] == {}
    dropped = counters.slice(hosts=0)
    assert dropped.extent == {"gpus": 2}
    assert dropped.where.call().get(timeout=10).item(gpus=1)["point"] == {"gpus": 1}
    assert counters.slice(gpus=slice(-1, None)).slice(gpus=0).incr.call_one(0).get(timeout=10) == 11
    assert counters.slice(gpus=-2).incr.call_one(0).get(timeout=10) == 10
    assert counters.slice(gpus=slice(0, 2)).incr.call().get(timeout=10).values() == [11, 12]
    assert counters.slice(gpus=slice(None, None, -1)).where.call().get(timeout=10).ranks == [0, 1]


def test_a_reversed_slice_is_indexed_by_its_own_positions(counters):
    where = counters.slice(gpus=slice(None, None, -1)).where.call().get(timeout=10)
    assert [where.item(gpus=g)["cluster_rank"] for g in (0, 1)] == [1, 0]
    for g in (0, 1):  # the point each actor was sent is the point it is read back at
        assert where.item(hosts=0, gpus=g)["point"] == {"hosts": 0, "gpus": g}
    assert where.ranks == [0, 1]  # still keyed by cluster rank
    permuted = ValueMesh({0: "a", 1: "b", 2: "c", 3: "d"}, {"x": 2, "y": 2}, order=[3, 1, 2, 0])
    assert [permuted.item(x=x, y=y) for x in (0, 1) for y in (0, 1)] == ["d", "b", "c", "a"]
    with pytest.raises(KeyError, match=r"item\(\) needs y= too"):
        permuted.item(x=1)  # not y=0 by default: a guess


def test_choose_picks_the_least_busy_actor(counters):
    first = counters.sleep.choose(0.5)
    second = counters.sleep.choose(0.0)
    assert {first.get(timeout=10), second.get(timeout=10)} == {0, 1}
    picks = [counters.incr.choose(0).get(timeout=10) for _ in range(4)]
    assert picks == [10] * 4  # nothing was in flight: each went to some actor, answered


def test_choose_avoids_an_actor_busy_with_a_call_by_any_answered_adverb(counters):
    box = counters._mailbox
    rank1_done = lambda: (counters._id, 1) not in box.inflight  # noqa: E731

    def picks():
        return [counters.sleep.choose(0).get(timeout=10) for _ in range(4)]

    busy = counters.slice(gpus=0).sleep.call_one(0.6)
    assert picks() == [1] * 4
    busy.get(timeout=10)
    busy = counters.sleep_on.call(0, 0.6)  # rank 1 answers at once, rank 0 stays busy
    assert wait_for(rank1_done)
    assert picks() == [1] * 4
    busy.get(timeout=10)
    first, busy = counters.sleep_on.stream(0, 0.6)
    assert first.get(timeout=10) == 0  # rank 1's answer: rank 0 is still sleeping
    assert picks() == [1] * 4
    busy.get(timeout=10)
    busy = counters.sleep.choose(0.6)
    chosen = picks()
    assert chosen == [chosen[0]] * 4 and chosen[0] != busy.get(timeout=10)
    # Answered calls leave nothing behind in the mailbox.
    assert [key for key in box.inflight if key[0] == counters._id] == []


def test_stream_yields_in_arrival_order(counters):
    futures = list(counters.sleep_by_rank.stream(1.0))
    assert len(futures) == 2
    assert [f.get(timeout=10) for f in futures] == [1, 0]


def test_broadcast_runs_everywhere_and_reports_its_errors(ctl, counters, capsys):
    actors.broadcast_errors(ctl, clear=True)
    assert counters.incr.broadcast(3) is None
    assert counters.incr.call(0).get(timeout=10).values() == [13, 13]
    counters.fail.broadcast(0)
    counters.incr.call(0).get(timeout=10)  # in order after the broadcast on the same comm
    errors = actors.broadcast_errors(ctl, clear=True)
    assert sorted(e.rank for e in errors) == [0, 1]
    assert all(e.ename == "ZeroDivisionError" for e in errors)
    assert any("in divide" in line for line in errors[0].traceback)
    err = capsys.readouterr().err
    assert "broadcast to Counter.fail failed on rank 0: ZeroDivisionError" in err
    assert actors.broadcast_errors(ctl) == []


def test_a_mesh_an_actor_spawned_reports_its_output_and_failures_up_to_the_notebook(
    ctl, mesh, capsys
):
    actors.broadcast_errors(ctl, clear=True)
    relays = mesh.spawn("relays", helpers.Relay, mesh)
    try:
        relays.relay.call().get(timeout=10)
        assert wait_for(lambda: len(actors.broadcast_errors(ctl)) == 2)
    finally:
        relays.stop().get(timeout=10)
    errors = actors.broadcast_errors(ctl, clear=True)
    assert {(e.rank, e.where, e.evalue) for e in errors} == {
        (0, "broadcast to Loud.shout", "kid failed"),
        (1, "broadcast to Loud.shout", "kid failed"),
    }
    out = capsys.readouterr().out.splitlines()
    assert "[kids rank 0] kid speaking" in out and "[kids rank 1] kid speaking" in out


def test_one_thousand_rapid_messages_arrive_in_order(counters):
    for i in range(1000):
        counters.push.broadcast(i)
    futures = [counters.incr.call(1) for _ in range(100)]
    seen = counters.pulled.call().get(timeout=30)
    assert seen.values() == [list(range(1000))] * 2
    assert [f.get(timeout=30).item(0) for f in futures] == list(range(11, 111))


def test_async_endpoints_interleave_and_sync_ones_queue(mesh):
    sleepers = mesh.spawn("sleepers", helpers.Sleeper)
    try:
        slow = sleepers.nap.call(1.5, "slow")
        fast = sleepers.nap.call(0.05, "fast")
        assert fast.get(timeout=10).values() == ["fast", "fast"]
        assert not slow.done()  # sent second, done first: they ran concurrently
        assert slow.get(timeout=10).values() == ["slow", "slow"]
        names = sleepers.thread_name.call().get(timeout=10).values()
        assert all(n.startswith("monarch-actor-sleepers") for n in names)
    finally:
        sleepers.stop().get(timeout=10)


def test_sync_endpoints_run_one_at_a_time(counters):
    start = time.monotonic()
    a = counters.sleep.call(0.3)
    b = counters.sleep.call(0.3)
    a.get(timeout=10)
    b.get(timeout=10)
    assert time.monotonic() - start >= 0.6


def test_sync_code_may_run_an_event_loop_of_its_own(mesh):
    users = mesh.spawn("loop-users", helpers.LoopUser)  # __init__ calls asyncio.run
    try:
        assert users.run_loop.call(5).get(timeout=10).values() == [(42, 10), (42, 10)]
        assert users.on_the_actors_loop.call().get(timeout=10).values() == [True, True]
        assert users.run_loop.call(1).get(timeout=10).values() == [(42, 2), (42, 2)]
    finally:
        users.stop().get(timeout=10)


def test_await_in_a_notebook_cell(shell, cell, ctl, counters):
    controller_errors.set_current(ctl)
    shell.user_ns["counters"] = counters
    value = cell("result = await counters.incr.call(2)\nresult.values()")
    assert value == [12, 12]
    assert cell("await counters.slice(gpus=0).incr.call_one(1)") == 13
    assert cell("import asyncio\nawait asyncio.wait_for(counters.sleep.choose(0), 10)") in (0, 1)


def test_actors_call_actors_through_a_mesh_passed_as_argument(mesh):
    pingers = mesh.spawn("pingers", helpers.Pinger)
    try:
        # Sync endpoints handle one message at a time: rank 0 pings rank 1 (both pinging each
        # other at once would deadlock, as in torchmonarch); async ones can cross.
        assert pingers.slice(gpus=0).ping.call_one(pingers, 7).get(timeout=20) == (1, 7)
        assert pingers.aping.call(pingers, 8).get(timeout=20).to_dict() == {0: (1, 8), 1: (0, 8)}
        seen = pingers.slice(gpus=0).burst.call_one(pingers, 300).get(timeout=30)
        assert seen[-301:] == [*range(300), 300]
    finally:
        pingers.stop().get(timeout=10)


def test_errors_carry_rank_remote_traceback_and_the_exception(counters):
    fut = counters.slice(gpus=1).fail.call_one(0)
    with pytest.raises(ActorError) as info:
        fut.get(timeout=10)
    err = info.value
    assert err.rank == 1 and err.ename == "ZeroDivisionError"
    assert "Counter.fail failed on rank 1: ZeroDivisionError: division by zero" in str(err)
    assert any("in fail" in line for line in err.traceback)
    assert any("in divide" in line for line in err.traceback)
    # cloudpickle sent the helpers as <dynamic-code>; the caller puts file and line back
    assert any("_actor_helpers.py" in line for line in err.traceback)
    assert "    return 1 / x" in err.traceback
    assert not any("actors_worker" in line for line in err.traceback)
    assert isinstance(err.exception, ZeroDivisionError)
    assert err._render_traceback_()[0].startswith("ActorError: Counter.fail failed on rank 1")
    sent = pickle.loads(pickle.dumps(err))  # to another actor, through a Dask future
    assert isinstance(sent.exception, ZeroDivisionError)
    assert (str(sent), sent.rank, sent.where) == (str(err), 1, "Counter.fail")
    with pytest.raises(ActorError, match="rank 0"):  # the lowest failing rank of a call
        counters.fail.call(0).get(timeout=10)
    assert counters.fail.call(2).get(timeout=10).values() == [0.5, 0.5]  # the actor lives on


def test_an_actor_error_whose_exception_cannot_be_pickled_travels_without_it():
    cause = ValueError("holds a lock")
    cause.lock = threading.Lock()
    err = ActorError(0, "host", "ValueError", "holds a lock", ["line"], "A.f", cause)
    sent = pickle.loads(pickle.dumps(err))
    assert sent.exception is None and str(sent) == str(err) and sent.traceback == ["line"]


def test_a_failed_future_raises_with_the_same_traceback_each_time(counters):
    stored = next(iter(counters.slice(gpus=0).fail.stream(0)))  # a stream future keeps its error
    failed = Future.failed("A.f", SupervisionError("m", 0, "tcp://x", "gone"))
    for fut, kind in ((stored, ActorError), (failed, SupervisionError)):
        lengths = []
        for _ in range(3):
            with pytest.raises(kind) as e:
                fut.get(timeout=10)
            lengths.append(len(traceback.extract_tb(e.value.__traceback__)))
        assert lengths == [lengths[0]] * 3


def test_a_class_redefined_in_a_later_cell_shows_its_new_source(mesh, tmp_path):
    spawned = []
    for version, body in (("old", "return 1 / x"), ("new", "return [][x]")):
        cell = tmp_path / f"cell_{version}.py"  # a notebook cell: same names, same lines
        cell.write_text(
            f"class Fragile(Actor):\n    @endpoint\n    def boom(self, x):\n        {body}\n"
        )
        ns = {"__name__": "notebook_cell", "Actor": actors.Actor, "endpoint": actors.endpoint}
        exec(compile(cell.read_text(), str(cell), "exec"), ns)
        spawned.append(mesh.slice(gpus=0).spawn(f"fragile_{version}", ns["Fragile"]))
    try:
        with pytest.raises(ActorError) as e:
            spawned[1].boom.call_one(0).get(timeout=10)
        assert f'  File "{cell}", line 4, in boom' in e.value.traceback  # the last cell
        assert "    return [][x]" in e.value.traceback
    finally:
        for fragile in spawned:
            fragile.stop().get(timeout=10)


def test_sources_keep_only_the_latest_spans_of_a_redefined_function(tmp_path):
    kept = _Sources()
    for i in range(MAX_SPANS + 5):
        cell = str(tmp_path / f"cell_{i}.py")
        body = "class Fragile(Actor):\n    @endpoint\n    def boom(self, x):\n        return x\n"
        ns = {"__name__": "notebook_cell", "Actor": actors.Actor, "endpoint": actors.endpoint}
        exec(compile(body, cell, "exec"), ns)
        kept.remember(ns["Fragile"])
    assert len(kept._spans["boom"]) == MAX_SPANS
    assert kept._spans["boom"][0] == (cell, 2, 4)  # the latest first (from its decorator)


def test_what_actors_print_is_shown_tagged_before_the_reply(mesh, capsys):
    talker = mesh.spawn("talker", helpers.Talker)
    try:
        assert talker.talk.call(2).get(timeout=10).values() == [2, 2]
        out, err = capsys.readouterr()
    finally:
        talker.stop().get(timeout=10)
    for rank in (0, 1):
        tag = f"[talker rank {rank}] "
        mine = [line[len(tag) :] for line in out.splitlines() if line.startswith(tag)]
        assert mine == ["ready", "line 0", "line 1", "from a thread", "unfinished"]
        assert f"{tag}oops" in err.splitlines()


def test_an_unpicklable_return_value_is_an_error_saying_why(counters):
    with pytest.raises(ActorError, match=r"return value \(generator\) cannot be pickled"):
        counters.generator.call().get(timeout=10)


def test_a_return_value_the_caller_cannot_unpickle_names_its_rank(counters):
    with pytest.raises(ActorError) as e:
        counters.worker_only.call().get(timeout=10)
    assert str(e.value) == (
        "Counter.worker_only failed on rank 0: ValueError: the return value cannot be unpickled "
        "by the caller: only a worker can rebuild this"
    )
    assert isinstance(e.value.exception, ValueError)
    errors = [f.exception(timeout=10) for f in counters.worker_only.stream()]
    assert sorted(err.rank for err in errors) == [0, 1]
    assert all(isinstance(err, ActorError) for err in errors)


def test_exceptions_and_results_that_fail_to_render_still_answer_the_call(mesh):
    refuses = mesh.spawn("refuses", helpers.Refuses)
    try:
        for name in ("unprintable", "unprintable_async"):
            with pytest.raises(ActorError, match=r"Unprintable: <str\(\) of the exception raised"):
                getattr(refuses, name).call().get(timeout=10)
        with pytest.raises(ActorError, match=r"\(InterruptsPickling\) cannot be pickled"):
            refuses.interrupting_result.call().get(timeout=10)
        assert refuses.unprintable.choose().exception(timeout=10) is not None
    finally:
        refuses.stop().get(timeout=10)
    with pytest.raises(ActorError, match=r"Refuses.__init__ failed on rank 0: Unprintable"):
        mesh.spawn("refuses", helpers.Refuses, True)


def test_init_errors_are_reported_with_their_rank(mesh):
    with pytest.raises(ActorError, match=r"Broken.__init__ failed on rank 1: ValueError: no acc"):
        mesh.spawn("broken", helpers.Broken, 1)


def test_a_rank_device_that_cannot_be_set_is_a_spawn_error(ctl, mesh):
    rank1 = [ctl.ranks[1].address]
    # torch.device() refuses this name with or without a GPU (CPU torch ignores set_device)
    old = ctl.client.run(helpers.set_torch_device, "cuda:nonesuch", workers=rank1)[rank1[0]]
    try:
        with pytest.raises(ActorError) as e:
            mesh.spawn("nodevice", helpers.Counter)
        assert e.value.args[0] == (
            "Counter.__init__ failed on rank 1: RuntimeError: cannot give this actor's thread "
            "cuda:nonesuch: Invalid device string: 'cuda:nonesuch'"
        )
    finally:
        ctl.client.run(helpers.set_torch_device, old, workers=rank1)
    assert "nodevice" not in actors_running(ctl)


def test_ctrl_c_in_get_says_the_endpoint_goes_on(counters):
    slow = counters.sleep.call(1.5)
    threading.Timer(0.3, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt) as info:
        slow.get(timeout=10)
    assert "stopped waiting for" in str(info.value)
    assert "the endpoint goes on running" in str(info.value)
    assert slow.get(timeout=10).values() == [0, 1]  # the answer still arrives


def test_get_timeout(counters):
    fut = counters.sleep.call(0.5)
    with pytest.raises(TimeoutError, match=r"Counter.sleep did not answer within 0.05 s"):
        fut.get(timeout=0.05)
    assert fut.get(timeout=10).values() == [0, 1]  # a timeout does not cancel


def test_an_async_call_cut_short_by_stop_says_the_actor_was_stopped(mesh):
    sleepers = mesh.spawn("sleepers", helpers.Sleeper)
    nap = sleepers.slice(gpus=0).nap.call_one(30, "late")
    sleepers.thread_name.call().get(timeout=10)  # handled after the nap began
    sleepers.stop().get(timeout=10)
    with pytest.raises(ActorError) as e:
        nap.get(timeout=10)
    assert e.value.args[0] == (
        "Sleeper.nap failed on rank 0: CancelledError: the actor was stopped while this call ran"
    )


def test_stopped_actors_answer_with_an_error(mesh):
    gone = mesh.spawn("gone", helpers.Counter)
    elsewhere = pickle.loads(cloudpickle.dumps(gone))  # a handle that did not see the stop
    gone.stop().get(timeout=10)
    with pytest.raises(MeshStopped) as info:  # the handle that stopped it knows, at once
        gone.slice(gpus=1).incr.call().get(timeout=10)
    assert str(info.value) == (
        "actor mesh 'gone' was stopped (gone.stop(): stopped by client): spawn it again to send "
        "to it"
    )
    with pytest.raises(MeshStopped):
        gone.incr.broadcast()
    with pytest.raises(
        ActorError, match=r"Counter\.incr: no such actor here \(its mesh was stopped\)"
    ):
        elsewhere.incr.call().get(timeout=10)


# -- lifetimes: no actor outlives every handle to it -----------------------------------------------
def actors_running(ctl) -> list[str]:
    """The names of the actors living on the shared cluster's workers."""
    return sorted(name for names in ctl.client.run(helpers.actors_here).values() for name in names)


def test_ctrl_c_during_spawn_stops_the_actors(ctl, mesh):
    main = threading.main_thread().ident
    threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt) as info:
        mesh.spawn("slow", helpers.Slow, 1.5)  # rank 1 is still in __init__ when interrupted
    assert str(info.value) == "spawn of 'slow' interrupted; its actors were stopped"
    assert wait_for(lambda: "slow" not in actors_running(ctl))


def test_stopping_an_actor_stops_the_meshes_it_spawned(ctl, mesh):
    parents = mesh.spawn("parents", helpers.Parent, mesh)
    assert actors_running(ctl).count("kids") == 2
    for _ in range(2):  # a mesh it stopped itself is no longer held
        assert parents.respawn.call().get(timeout=10).values() == [1, 1]
    assert actors_running(ctl).count("kids") == 2
    parents.stop().get(timeout=10)
    assert wait_for(lambda: "kids" not in actors_running(ctl))


# -- bad input: one clear line each ----------------------------------------------------------------
def one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


def test_spawning_something_that_is_not_an_actor(mesh):
    with pytest.raises(TypeError) as e:
        mesh.spawn("bad", helpers.NotAnActor)
    assert "NotAnActor is not one (add Actor to its bases)" in one_line(e)
    with pytest.raises(TypeError, match=r"subclass of monarch_nb\.actors\.Actor"):
        mesh.spawn("bad", 42)
    with pytest.raises(TypeError, match="spawn needs a name"):
        mesh.spawn(helpers.Counter, "counters")


def test_calling_an_undecorated_or_unknown_method(counters):
    with pytest.raises(TypeError) as e:
        counters.helper.call()
    assert one_line(e) == (
        "Counter.helper is not an endpoint; decorate it with @endpoint to call it through a mesh"
    )
    with pytest.raises(AttributeError) as e:
        _ = counters.nonesuch
    assert "Counter has no endpoint 'nonesuch'" in one_line(e)
    with pytest.raises(TypeError) as e:
        counters.incr(1)
    assert "call it with an adverb" in one_line(e)


def test_call_one_on_a_mesh_of_many(counters):
    with pytest.raises(ValueError) as e:
        counters.incr.call_one()
    assert "call_one needs a mesh of exactly one actor; counters has 2" in one_line(e)


def test_slicing_with_an_unknown_dimension_or_out_of_range(counters, mesh):
    with pytest.raises(ValueError) as e:
        counters.slice(nodes=0)
    assert one_line(e) == "cannot slice by 'nodes': this mesh has dimensions hosts=1, gpus=2"
    with pytest.raises(IndexError) as e:
        counters.slice(gpus=2)
    assert one_line(e) == "gpus=2 is out of range 0..1"
    with pytest.raises(IndexError, match="selects nothing"):
        mesh.slice(gpus=slice(5, 9))
    with pytest.raises(TypeError, match="takes an int or a slice"):
        mesh.slice(gpus="0")
    with pytest.raises(ValueError, match="unknown dimension 'gpu'"):
        mesh.size("gpu")


def test_arguments_that_cannot_be_pickled_are_named(counters, mesh):
    lock = threading.Lock()
    with pytest.raises(TypeError) as e:
        counters.push.call((i for i in range(3)), 5, key=lock)
    assert one_line(e) == (
        "cannot send the arguments of Counter.push: argument 0 (generator), "
        "key= (lock) cannot be pickled"
    )
    with pytest.raises(TypeError, match=r"Counter.__init__: argument 0 \(lock\)"):
        mesh.spawn("locked", helpers.Counter, lock)


def test_proc_mesh_without_a_cluster(ctl):
    controller_errors.set_current(None)
    try:
        with pytest.raises(monarch_nb.ClusterError) as e:
            actors.proc_mesh()
        assert "no cluster is up: start one with %monarch up" in one_line(e)
        assert e.value._render_traceback_() == [f"ClusterError: {e.value}"]  # IPython: one line
    finally:
        controller_errors.set_current(ctl)


def test_proc_mesh_inside_an_actor_says_to_pass_one_in_and_underscored_endpoints_work(mesh):
    inner = mesh.spawn("inner", helpers.Inner)
    try:
        with pytest.raises(ActorError, match="inside an actor, spawn on a ProcMesh passed in"):
            inner.own_mesh.call().get(timeout=10)
        assert inner._hidden.call().get(timeout=10).values() == ["found", "found"]
    finally:
        inner.stop().get(timeout=10)


def test_an_endpoint_named_like_a_mesh_attribute_is_refused(counters):
    with pytest.raises(TypeError) as e:

        class Clashing(actors.Actor):
            @actors.endpoint
            def stop(self):
                pass

            @actors.endpoint
            def size(self):
                pass

    assert one_line(e) == (
        "Clashing: endpoints cannot be named 'size', 'stop', which actor meshes use for their "
        "own attributes (mesh.stop() stops the mesh); rename the endpoint"
    )
    assert {n for n in dir(counters) if not n.startswith("_")} == actors_context.MESH_ATTRIBUTES


def test_endpoint_takes_monarchs_options_and_refuses_others():
    for options in ({"propagate": "cached"}, {"propagate": lambda x: x}, {"instrument": False}):
        decorated = actors.endpoint(**options)(lambda self: 1)
        assert isinstance(decorated, actors_context.EndpointProperty)
        assert not decorated.explicit_port
    assert actors.endpoint(explicit_response_port=True)(lambda self, port: 1).explicit_port
    with pytest.raises(TypeError, match="unexpected keyword argument 'retries'"):
        actors.endpoint(retries=3)
    with pytest.raises(TypeError, match="propagate takes a function, not int"):
        actors.endpoint(propagate=3)


# -- supervision: a cluster of our own, one worker killed ------------------------------------------
@pytest.fixture
def own_cluster():
    mine = monarch_nb.up(workers=2, cpu=True, dist=False, current=False)
    try:
        yield mine
    finally:
        mine.down()


def test_a_worker_killed_mid_call_raises_supervision_error(own_cluster, cell):
    mesh = actors.proc_mesh(own_cluster)
    victims = mesh.spawn("victims", helpers.Counter)
    pingers = mesh.spawn("pingers", helpers.Pinger)
    pids = {r: info["pid"] for r, info in victims.where.call().get(timeout=10).items()}
    in_flight = victims.sleep_on.call(1, 60)  # rank 0 answers, rank 1 is busy when killed
    time.sleep(0.3)
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(SupervisionError) as e:
        in_flight.get(timeout=10)
    assert time.monotonic() - killed < 5
    assert e.value.rank == 1 and e.value.mesh == "victims"
    assert "actor mesh 'victims' rank 1 is dead" in str(e.value)
    assert "connection closed" in e.value.cause or "scheduler removed" in e.value.cause
    assert not re.search(r"\d{6}", e.value.cause), e.value.cause  # no Dask event id

    start = time.monotonic()
    with pytest.raises(SupervisionError, match="rank 1 is dead"):
        victims.incr.call().get(timeout=10)
    with pytest.raises(SupervisionError, match="rank 1 is dead"):
        victims.incr.broadcast()
    assert time.monotonic() - start < 0.5  # later calls fail fast
    assert victims.slice(gpus=0).incr.call_one().get(timeout=10) == 1  # rank 0 lives on

    # An actor whose peer died gets the SupervisionError inside its endpoint.
    with pytest.raises(ActorError, match="SupervisionError"):
        pingers.slice(gpus=0).ping_dead.call_one(pingers).get(timeout=10)

    dead = actors.dead_actors(own_cluster)
    assert [(name, rank) for name, rank, _ in dead] == [("pingers", 1), ("victims", 1)]
    assert all(cause for _, _, cause in dead)
    saved = controller_errors.current()
    controller_errors.set_current(own_cluster)
    try:
        cell("%monarch status")
        assert "dead actors:" in cell.out and "victims on rank 1:" in cell.out
    finally:
        controller_errors.set_current(saved)

    # The nanny's replacement takes rank 1; a new mesh spawns on it (the plugin is registered
    # for workers that join later), while the old actors stay dead.
    old = victims._members[1].address
    deadline = time.monotonic() + 60
    while own_cluster.ranks[1].address == old and time.monotonic() < deadline:
        time.sleep(0.2)
    fresh = actors.proc_mesh(own_cluster).spawn("fresh", helpers.Counter, 5)
    assert fresh.incr.call().get(timeout=30).values() == [6, 6]
    with pytest.raises(SupervisionError):
        victims.incr.call().get(timeout=10)


def test_a_mesh_used_after_actors_close_or_its_cluster_down_says_so(own_cluster):
    old = actors.proc_mesh(own_cluster)
    closed = old.spawn("closed", helpers.Counter)
    in_flight = closed.sleep.call(1)
    actors.close(own_cluster)  # the cluster stays up
    cause = r"is dead: the actor system was closed for this controller \(actors.close\(\)\)"
    with pytest.raises(SupervisionError, match=cause):
        in_flight.get(timeout=10)
    for use in (closed.incr.call, lambda: old.spawn("again", helpers.Counter)):
        with pytest.raises(monarch_nb.ClusterError) as e:
            use()
        assert one_line(e) == (
            "the actor system was closed for this controller (actors.close()): its actors are "
            "stopped; spawn them again on a new proc_mesh() to start again"
        )

    procs = actors.proc_mesh(own_cluster)
    counters = procs.spawn("counters", helpers.Counter)
    own_cluster.down()
    uses = [counters.incr.call, counters.incr.broadcast, counters.stop]
    for use in [*uses, lambda: procs.spawn("again", helpers.Counter)]:
        with pytest.raises(monarch_nb.ClusterError) as e:
            use()
        assert one_line(e) == (
            "this mesh's cluster is down: start one with %monarch up, then spawn again on "
            "proc_mesh()"
        )


# -- the notebook ----------------------------------------------------------------------------------
def test_why_the_scheduler_removed_a_worker_is_said_in_words_not_as_dasks_event_id():
    from monarch_nb.actors.caller import removed_because

    said = removed_because("handle-worker-cleanup-1796258544.8449805")
    assert said == "its connection to the scheduler closed"
    assert removed_because("check-worker-ttl-1796258544.5") == (
        "it sent the scheduler no heartbeat for too long"
    )
    assert removed_because("retire-workers-1796258544.5") == (
        "it was retired as the cluster scaled down"
    )
    assert removed_because("a-new-reason-1796258544.5") == "Dask says 'a-new-reason'"
    assert removed_because(None) == removed_because("") == "no reason given"
