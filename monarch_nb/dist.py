"""torch.distributed over Dask.

Rank 0 opens a TCPStore on a port the OS picks (so two clusters on one machine never collide and
no MASTER_PORT is left in any environment); every rank then joins the default process group
through that store, each in its own engine thread, at the same time. ``nccl`` on GPU workers
(RCCL on ROCm builds of torch), ``gloo`` on CPU workers, unless the user picks one.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

from .results import CellError

DEFAULT_TIMEOUT = 30.0

_store: dict[str, Any] = {}  # on a worker: the TCPStore rank 0 serves


class DistError(RuntimeError):
    """The process group could not form; the cluster stays usable without it."""


def default_backend(device_kinds: list[str]) -> str:
    return "nccl" if device_kinds and all(k in ("cuda", "rocm") for k in device_kinds) else "gloo"


def master_host(address: str) -> str:
    """The host part of rank 0's worker address: the one address every worker can reach."""
    hostport = address.split("://", 1)[-1]
    host = hostport.rsplit(":", 1)[0]
    return host.strip("[]")


def form_group(ctl, backend: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> str:
    """(Re-)form the default process group over every rank; returns the backend used."""
    kinds = ctl.call(_device_kind).values()
    backend = backend or default_backend(kinds)
    host = master_host(ctl.ranks[0].address)
    try:
        port = ctl.call(_open_store, host, ctl.world_size, timeout, targets=[0]).item(0)
        ctl.call(_join, backend, host, port, timeout)
    except CellError as e:
        ctl.call(_leave)
        first = next(iter(e.errors.values()))
        raise DistError(
            f"the {backend} process group could not form ({e.headline}; rank {first.rank}: "
            f"{first.ename}: {first.evalue}); the cluster is usable without it"
        ) from None
    return backend


def _device_kind(engine) -> str:
    return engine.device_info.get("kind", "cpu")


def _open_store(engine, host: str, world_size: int, timeout: float) -> int:
    import torch.distributed as dist

    _leave(engine)
    # Listen on rank 0's worker address only: a TCPStore left to itself listens on every
    # interface, which would expose the store beyond 127.0.0.1 on a local cluster.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(max(128, world_size))
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    store = dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
        master_listen_fd=sock.detach(),
    )
    _store["master"] = store
    return store.port


def _join(engine, backend: str, host: str, port: int, timeout: float) -> None:
    import torch.distributed as dist

    rank, world_size = engine.identity["rank"], engine.identity["world_size"]
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        store = _store["master"]
    else:
        store = dist.TCPStore(
            host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout)
        )
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
    )


def _leave(engine) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _store.pop("master", None)
