"""Worker side of the actor API: the actors living in this worker process.

Callers (the controller, other workers' actors) attach with a comm to the
``monarch_actors_attach`` handler and keep it; their messages come on a data socket of their own
(transport.py), which the worker's actor I/O thread reads, handing each message to its actor's
own thread. That thread runs an asyncio loop: a sync endpoint runs to completion there (one
message at a time, in arrival order), an ``async def`` endpoint becomes a task on that loop; it
writes each reply itself. The worker's event loop never runs user code, so heartbeats keep
flowing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from typing import Any

import cloudpickle
from distributed import WorkerPlugin
from distributed.comm import CommClosedError
from distributed.core import Status

from monarch_nb.actors import here, inbox, ports, rdma, supervision
from monarch_nb.actors import output as actors_output
from monarch_nb.actors.actor import (
    Context,
    Instance,
    Point,
    _context,
    endpoints_of,
    plain_methods_of,
)
from monarch_nb.actors.here import current_host
from monarch_nb.actors.mailbox import ATTACH, Mailbox
from monarch_nb.actors.output import ActorConsole, ActorOutbox
from monarch_nb.actors.transport import ActorWire, Channel, listen_host, server_ssl_context
from monarch_nb.actors.wire import _OK, _error, _plain_error, _value
from monarch_nb.rank import capture, debugger, leaving

PLUGIN_NAME = "monarch-actors"
RDMA_OPS = frozenset(("rdma_read", "rdma_write", "rdma_drop"))
STOPPED = "the actor was stopped while this call ran"
STOPPED_HERE = "waits in the debugger: %monarch debug --rank {rank} attaches to it"
logger = logging.getLogger("monarch_nb.actors")


def wait_idle(told=None, poll: float = 0.05) -> None:
    """Return once every actor here has run the calls it has (sync endpoints, queued ones and
    ``async def`` ones): a worker leaving the cluster (``%monarch scale``) cuts none off
    mid-way. ``told(actor name)`` is called once, when one keeps it waiting past a second."""
    start = time.monotonic()
    host = current_host()
    for runner in list(host.actors.values()) if host is not None else []:
        done = threading.Event()
        with contextlib.suppress(RuntimeError):  # a stopped actor has nothing left to run
            runner.loop.call_soon_threadsafe(done.set)  # runs after what it has queued
            while runner._thread.is_alive() and not (done.wait(poll) and not runner._tasks):
                if told is not None and time.monotonic() - start > 1:
                    told(runner.name)
                    told = None


class ActorPlugin(WorkerPlugin):
    """Gives each worker an ActorHost and the attach handler. ``keep``: a kept cluster's, whose
    actors outlive the notebook that spawned them, for the next one to take up."""

    name = PLUGIN_NAME

    def __init__(self, keep: bool = False):
        self.keep = keep

    def setup(self, worker) -> None:
        host = current_host()
        if host is None or host.worker is not worker:
            host = ActorHost(worker)
            here.set_host(host)
        host.keep = getattr(self, "keep", False)
        worker.handlers[ATTACH] = host.attach
        if wait_idle not in leaving.waits:  # a worker leaving with %monarch scale waits for them
            leaving.waits.append(wait_idle)


def live(engine=None, caller: str = "") -> list[dict[str, Any]]:
    """The actors built on this worker: what a notebook that attached to a kept cluster
    rebuilds its handles from (actors/recover.py); ``owner`` says whether their spawner is
    gone, is ``caller`` or is another (an actor elsewhere). Run on the rank's thread."""
    found = []
    host = current_host()
    with host.lock if host is not None else contextlib.nullcontext():
        runners = list(host.actors.items()) if host is not None else []
    for mesh_id, runner in runners:
        if runner.actor is None or runner.instance is None:
            continue  # still being built, or failed
        cls, point = type(runner.actor), runner.instance.rank
        found.append(
            {
                "mesh": mesh_id,
                "name": runner.name,
                "pt": point.rank,
                "dims": list(point.extent.items()),
                "info": (cls.__name__, cls._monarch_endpoints, plain_methods_of(cls)),
                "owner": "gone"
                if runner.owner.closed
                else ("caller" if runner.owner.caller == caller else "other"),
            }
        )
    return found


