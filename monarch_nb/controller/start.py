"""Making a controller: ``up()`` starts a local cluster, ``connect()`` joins a running one.

Either makes the new controller current (unless ``current=False``), so that the magics drive
it. A second one while a cluster is up, or while another is being made (from another
thread), is refused; the user's mistakes (no scheduler there, a
TLS scheduler without certificates, two addresses at once) are one-line ``ClusterError``s and
leave nothing behind. A cluster that ``up`` started or a ``--cluster module:factory`` made is
owned: ``down`` closes it, and so does a failure before the controller is made.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

from monarch_nb import kept, registry
from monarch_nb.controller import (
    capacity,
    certificates,
    forkserver,
    hosting,
    joining,
    lighthouse,
)
from monarch_nb.controller import cluster as clusters
from monarch_nb.controller import keep as lease
from monarch_nb.controller import mesh as device_mesh
from monarch_nb.dispatch.results import Interrupted
from monarch_nb.errors import ClusterError, set_current
from monarch_nb.errors import current as current_controller
from monarch_nb.rank import session

if TYPE_CHECKING:
    from monarch_nb.controller.controller import Controller

# Held while an up or connect that will be current runs: two at once (threads of the notebook)
# would each find no cluster up and start one, and down would close only the later one.
_making = threading.Lock()


@contextlib.contextmanager
def _only_one(current: bool):
    """Refuse, in one line, to make a current cluster while another is being made."""
    if not current:
        yield
        return
    if not _making.acquire(blocking=False):
        raise ClusterError(
            "another %monarch up or connect is under way in this kernel; "
            "wait for it to finish (then %monarch down first to start another)"
        )
    try:
        _check_not_up()
        yield
    finally:
        _making.release()


def _check_not_up() -> None:
    ctl = current_controller()
    if ctl is not None and not ctl.closed:
        raise ClusterError(
            "a cluster is already up; use %monarch down first "
            "(or %monarch restart for fresh workers)"
        )


def up(
    workers: int | None = None,
    cpu: bool = False,
    threads: int = 1,
    dist: bool = True,
    backend: str | None = None,
    current: bool = True,
    tls: bool = False,
    mesh=None,
    keep=None,
    name: str | None = None,
    ft: bool = False,
) -> Controller:
    """Start a local cluster, one worker per visible GPU (or 2 CPU workers), and control it.

    ``dist`` forms a torch.distributed process group over the ranks (``backend`` defaults to
    ``cpu:gloo,cuda:nccl`` on GPUs, as torch's own default, and gloo on CPUs);
    ``current=False`` leaves the notebook's current cluster alone;
    ``tls`` makes every Dask comm TLS with a temporary certificate (``ctl.client.security``).
    ``mesh`` (``{"dp": 2, "tp": 2}`` or ``"dp=2,tp=2"``): a DeviceMesh named ``mesh`` on every
    rank; without ``workers``, as many workers as the mesh has places.
    ``keep`` (True, or an idle limit: ``"30m"``, ``"2h"``, seconds): a kept cluster, run by a
    process of its own, which outlives this kernel (``ctl.detach()``, then ``attach(name)``
    from any kernel of yours) until no kernel has held it for the idle limit (2 h for True).
    ``ft``: fault-tolerant training through torchft (``monarch_nb.ft``): its Lighthouse starts
    with the cluster, and a cell training with ``ft.steps`` goes on through a lost rank.
    """
    shape = device_mesh.parse(mesh)
    idle = hosting.idle_limit(keep)
    if idle is None and name is not None:
        raise ValueError("--name names a kept cluster: add --keep (keep=True)")
    if ft:
        lighthouse.check_installed()
    asked = device_mesh.text(shape) if shape and workers is None else None  # the mesh's count
    if shape is not None:
        workers = _mesh_workers(shape, workers, dist)
    with _only_one(current):
        if workers is not None and workers > 0:  # before a plan per rank of a size never met
            capacity.check(0, workers, local=True, up=True, mesh=asked)
        plans = clusters.plan_workers(
            clusters.detect_gpus(), workers=workers, cpu=cpu, threads=threads, mesh=asked
        )
        if idle is not None:
            ctl = _up_kept(plans, threads, tls, idle, name, dist, backend, shape, ft)
            if current:
                set_current(ctl)
            return ctl
        security = certificates.temporary_security() if tls else None
        # Started first: the forkserver's imports run while this process imports the rest.
        cluster = _start_local(plans, threads, security)
        beacon = None
        try:
            beacon = lighthouse.Lighthouse() if ft else None
            from distributed import Client

            from monarch_nb.controller.controller import Controller

            client = Client(cluster, set_as_default=False, security=security)
            ctl = Controller(
                client,
                cluster=cluster,
                owns_cluster=True,
                expected=len(plans),
                dist=dist,
                backend=backend,
                mesh=shape,
                ft=beacon,
            )
        except KeyboardInterrupt:
            _stop(cluster, beacon)
            raise Interrupted(_UP_INTERRUPTED) from None
        except BaseException:
            _stop(cluster, beacon)
            raise
        if current:
            set_current(ctl)
        return ctl


_UP_INTERRUPTED = "%monarch up interrupted; its workers were stopped"


def _stop(cluster, beacon) -> None:
    cluster.close()
    clusters.release_forkserver()
    if beacon is not None:
        beacon.close()


def _up_kept(plans, threads, tls, idle, name, dist, backend, shape, ft) -> Controller:
    """``up(keep=...)``: the cluster in a host process of its own (controller/hosting.py),
    which this kernel then attaches to as any other would; with ``ft``, the host runs its
    Lighthouse too."""
    name, claim = hosting.claim_name(name, {e["name"] for e in kept.entries()})
    try:
        if tls:
            certificates.check_temporary()  # the one-line refusal, before the host starts
        host = hosting.Host(plans, threads, tls, idle, name, claim, dist, ft)
    except BaseException:
        kept.release_name(claim, name)  # no host: the name is free, its lock file gone
        raise
    os.close(claim)  # the host holds the name from here, until it exits
    try:
        _import_controller()  # while the host starts its workers
        entry = host.ready()
        ctl = _attach_to(entry, take=False, backend=backend, mesh=shape)
    except KeyboardInterrupt:
        host.stop()
        raise Interrupted(_UP_INTERRUPTED) from None
    except BaseException:
        host.stop()
        raise
    forkserver.release_unclaimed()  # %load_ext's: the host forks the workers
    return ctl


def attach(name: str | None = None, take: bool = False, current: bool = True) -> Controller:
    """Attach to a kept cluster of yours (``up(keep=...)``), by ``name`` or the only one: the
    ranks' namespaces, process group, mesh and actors are as its last kernel left them. One
    kernel holds it at a time; ``take`` detaches the one that does (it is told so)."""
    entries = kept.entries()
    if name is None and len(entries) != 1:
        names = ", ".join(e["name"] for e in entries)
        raise ClusterError(
            f"{len(entries)} kept clusters are running ({names}): name one, %monarch attach NAME"
            if entries
            else "no kept cluster of yours is running here; %monarch up --keep starts one"
        )
    entry = entries[0] if name is None else kept.find(name)
    if isinstance(entry, registry.InvalidEntry):
        raise ClusterError(f"kept cluster {name} is not to be trusted: {entry.reason}")
    if entry is None:
        names = ", ".join(e["name"] for e in entries) or "none"
        raise ClusterError(f"no kept cluster is named {name} (running here: {names})")
    with _only_one(current):
        ctl = _attach_to(entry, take=take, backend=None, mesh=None)
        if current:
            set_current(ctl)
            forkserver.release_unclaimed()
        return ctl


# seconds to reach a kept cluster's scheduler: on this host, it answers in milliseconds
ATTACH_TIMEOUT = 8


def _attach_to(entry: dict, take: bool, backend, mesh) -> Controller:
    """A controller of the kept cluster of ``entry``, once its lease is this kernel's."""
    from distributed import Security

    from monarch_nb.controller import handshake
    from monarch_nb.controller.controller import Controller

    address, security = entry["scheduler_address"], lease.security(entry)
    args = (security or Security()).get_connection_args("client")
    why = handshake.check(address, ATTACH_TIMEOUT, args)
    if why is not None:  # a stopped host, or its port taken by another process
        raise ClusterError(f"cannot attach to kept cluster {entry['name']}: {why}")
    try:
        client = handshake.client(
            address, set_as_default=False, timeout=ATTACH_TIMEOUT, security=security
        )
    except OSError as e:
        raise ClusterError(f"cannot reach kept cluster {entry['name']}: {e}") from None
    try:
        lease.claim(client, entry, take)
        lease.say_busy(client)
        ctl = Controller(
            client,
            cluster=lease.KeptCluster(entry, client),
            owns_cluster=True,
            expected=entry["ranks"],
            dist=entry["dist"],
            backend=backend,
            mesh=mesh,
            kept=entry,
            ft=lighthouse.Kept(entry) if entry.get("ft") else None,
        )
        lease.watch(ctl)
    except BaseException as e:
        with contextlib.suppress(Exception):
            lease.ask(client, entry, "release")
        client.close()
        if isinstance(e, KeyboardInterrupt) and not isinstance(e, Interrupted):
            raise Interrupted(
                f"attaching to {entry['name']} was interrupted; it is left as it was, detached"
            ) from None
        raise
    return ctl


def _mesh_workers(shape: device_mesh.Shape, workers: int | None, dist: bool) -> int:
    """How many workers a mesh asks for, or why it cannot be, before anything starts."""
    if not dist:
        raise ClusterError(
            "a device mesh is built over the torch.distributed process group; leave out "
            "--no-dist (dist=False)"
        )
    if workers is None:
        return math.prod(shape.values())
    device_mesh.check_world(shape, workers)
    return workers


def _import_controller() -> None:
    """Import what ``up`` needs once the workers are up: a tenth of a second, which the
    forkserver's imports (a second or two) hide. The thread that starts the cluster imports it,
    before Dask's scheduler, while the notebook's thread waits for that thread."""
    import distributed  # noqa: F401

    import monarch_nb.controller.controller  # noqa: F401


def _start_local(plans, threads: int, security):
    """``clusters.start_local`` on a thread of its own, so that Ctrl-C while the workers start
    stops them: interrupted in its constructor, a SpecCluster goes on starting them with
    nothing left to close it. The interrupt is raised once they are stopped (a second one
    stops waiting; they are still stopped, in the background)."""
    lock = threading.Lock()
    box: dict[str, Any] = {}
    # Not Thread.join: on Python < 3.13 a join that a signal interrupts marks the thread as
    # ended, and the next join returns at once, while it goes on starting the cluster.
    done = threading.Event()

    def start() -> None:
        try:
            session.block_interrupts()  # the workers start with it: see session.py
            try:
                forkserver.start()  # first: its imports run while this thread imports the rest,
                _import_controller()  # here rather than after the workers are up
                cluster = clusters.start_local(plans, threads=threads, security=security)
            except BaseException as e:
                box["error"] = e
                return
            with lock:
                box["cluster"] = cluster
                abandoned = box.get("abandoned", False)
            if abandoned:
                with contextlib.suppress(Exception):
                    cluster.close()
        finally:
            done.set()

    thread = threading.Thread(target=start, name="monarch-up", daemon=True)
    thread.start()
    try:
        done.wait()
    except KeyboardInterrupt:
        with lock:
            box["abandoned"] = True
            cluster = box.get("cluster")
        print("monarch-nb: interrupted; stopping the workers being started", file=sys.stderr)
        if cluster is not None:
            with contextlib.suppress(Exception):
                cluster.close()
        done.wait()
        clusters.release_forkserver()
        raise Interrupted(_UP_INTERRUPTED) from None
    if "error" in box:
        clusters.release_forkserver()
        raise box["error"]
    return box["cluster"]


# A batch queue (SLURM, PBS...) may hold the jobs of a dask-jobqueue cluster for minutes.
DEFAULT_WAIT = 600
_NEEDS_TLS = (
    "speaks TLS; pass --tls-ca-file, --tls-cert and --tls-key "
    "(or --tls with the certificates in Dask's distributed.comm.tls config)"
)


def connect(
    address: str | None = None,
    scheduler_file: str | None = None,
    cluster: Any = None,
    timeout: float = 8,
    workers: int | None = None,
    wait: float = DEFAULT_WAIT,
    dist: bool = True,
    backend: str | None = None,
    current: bool = True,
    tls: Any = False,
    tls_ca_file: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    mesh=None,
    ft: bool = False,
) -> Controller:
    """Join a running scheduler (address or scheduler file) or any ``distributed`` cluster object
    (dask-jobqueue, dask-kubernetes, LocalCluster...); ``cluster`` may be ``"module:factory"``.

    A TLS scheduler (``tls://``) is joined with ``tls_ca_file``/``tls_cert``/``tls_key`` (PEM
    files), ``tls=True`` (the certificates in Dask's ``distributed.comm.tls`` config) or
    ``tls=`` a ``distributed.Security``; a cluster object brings its own ``security``.

    ``timeout`` bounds reaching the scheduler; ``wait`` bounds waiting for ``workers`` workers
    (by default those of the cluster object, else one) to join, as jobs wait in a batch queue.
    A cluster made by ``"module:factory"`` belongs to the controller: ``down()`` closes it.
    ``mesh``: as ``up``'s; its size must be the number of workers that join.
    ``ft``: as ``up``'s; the Lighthouse runs beside this kernel, which the ranks must reach.
    """
    shape = device_mesh.parse(mesh)
    if ft:
        lighthouse.check_installed()
    if shape is not None and workers is not None:
        _mesh_workers(shape, workers, dist)
    with _only_one(current):
        from distributed import Security

        if sum(x is not None for x in (address, scheduler_file, cluster)) != 1:
            raise ClusterError(
                "connect needs exactly one of ADDRESS, --scheduler-file or --cluster"
            )
        if isinstance(tls, Security):
            security = tls
        else:
            try:
                security = certificates.client_security(bool(tls), tls_ca_file, tls_cert, tls_key)
            except ValueError as e:
                raise ClusterError(str(e)) from None
        if security is None and str(address).startswith("tls://"):
            raise ClusterError(f"{address} {_NEEDS_TLS}")
        owns = isinstance(cluster, str)
        if owns:
            cluster = clusters.load_factory(cluster)
        from monarch_nb.controller.controller import Controller

        with _closed_on_error(cluster if owns else None):
            client = _client(address, scheduler_file, cluster, timeout, security)
            expected = workers
            if expected is None and cluster is not None and getattr(cluster, "worker_spec", None):
                expected = len(cluster.worker_spec)
            beacon = None
            try:
                joining.wait_for_workers(client, expected or 1, wait, cluster)
                beacon = lighthouse.Lighthouse() if ft else None
                ctl = Controller(
                    client,
                    cluster=cluster,
                    owns_cluster=owns,
                    expected=expected,
                    dist=dist,
                    backend=backend,
                    mesh=shape,
                    ft=beacon,
                )
            except BaseException:
                client.close()
                if beacon is not None:
                    beacon.close()
                raise
        if current:
            set_current(ctl)
            forkserver.release_unclaimed()  # %load_ext's, warm for an up that will not come
        return ctl


@contextlib.contextmanager
def _closed_on_error(cluster):
    """Close ``cluster`` (when not None) if the block fails, Ctrl-C included."""
    try:
        yield
    except BaseException:
        if cluster is not None:
            with contextlib.suppress(Exception):
                cluster.close()
        raise


def _client(address, scheduler_file, cluster, timeout, security):
    """A Dask client of the scheduler, or a one-line ClusterError saying why not. An address
    (or a scheduler file's) shakes hands first (handshake.py): within ``timeout``, and with a
    Dask scheduler, not the dashboard or an SSH server."""
    from distributed import Security

    from monarch_nb.controller import handshake

    handshake.bound_dask_handshakes()  # a cluster object's scheduler is not checked first
    reach = address if scheduler_file is None else _file_address(scheduler_file)
    if reach is not None and cluster is None:
        args = (security or Security()).get_connection_args("client")
        why = handshake.check(reach, timeout, args)
        if why is not None:
            raise ClusterError(why)
    try:
        if cluster is not None:
            return handshake.client(
                cluster, set_as_default=False, timeout=timeout, security=security
            )
        if scheduler_file is not None:
            return handshake.client(
                scheduler_file=scheduler_file,
                set_as_default=False,
                timeout=timeout,
                security=security,
            )
        return handshake.client(address, set_as_default=False, timeout=timeout, security=security)
    except OSError as e:
        where = address or scheduler_file or getattr(cluster, "scheduler_address", cluster)
        raise ClusterError(f"cannot reach a Dask scheduler at {where}: {e}") from None
    except RuntimeError as e:  # a plain-TCP address while TLS is required, and the like
        raise ClusterError(f"cannot join the scheduler: {e}") from None
    except TypeError as e:  # a tls:// address (from a scheduler file) without certificates
        if "ssl_context" not in str(e):
            raise
        where = scheduler_file or getattr(cluster, "scheduler_address", cluster)
        raise ClusterError(f"the scheduler of {where} {_NEEDS_TLS}") from None


def _file_address(path: str) -> str | None:
    """The address in a scheduler file, or None where there is none yet (the Client waits for
    it, and says so)."""
    try:
        with open(path) as f:
            address = json.load(f)["address"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return address if isinstance(address, str) else None
