"""torchft's pieces as monarch_nb.ft uses them on a rank (rank/ft.py): imported quietly and with
one thread for its Manager's async runtime, its DDP whose gradient hook never raises, its gloo
group whose connections a release can cut, its Optimizer that starts no second quorum in a
step, and a quorum waited for in steps an interrupt can land between."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

from monarch_nb.errors import ClusterError
from monarch_nb.rank import release

# Threads of the async runtime of each torchft server (a rank's Manager; the Lighthouse's,
# controller/lighthouse.py, has one too), where torchft would start one per core: they serve a
# few requests a step. With the ranks already filling the cores it was a little faster: FT-DDP
# at 0.67-0.70x plain DDP's steps/s against 0.62-0.70x, three runs each (bench_ft.py's first
# table, 4 ranks on the 2-core VM).
TOKIO_THREADS = "1"


def await_quorum(manager) -> None:
    """Wait for the step's quorum in steps of 0.1 s: an interrupt (Ctrl-C, another rank's
    failure) lands within one, where torchft's own wait (a lock's) would hold it until the
    quorum's timeout."""
    future = manager._quorum_future
    while future is not None and not future.done():
        with contextlib.suppress(TimeoutError):
            future.result(timeout=0.1)


def own_vote(manager) -> None:
    """A one-rank replica group's ``should_commit`` answered by the rank (``OwnVote``), on the
    torchft versions whose Manager server is known to answer it so (0.2)."""
    from importlib.metadata import version

    if version("torchft").startswith(OWN_VOTE_VERSIONS):
        manager._client = OwnVote(manager._client)


OWN_VOTE_VERSIONS = ("0.2.",)


class OwnVote:
    """A one-rank replica group's Manager client, whose ``should_commit`` is the rank's own
    vote, answered here: torchft's Manager server answers it with the AND of the votes of the
    group's ranks, once all are in (its src/manager.rs), which for one rank is that rank's, a
    round trip to a server in the same process saved each step (FT-DDP's opt.step 1.5 ms
    against 3.7 ms at hidden 1024, 0.3 against 0.9 at 256: bench_ft.py's first table).
    Everything else goes to the server as before."""

    def __init__(self, client):
        self._client = client

    def should_commit(self, group_rank, step, should_commit, timeout=None) -> bool:
        return bool(should_commit)

    def __getattr__(self, name):
        return getattr(self._client, name)


def gloo_group(torchft):
    class ProcessGroupGloo(torchft.ProcessGroupGloo):
        """torchft's gloo group, whose connections are recorded as it forms at each new quorum,
        so that a release cuts them (rank/release.py) as it cuts the cluster's own groups'."""

        def _create_pg(self, store, rank, world_size):
            with release.recorded(ft=True):
                return super()._create_pg(store, rank, world_size)

    return ProcessGroupGloo


def optimizer_class(torchft):
    class Optimizer(torchft.Optimizer):
        """torchft's Optimizer, whose zero_grad starts no second quorum in a step that
        ft.steps started one for."""

        def __init__(self, state, optim):  # ft.py's _Wrapped: the model's and the Manager's
            super().__init__(state.manager, optim)
            self._monarch_state = state

        def zero_grad(self, set_to_none: bool = True) -> None:
            state = self._monarch_state
            if state.quorum_started:
                state.quorum_started = False
                self.optim.zero_grad(set_to_none)
            else:
                super().zero_grad(set_to_none)

        def step(self, closure=None) -> None:
            state = self._monarch_state
            state.quorum_started = False
            state.stepped += 1
            await_quorum(self.manager)
            if state.group is not None:  # a sharded model: its shards averaged across groups
                from monarch_nb.rank import ft_hsdp

                ft_hsdp.sync_grads(self.manager, self.optim)
            super().step(closure)

    return Optimizer


def load():
    """torchft, quietened (its Rust servers log every quorum at INFO, its checkpoint server
    every request), and the DistributedDataParallel this module wraps models in."""
    os.environ.setdefault("RUST_LOG", "warn")
    os.environ.setdefault("TOKIO_WORKER_THREADS", TOKIO_THREADS)
    try:
        import torchft
        from torchft import ddp
    except ImportError as e:
        raise ClusterError(
            f"torchft cannot be imported on this rank ({e}): pip install torchft, or make lab / "
            "make test, which install it"
        ) from None
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    _quiet_checkpoint_server()
    _spend_reducer_warning()

    class DistributedDataParallel(ddp.DistributedDataParallel):
        """torchft's DDP whose gradient hook never raises: an allreduce that failed (a peer
        died) is reported to the Manager, which then does not commit the step, instead of
        failing the backward pass on every survivor as the underlying future would. Nor does
        it wait for the allreduce, as torchft's own hook does: a bucket's goes on while the
        backward pass computes the next (FT-DDP at 0.83x plain DDP's steps/s against 0.77x
        waiting, hidden 1024, two buckets; 0.75x against 0.66x at hidden 256; one run each of
        bench_ft.py's first table, 4 ranks on 2 cores)."""

        @staticmethod
        def _comm_hook(state, bucket):
            import torch

            await_quorum(state)
            buffer = bucket.buffer()
            work = state.allreduce(buffer)  # torchft's: the quorum's, the tensor zeroed if healing
            raw = getattr(work, "_work", None)  # the process group's own, under torchft's
            if raw is None:  # an earlier failure in this step: nothing was sent
                fut = torch.futures.Future()
                fut.set_result(buffer)
                return fut
            participants = state.num_participants()

            def averaged(fut):
                # Not waited for here, as torchft's own hook does: the backward pass goes on
                # while a bucket's allreduce runs (DDP waits for them all as it ends).
                try:
                    fut.value()
                except Exception as e:  # the Manager's now: should_commit says no
                    state.report_error(e)
                    return buffer
                return buffer.div_(participants)

            return raw.get_future().then(averaged)

    return torchft, DistributedDataParallel


def _quiet_checkpoint_server() -> None:
    """torchft's checkpoint server logs every request a healing peer makes on stderr, which
    is the cell's output: its successful requests are not logged (its errors still are)."""
    from torchft import http

    server = http._IPv6HTTPServer
    if getattr(server, "_monarch_quiet", False):
        return
    init = server.__init__

    def quiet_init(self, address, handler, *args, **kwargs):
        handler.log_request = lambda self, code="-", size="-": None
        init(self, address, handler, *args, **kwargs)

    server.__init__ = quiet_init
    server._monarch_quiet = True


_reducer_warned = False


def _spend_reducer_warning() -> None:
    """torchft's DDP sets ``find_unused_parameters`` (its buckets must never be rebuilt), and
    torch's reducer then warns, once per process and from C++ straight to fd 2 (the cell's
    output), that no parameter went unused. It is spent here on a model of one parameter, with
    fd 2 pointed at /dev/null for that moment."""
    global _reducer_warned
    if _reducer_warned:
        return
    _reducer_warned = True
    import torch
    from torch.nn import parallel
    from torchft.process_group import ProcessGroupDummy

    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        model = parallel.DistributedDataParallel(
            torch.nn.Linear(1, 1),
            process_group=ProcessGroupDummy(0, 1),
            find_unused_parameters=True,
        )
        model(torch.ones(1, 1)).sum().backward()
    except Exception:
        pass  # only a warning was at stake
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