class ActorHost:
    """The actors of this worker process, by mesh id."""

    def __init__(self, worker):
        self.worker = worker
        self.loop = worker.loop.asyncio_loop
        self.actors: dict[str, ActorRunner] = {}
        self.lock = threading.Lock()  # actors, against the I/O thread and the event loop
        self._wire: ActorWire | None = None  # listening from the first caller on
        self._mailbox: Mailbox | None = None
        self._mailbox_lock = threading.Lock()
        self.keep = False  # ActorPlugin's: actors outlive the caller that spawned them

    @property
    def mailbox(self) -> Mailbox:
        """For this worker's actors calling other actors."""
        with self._mailbox_lock:
            if self._mailbox is None:
                self._mailbox = Mailbox(self.loop, self.worker.connection_args, self._unsolicited)
                self._mailbox.death_watchers.append(self._died)
            return self._mailbox

    def _died(self, address: str, cause: str) -> None:
        """A process under a mesh an actor here spawned died: that actor's supervision."""
        for runner in list(self.actors.values()):
            children = runner.instance._children.values() if runner.instance else ()
            for _, report in supervision.deaths(list(children), address, cause):
                supervision.in_actor(runner, report)

    def _unsolicited(self, msg: dict) -> None:
        """What a mesh that an actor here spawned reports (its output, broadcast failures) goes
        on to that actor's own owner, and so up to the notebook; where the spawner is gone, to
        this worker's log."""
        if "port" in msg:  # a value for a Port an actor here opened
            inbox.deliver(msg)
            return
        for runner in list(self.actors.values()):
            if runner.instance is not None and msg.get("mid") in runner.instance._children:
                if "out" in msg or "stopped" in msg:
                    runner.owner.send({**msg, "mid": runner._id})  # the next hop finds its own
                else:  # a failure: the spawner's __supervise__ first
                    supervision.in_actor(runner, msg)
                return
        if "out" in msg:
            actors_output.show(msg)
            return
        if "stopped" in msg:  # said in the output too
            return
        e = msg.get("e", {})
        logger.error(
            "broadcast to %s failed on rank %s: %s: %s",
            msg.get("where"),
            msg.get("r"),
            e.get("ename"),
            e.get("evalue"),
        )

    async def attach(self, comm, caller: str) -> Status:
        """A caller's attach comm: tell it where the data socket listens, then wait for the
        comm's end, the sign that the caller is gone."""
        if self._wire is None:
            worker = self.worker
            self._wire = ActorWire(
                listen_host(worker), server_ssl_context(worker), self._dispatch, self._caller_gone
            )
        channel = self._wire.new_channel(caller, comm)
        try:
            await comm.write({**self._wire.listeners.hello(), "token": self._wire.token})
            while True:
                await comm.read()
        except (CommClosedError, OSError):
            pass
        finally:
            self._wire.close_channel(channel)
            self._caller_gone(channel)
        return Status.dont_reply

    def _caller_gone(self, channel: Channel) -> None:
        """Actors die with the caller that spawned them (a controller that went away), but
        on a kept cluster, where they wait for the next notebook to adopt them."""
        with self.lock:
            channel.closed = True
            if self.keep:
                return
            owned = [(k, r) for k, r in self.actors.items() if r.owner is channel]
            for mesh_id, _ in owned:
                del self.actors[mesh_id]
        for _, runner in owned:
            runner.post(channel, [{"op": "stop"}])

    def forget(self, mesh_id: str, runner: ActorRunner) -> None:
        with self.lock:
            if self.actors.get(mesh_id) is runner:
                del self.actors[mesh_id]

    def _dispatch(self, channel: Channel, msgs: list[dict[str, Any]]) -> None:
        """Messages from a caller, on the actor I/O thread: each actor gets its own in one
        hand-over (a burst of broadcasts wakes its thread once)."""
        per_runner: dict[ActorRunner, list[dict]] = {}
        orphans, for_here = [], []
        with self.lock:
            for msg in msgs:
                op = msg["op"]
                if op == "port" or op in RDMA_OPS:  # for this process, not an actor: below
                    for_here.append(msg)
                    continue
                if op == "spawn":
                    if channel.closed:  # its caller left: nobody could use or stop it
                        continue
                    runner = self.actors[msg["mesh"]] = ActorRunner(self, channel, msg)
                elif op == "adopt":  # a notebook attached to a kept cluster: output to it
                    runner = self.actors.get(msg["mesh"])
                    if runner is not None:
                        if runner.owner.closed:
                            runner.owner = channel
                        taken = runner.owner is channel
                        why = f"{msg['where']}: the actor that spawned it holds it"
                        _reply(channel, channel, msg, _OK if taken else _plain_error(why))
                        continue
                elif op == "stop":
                    runner = self.actors.pop(msg["mesh"], None)
                else:
                    runner = self.actors.get(msg["mesh"])
                if runner is None:
                    orphans.append(msg)
                else:
                    per_runner.setdefault(runner, []).append(msg)
        for runner, mine in per_runner.items():
            runner.post(channel, mine)
        for msg in for_here:
            if msg["op"] == "port":  # a value for a Port opened here
                inbox.deliver(msg)
            else:  # a transfer of memory lent here: answered at once
                channel.send({"id": msg["id"], "r": msg["r"], **rdma.serve(msg)})
        for msg in orphans:
            if msg["op"] == "stop":
                channel.send({"id": msg["id"], "r": msg["r"], "ok": True, "v": None})
            else:
                error = _plain_error(f"{msg['where']}: no such actor here (its mesh was stopped)")
                _reply(channel, channel, msg, error)


