"""Making a controller: ``up()`` starts a local cluster, ``connect()`` joins a running one.

Either makes the new controller current (unless ``current=False``), so that the magics drive
it. A second one while a cluster is up is refused; the user's mistakes (no scheduler there, a
TLS scheduler without certificates, two addresses at once) are one-line ``ClusterError``s and
leave nothing behind.
"""

from __future__ import annotations

from typing import Any

from . import cluster as clusters
from .controller import ClusterError, Controller, _set_current
from .controller import current as current_controller


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
) -> Controller:
    """Start a local cluster, one worker per visible GPU (or 2 CPU workers), and control it.

    ``dist`` forms a torch.distributed process group over the ranks (``backend`` defaults to
    nccl on GPUs, gloo on CPUs); ``current=False`` leaves the notebook's current cluster alone;
    ``tls`` makes every Dask comm TLS with a temporary certificate (``ctl.client.security``).
    """
    if current:
        _check_not_up()
    plans = clusters.plan_workers(clusters.detect_gpus(), workers=workers, cpu=cpu, threads=threads)
    from distributed import Client

    security = clusters.temporary_security() if tls else None
    cluster = clusters.start_local(plans, threads=threads, security=security)
    try:
        client = Client(cluster, set_as_default=False, security=security)
        ctl = Controller(
            client,
            cluster=cluster,
            owns_cluster=True,
            expected=len(plans),
            dist=dist,
            backend=backend,
        )
    except BaseException:
        cluster.close()
        raise
    if current:
        _set_current(ctl)
    return ctl


def connect(
    address: str | None = None,
    scheduler_file: str | None = None,
    cluster: Any = None,
    timeout: float = 8,
    workers: int | None = None,
    dist: bool = True,
    backend: str | None = None,
    current: bool = True,
    tls: Any = False,
    tls_ca_file: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> Controller:
    """Join a running scheduler (address or scheduler file) or any ``distributed`` cluster object
    (dask-jobqueue, dask-kubernetes, LocalCluster...); ``cluster`` may be ``"module:factory"``.

    A TLS scheduler (``tls://``) is joined with ``tls_ca_file``/``tls_cert``/``tls_key`` (PEM
    files), ``tls=True`` (the certificates in Dask's ``distributed.comm.tls`` config) or
    ``tls=`` a ``distributed.Security``; a cluster object brings its own ``security``.
    """
    if current:
        _check_not_up()
    from distributed import Client, Security

    if sum(x is not None for x in (address, scheduler_file, cluster)) != 1:
        raise ClusterError("connect needs exactly one of ADDRESS, --scheduler-file or --cluster")
    if isinstance(tls, Security):
        security = tls
    else:
        try:
            security = clusters.client_security(bool(tls), tls_ca_file, tls_cert, tls_key)
        except ValueError as e:
            raise ClusterError(str(e)) from None
    needs_tls = (
        "speaks TLS; pass --tls-ca-file, --tls-cert and --tls-key "
        "(or --tls with the certificates in Dask's distributed.comm.tls config)"
    )
    if security is None and str(address).startswith("tls://"):
        raise ClusterError(f"{address} {needs_tls}")
    if isinstance(cluster, str):
        cluster = clusters.load_factory(cluster)
    try:
        if cluster is not None:
            client = Client(cluster, set_as_default=False, timeout=timeout, security=security)
        elif scheduler_file is not None:
            client = Client(
                scheduler_file=scheduler_file,
                set_as_default=False,
                timeout=timeout,
                security=security,
            )
        else:
            client = Client(address, set_as_default=False, timeout=timeout, security=security)
    except OSError as e:
        where = address or scheduler_file or getattr(cluster, "scheduler_address", cluster)
        raise ClusterError(f"cannot reach a Dask scheduler at {where}: {e}") from None
    except RuntimeError as e:  # a plain-TCP address while TLS is required, and the like
        raise ClusterError(f"cannot join the scheduler: {e}") from None
    except TypeError as e:  # a tls:// address (from a scheduler file) without certificates
        if "ssl_context" not in str(e):
            raise
        where = scheduler_file or getattr(cluster, "scheduler_address", cluster)
        raise ClusterError(f"the scheduler of {where} {needs_tls}") from None
    expected = workers
    if expected is None and cluster is not None and getattr(cluster, "worker_spec", None):
        expected = len(cluster.worker_spec)
    try:
        ctl = Controller(
            client,
            cluster=cluster,
            owns_cluster=False,
            expected=expected,
            dist=dist,
            backend=backend,
        )
    except BaseException:
        client.close()
        raise
    if current:
        _set_current(ctl)
    return ctl
