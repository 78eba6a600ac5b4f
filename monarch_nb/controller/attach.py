"""The rank table, and attaching the controller to the ranks' engines: when it starts, after a
restart, and when a nanny replaces a worker that died (the replacement takes the same rank)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import sys
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from monarch_nb.controller import cluster as clusters
from monarch_nb.controller import setup_cells
from monarch_nb.controller import sync as code_sync
from monarch_nb.dispatch import dispatch, gathering, host_relays, relaying
from monarch_nb.dispatch.links import Link, RankInfo, Request
from monarch_nb.dispatch.results import CellError
from monarch_nb.dispatch.setup_wait import wait_for_setup
from monarch_nb.dispatch.targets import format_ranks
from monarch_nb.errors import ClusterError
from monarch_nb.relay import start as relay_start

if TYPE_CHECKING:
    from monarch_nb.controller.controller import Controller

REPLACE_TIMEOUT = 60  # seconds to wait for a nanny to replace a worker that died
RELAY_WITHIN = 15  # seconds for a worker to start its host's relay


def wait_for_workers(ctl: Controller, n: int, timeout: float) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        workers = clusters.workers(ctl.client)
        if len(workers) >= n:
            return workers
        if time.monotonic() > deadline:
            raise ClusterError(f"only {len(workers)} of {n} workers joined within {timeout:.0f} s")
        time.sleep(0.05)


def rank_table(
    workers: Mapping[str, dict], previous: list[RankInfo] | None = None
) -> list[RankInfo]:
    """Ranks in a deterministic order: worker names 0..N-1 where the cluster gave them (a
    local cluster, and across restarts), else sorted by host, then address. The workers of
    ``previous`` that are still there keep their ranks; others follow (``%monarch scale``)."""
    entries = [
        (addr, w.get("name", addr), w.get("host", ""), w.get("local_directory", ""))
        for addr, w in workers.items()
    ]
    kept: list = []
    if previous:
        order = {p.name: p.rank for p in previous}
        if set(order) <= {entry[1] for entry in entries}:
            kept = sorted((e for e in entries if e[1] in order), key=lambda e: order[e[1]])
            entries = [e for e in entries if e[1] not in order]
    names = [entry[1] for entry in entries]
    first = len(kept)
    if sorted(n for n in names if isinstance(n, int)) == list(range(first, first + len(names))):
        entries.sort(key=lambda e: e[1])
    else:
        entries.sort(key=lambda e: (e[2], e[0]))
    return _with_local_ranks(kept + entries)


def _with_local_ranks(entries) -> list[RankInfo]:
    per_host: dict[str, int] = {}
    table = []
    for rank, (addr, name, host, incarnation) in enumerate(entries):
        local = per_host.get(host, 0)
        per_host[host] = local + 1
        table.append(RankInfo(rank, name, addr, host, local, incarnation=incarnation))
    return table


def attach_all(ctl: Controller, workers: Mapping[str, dict]) -> None:
    """A rank per worker (in the order of the ranks before, where the workers are the same),
    each attached."""
    ctl.ranks = rank_table(workers, previous=ctl.ranks or None)
    if not ctl.ranks:
        raise ClusterError("the cluster has no workers; scale it up and connect again")
    ctl._links = {}
    open_links(ctl, ctl.ranks)


def setup_message(info: RankInfo, setup_id: str, world_size: int, widgets: bool, env) -> dict:
    """What asks a newly attached engine to set up as rank ``info`` (its reply ends the
    ``setup_id`` request): its place in the world, whether it shows widgets, its variables."""
    return {
        "op": "setup",
        "id": setup_id,
        "rank": info.rank,
        "world_size": world_size,
        "local_rank": info.local_rank,
        "widgets": widgets,
        "env": env,
    }


def reattach(ctl: Controller) -> None:
    """Attach to the workers a restart brought up, and form the process group again."""
    attach_all(ctl, wait_for_workers(ctl, len(ctl.ranks), timeout=60))
    ctl._detached = False
    ctl._form_group()
    code_sync.resend(ctl, [info.rank for info in ctl.ranks])


def open_links(ctl: Controller, infos: list[RankInfo]) -> None:
    """Attach to the engines of ``infos`` and wait until each has set up its namespace."""
    on_lost = functools.partial(lost, ctl)
    links = {info.rank: Link(info, ctl._router, on_lost) for info in infos}
    ctl._links.update(links)
    setup = Request("setup", list(links))
    ctl._router.add(setup)

    async def open_all():
        args = ctl.client.connection_args
        await asyncio.gather(*(link.open(ctl.id, args) for link in links.values()))
        for link in links.values():
            link.reader = asyncio.ensure_future(link.read_forever())

    try:
        ctl._on_loop(open_all(), timeout=30)
    except (TimeoutError, OSError) as e:
        raise ClusterError(
            f"could not reach the engine of {format_ranks(list(links))}: "
            f"{type(e).__name__}: {e or 'no answer within 30 s'}; %monarch restart starts "
            "fresh workers"
        ) from None
    relaying.join(ctl, list(links.values()))
    start = functools.partial(start_relay, ctl)
    host_relays.join(ctl, list(links.values()), start, ctl._notice_once)
    for link in links.values():
        ctl._reader.add(link)
        link.send(
            setup_message(
                link.info, setup.id, len(ctl.ranks), ctl.comms.shows_widgets(), ctl.rank_env
            )
        )
    outcomes = wait_for_setup(
        setup, lambda ranks: dispatch.submit(ctl, "info", ranks, {"op": "info", "about": setup.id})
    )
    failed = {r: ev for r, ev in outcomes.items() if ev["status"] != "ok"}
    for rank, ev in outcomes.items():
        if rank not in failed and isinstance(ev.get("info"), dict):
            ctl._known[rank] = ev["info"]
            ctl.unanswering.discard(rank)
    if failed:
        rank, ev = next(iter(failed.items()))
        raise ClusterError(f"rank {rank} failed to start its engine: {gathering.why(ev)}")


def start_relay(ctl: Controller, link: Link, token: str) -> dict[str, int]:
    """A relay on ``link``'s host, started by its worker (relay/start.py); TimeoutError where
    the worker does not say within RELAY_WITHIN seconds (a relay started later, that nobody
    connects to, ends by itself)."""
    address = link.info.address
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="monarch-relay-start")
    try:
        started = pool.submit(ctl.client.run, relay_start.start, token, workers=[address])
        return started.result(RELAY_WITHIN)[address]
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"its worker did not start it within {RELAY_WITHIN:g} s") from None
    finally:
        pool.shutdown(wait=False)


def close_links(ctl: Controller) -> None:
    async def close_all():
        await asyncio.gather(
            *(link.close() for link in ctl._links.values()), return_exceptions=True
        )

    with contextlib.suppress(Exception):
        ctl._on_loop(close_all(), timeout=5)
    relaying.close(ctl)
    host_relays.close(ctl)


def lost(ctl: Controller, rank: int, why: str) -> None:
    """On the event loop: rank's worker vanished. Wait for the nanny's replacement."""
    if ctl.closed or ctl._restarting or ctl._detached:
        return
    if ctl.client.status != "running":
        ctl._notice_once(ctl._scheduler_gone())
        return
    info = ctl.ranks[rank]
    ctl._notice(f"rank {rank} on {info.host} lost its worker ({why})")
    threading.Thread(
        target=_replace, args=(ctl, rank), daemon=True, name=f"monarch-replace-{rank}"
    ).start()


def _replace(ctl: Controller, rank: int) -> None:
    old = ctl.ranks[rank]
    if not replace(ctl, rank, old, time.monotonic() + REPLACE_TIMEOUT) and _still_lost(
        ctl, rank, old
    ):
        ctl._notice(
            f"rank {rank}: no replacement worker joined within {REPLACE_TIMEOUT:.0f} s; "
            f"%monarch scale {len(ctl.ranks)} starts one (or %monarch restart: fresh workers "
            "for every rank)"
        )


def replace(
    ctl: Controller, rank: int, old: RankInfo, deadline: float, regroup: bool = True
) -> bool:
    """Attach the worker that takes ``rank``'s place (the same name, another address or
    incarnation: a nanny's restart, a job ``%monarch scale`` submitted again) once it joins,
    before ``deadline``; whether the rank has a worker again (the nanny's waiter and scale's
    may both wait for one rank: either attaches it). ``regroup``: form the process group
    again once it is attached (``scale`` forms it itself, after)."""
    while time.monotonic() < deadline:
        with ctl._replacing:
            if not _still_lost(ctl, rank, old):
                return _taken(ctl, rank, old)
        try:
            workers = clusters.workers(ctl.client)
        except Exception:
            ctl._notice_once(ctl._scheduler_gone())
            return False
        for addr, w in workers.items():
            incarnation = w.get("local_directory", "")
            if w.get("name", addr) != old.name or (addr, incarnation) == (
                old.address,
                old.incarnation,
            ):
                continue
            host = w.get("host", old.host)
            info = RankInfo(rank, old.name, addr, host, old.local_rank, incarnation=incarnation)
            with ctl._replacing:
                if not _still_lost(ctl, rank, old):
                    return _taken(ctl, rank, old)
                ctl.setting_up.add(rank)  # a cell waits until it is set up (wait_set_up)
                ctl.ranks[rank] = info
                try:
                    open_links(ctl, [info])
                except Exception as e:
                    # gone as it attached (killed again, say): the nanny starts another, which
                    # is waited for in its turn, within the same deadline
                    ctl._notice(f"rank {rank}: its replacement could not attach: {e}")
                    ctl.setting_up.discard(rank)
                    info.alive = False
                    old = info
                    continue
            try:
                return _set_up(ctl, rank, info, regroup)
            finally:
                ctl.setting_up.discard(rank)
        time.sleep(0.25)
    return False


def _set_up(ctl: Controller, rank: int, info: RankInfo, regroup: bool) -> bool:
    """The replacement ``info`` of ``rank``, attached: the group formed again with it, the
    code synced and the --setup cells run there again; False if the cluster went down."""
    healing = rank in ctl.healing_ranks  # a fault-tolerant cell takes it back (healing.py)
    if not healing:
        ctl._notice(
            f"rank {rank}: a replacement worker took its place with an "
            "empty namespace (what the old one held is lost)"
        )
    if regroup and ctl.ft is not None and ctl._router.busy():
        # the others train on: formed before the next cell
        ctl.regroup_pending = f"rank {rank} was replaced while a cell ran"
    elif regroup:
        try:
            ctl._form_group()
        except CellError:  # another rank is lost too: formed once it is back
            ctl.regroup_pending = f"rank {rank} was replaced while another was lost"
        except ClusterError:  # the cluster went down meanwhile
            return False
        if ctl.dist_backend:
            ctl._notice(f"the {ctl.dist_backend} process group was formed again")
    code_sync.resend(ctl, [rank])
    ctl.rejoined[rank] = info
    if not healing:
        setup_cells.replay_or_say(ctl, [rank])
    return True


def wait_set_up(ctl: Controller, ranks: list[int]) -> None:
    """Before a cell: a replacement among ``ranks`` that attached but is not set up yet (the
    group forming with it, its --setup cells running again) is waited for, so that the cell
    does not run there without them. Ctrl-C stops waiting; the cell is not sent."""
    waiting = sorted(ctl.setting_up.intersection(ranks))
    if not waiting:
        return
    print(
        f"monarch-nb: waiting for {format_ranks(waiting)} to be set up as a replacement first "
        "(interrupt to stop waiting)",
        file=sys.stderr,
    )
    while ctl.setting_up.intersection(ranks) and not ctl.closed:
        time.sleep(0.05)


def _taken(ctl: Controller, rank: int, old: RankInfo) -> bool:
    """``rank`` has a worker again, which another waiter attached."""
    return (
        not ctl.closed
        and rank < len(ctl.ranks)
        and ctl.ranks[rank] is not old
        and (ctl.ranks[rank].alive)
    )


def _still_lost(ctl: Controller, rank: int, old: RankInfo) -> bool:
    """``rank`` still waits for a replacement of ``old``: the cluster is not down or
    restarting, and ``%monarch scale`` has not taken the rank out (scale.py)."""
    if ctl.closed or ctl._restarting:
        return False
    return rank < len(ctl.ranks) and ctl.ranks[rank] is old