class ActorRunner:
    """One actor: its instance and the thread whose asyncio loop runs its endpoints."""

    def __init__(self, host: ActorHost, owner: Channel, spawn: dict[str, Any]):
        self.host = host
        self.owner = owner
        self.name = spawn["name"]
        self.output = ActorOutbox(host.loop, self._send_output)
        self._rank, self._id = spawn["r"], spawn["mesh"]
        self.streaming = True  # what it prints goes to its owner (ProcMesh.logging_option)
        self._set_logging(spawn.get("logging"))
        self.actor: Any = None
        self.endpoints: dict[str, Any] = {}
        self.instance: Instance | None = None
        self.loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task] = set()
        self._thread = threading.Thread(
            target=self._main, name=f"monarch-actor-{self.name}", daemon=True
        )
        self._thread.start()

    def post(self, channel: Channel, msgs: list[dict[str, Any]]) -> None:
        with contextlib.suppress(RuntimeError):  # stopped
            self.loop.call_soon_threadsafe(self._handle_all, channel, msgs)

    def _handle_all(self, channel: Channel, msgs: list[dict[str, Any]]) -> None:
        for msg in msgs:
            self._handle(channel, msg)

    def _send_output(self, events: list[dict]) -> None:
        if self.streaming:
            self.owner.send({"out": events, "r": self._rank, "mesh": self.name, "mid": self._id})
            return
        for event in events:  # kept here: the worker's own log
            if event["ev"] == "stream":
                stream = sys.__stderr__ if event["name"] == "stderr" else sys.__stdout__
                stream.write("".join(f"[{self.name}] {line}\n" for line in event["lines"]))
                stream.flush()

    def _set_logging(self, options: dict | None) -> None:
        if options:
            self.streaming = options["stream"]
            logging.getLogger().setLevel(options["level"])

    def _main(self) -> None:
        if self.host.worker is not None:  # in the caller's own process, prints stay its own
            capture.route_thread(self.output, ActorConsole(self.output))
            debugger.route_stops(self._proc_rank(), self._stopped)
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            for task in self._tasks:
                task.cancel(STOPPED)  # the CancelledError its caller gets says why
            with contextlib.suppress(Exception):
                self.loop.run_until_complete(asyncio.sleep(0))
            self.loop.close()
            self._stop_children()

    def _stop_children(self) -> None:
        """Meshes this actor spawned die with it, as its own would with a controller that went
        away (no one else holds their handles)."""
        children = self.instance._children if self.instance is not None else {}
        for mesh in list(children.values()):
            with contextlib.suppress(RuntimeError):  # this worker is shutting down
                mesh.stop()

    def _handle(self, channel: Channel, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "send":
            self._call(channel, msg)
        elif op == "spawn":
            self._construct(channel, msg)
        elif op == "logging":
            self._set_logging(msg)
            _reply(channel, channel, msg, _OK)
        elif op == "stop":
            if "id" in msg:
                channel.send({"id": msg["id"], "r": msg["r"], "ok": True, "v": None})
            self.loop.stop()

    def _construct(self, channel: Channel, msg: dict[str, Any]) -> None:
        try:
            _use_rank_device(self.host.worker)
            cls = cloudpickle.loads(msg["cls"])
            args, kwargs = cloudpickle.loads(msg["args"])
            self.endpoints = endpoints_of(cls)
            rank = Point(msg["pt"], dict(msg["dims"]))
            self.instance = Instance(self.name, rank, msg["r"])
            token = _context.set(Context(self.instance, rank))
            try:
                actor = cls.__new__(cls)
                with self._plain_code():
                    actor.__init__(*args, **kwargs)
            finally:
                _context.reset(token)
            self.actor = actor
            reply = {"ok": True, "v": None}
        except BaseException as e:
            reply = self._failed(e)
            self.host.forget(msg["mesh"], self)
            self.loop.stop()
        self.output.end_call()
        _reply(channel, channel, msg, reply)

    def _call(self, channel: Channel, msg: dict[str, Any]) -> None:
        ep = self.endpoints.get(msg["ep"])
        token = _context.set(Context(self.instance, Point(msg["pt"], dict(msg["dims"]))))
        try:
            if ep is None:  # the caller checks names; a class changed under the same mesh name
                raise AttributeError(f"{msg['where']} is not an endpoint of this actor")
            args, kwargs = cloudpickle.loads(msg["args"])
            if ep.explicit_port:  # it answers through the port, whenever it likes
                args = (ports.reply_port(channel, msg), *args)
            if ep.is_async:
                task = self.loop.create_task(self._call_async(channel, msg, ep, args, kwargs))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                return
            with self._plain_code():
                value = ep.method(self.actor, *args, **kwargs)
            reply = None if ep.explicit_port else _value(value)
        except BaseException as e:
            reply = self._failed(e)
        finally:
            _context.reset(token)
        self.output.end_call()
        if reply is not None:
            _reply(channel, self.owner, msg, reply)

    @contextlib.contextmanager
    def _plain_code(self):
        """Run ``__init__`` or a sync endpoint as plain code, as Monarch runs them: no running
        event loop shows, so ``asyncio.run`` and libraries that run a loop of their own work
        inside it. The actor's loop cannot move meanwhile anyway: this is its thread."""
        asyncio._set_running_loop(None)
        try:
            yield
        finally:
            asyncio.set_event_loop(self.loop)  # asyncio.run leaves none set
            asyncio._set_running_loop(self.loop)

    async def _call_async(self, channel, msg, ep, args, kwargs) -> None:
        try:
            value = await ep.method(self.actor, *args, **kwargs)
            reply = None if ep.explicit_port else _value(value)
        except BaseException as e:
            reply = self._failed(e)
        self.output.end_call()
        if reply is not None:
            _reply(channel, self.owner, msg, reply)

    def _proc_rank(self) -> int | None:
        """The cluster rank of this worker (a mesh's own ranks may be a slice's)."""
        worker = self.host.worker
        if worker is None:  # the caller's own process (this_proc())
            return None
        return getattr(worker.extensions.get("monarch"), "identity", {}).get("rank")

    def _stopped(self, stop) -> None:
        """An endpoint reached pdb: say so, and tell the caller, whose ``get()`` attaches."""
        rank = self._proc_rank()
        print(STOPPED_HERE.format(rank=rank), file=sys.stderr, flush=True)
        self.owner.send({"stopped": rank, "mid": self._id})

    def _failed(self, exc: BaseException) -> dict[str, Any]:
        """The reply for an exception; its traceback stays on this rank, and the error carries
        where to find it, for ``ActorError.debug``."""
        reply = _error(exc)
        token = debugger.keep_actor_failure(exc, __file__)
        rank = self._proc_rank()
        if token is not None and rank is not None:
            reply["e"]["pm"] = [token, rank]
        return reply


def _reply(channel: Channel, owner: Channel, msg: dict, reply: dict) -> None:
    """Answer a call; a broadcast (no id) only answers failures, to the mesh's owner."""
    if "id" in msg:
        channel.send({"id": msg["id"], "r": msg["r"], **reply})
    elif not reply["ok"]:
        report = {"r": msg["r"], "mid": msg["mesh"], "where": msg["where"], "broadcast": True}
        owner.send({**report, **reply})


def _use_rank_device(worker) -> None:
    """CUDA's current device is per thread: give the actor's thread its rank's GPU. Called by
    ``_construct``, so a failure is the spawn's error rather than a dead thread."""
    engine = worker.extensions.get("monarch") if worker is not None else None
    device = getattr(engine, "device_info", {}).get("torch", "cpu")
    if device.startswith("cuda"):
        import torch

        try:
            torch.cuda.set_device(torch.device(device))
        except Exception as e:
            raise RuntimeError(f"cannot give this actor's thread {device}: {e}") from e
