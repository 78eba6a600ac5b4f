"""``monarch_nb.checkpoint`` on real ranks and real gloo groups: a round trip, an FSDP2 model
saved at 4 ranks and loaded at 2, a training loop that loses a worker (SIGKILL) and goes on
from its latest checkpoint with the losses it would have had, and the mistakes and failures
that must leave the previous checkpoint the latest and the cluster answering."""

from __future__ import annotations

import _thread
import os
import signal
import textwrap
import threading

import pytest
import torch
from _wait import wait_for

import monarch_nb
from monarch_nb import CellError, checkpoint

ALL_REDUCE = (
    "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
)

NETS = textwrap.dedent("""
    import torch
    from monarch_nb import checkpoint

    def net(seed, width=16):
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 2)
        )

    def train(model, opt, steps):
        for _ in range(steps):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
""")


@pytest.fixture(scope="module")
def own():
    """A cluster of this module's own, for scaling and for a worker killed."""
    ctl = monarch_nb.up(workers=2, cpu=True, current=False)
    yield ctl
    ctl.down()


@pytest.fixture
def nets(clean, tmp_path):
    clean.run(NETS)
    path = tmp_path / "ckpt"
    clean.push({"PATH": str(path)})
    return clean, path


def failed(ctl, code: str) -> dict[int, tuple[str, str]]:
    """Each rank's error from a cell that must fail, as (type, message); the message is one
    line, and the ranks' collectives still pair up afterwards."""
    with pytest.raises(CellError) as info:
        ctl.run(code)
    errors = {r: (e.ename, e.evalue) for r, e in info.value.errors.items()}
    assert all("\n" not in text for _, text in errors.values()), errors
    assert ctl.run(ALL_REDUCE).values() == [2.0] * ctl.world_size
    return errors


def on_disk(path) -> list[str]:
    return sorted(os.listdir(path))


# -- saving and loading ---------------------------------------------------------------------
def test_a_round_trip_restores_the_model_the_optimizer_the_rng_and_extra(nets):
    ctl, path = nets
    saved = ctl.run(
        textwrap.dedent("""
        model = net(0)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        checkpoint.save(PATH, model, opt, step=0)
        assert not opt.state  # as it was: a save changes nothing of the training
        train(model, opt, 3)
        extra = {"epoch": 1, "seen": [3, torch.ones(2)]}
        where = checkpoint.save(PATH, model, opt, step=3, extra=extra)
        after = torch.randn(3)  # what the generator gives next
        where
        """)
    )
    assert saved.values() == [str(path / "step-00000003")] * 2
    assert on_disk(path) == ["latest", "step-00000000", "step-00000003"]
    assert (checkpoint.latest(path), checkpoint.steps(path)) == (3, [0, 3])
    meta = checkpoint.info(path)
    assert (meta["step"], meta["world_size"], meta["optimizer"]) == (3, 2, True)
    assert meta["params"] == {
        "0.weight": [16, 8],
        "0.bias": [16],
        "2.weight": [2, 16],
        "2.bias": [2],
    }

    mesh = ctl.run(
        textwrap.dedent("""
        fresh = net(1)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
        torch.manual_seed(99)
        extra = {}
        step = checkpoint.load(PATH, fresh, fresh_opt, extra=extra)
        a, b = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
        (
            step,
            all(map(torch.equal, model.state_dict().values(), fresh.state_dict().values())),
            sorted(a) == sorted(b) and all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i]),
            torch.equal(torch.randn(3), after),
            extra["epoch"], extra["seen"][0], extra["seen"][1].tolist(),
        )
        """)
    )
    assert mesh.values() == [(3, True, True, True, 1, 3, [1.0, 1.0])] * 2
    # the model alone, into a model without an optimizer
    assert ctl.run("checkpoint.load(PATH, net(2))\nrank").values() == [0, 1]


def test_keep_removes_older_steps_and_a_step_saved_again_replaces_it(nets):
    ctl, path = nets
    ctl.run(
        "model = net(0)\nfor s in (1, 2, 3, 4):\n    checkpoint.save(PATH, model, step=s, keep=2)"
    )
    assert on_disk(path) == ["latest", "step-00000003", "step-00000004"]
    mesh = ctl.run(
        "other = net(5)\ncheckpoint.save(PATH, other, step=4)\n"
        "back = net(6)\nchecked = checkpoint.load(PATH, back)\n"
        "(checked, torch.equal(back[0].weight, other[0].weight))"
    )
    assert mesh.values() == [(4, True)] * 2
    assert checkpoint.steps(path) == [3, 4]


def test_fsdp2_saved_at_4_ranks_loads_at_2(own, tmp_path):
    build = NETS + textwrap.dedent("""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = net(SEED)
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    """)
    full = (
        "({k: v.full_tensor() for k, v in model.state_dict().items()},\n"
        " {k: v.full_tensor() for k, v in opt.state_dict()['state'][0].items() if k != 'step'},\n"
        " model[0].weight.to_local().shape[0])"
    )
    own.scale(4)
    try:
        own.push({"PATH": str(tmp_path), "SEED": 0})
        saved = own.run(
            build + "train(model, opt, 2)\ncheckpoint.save(PATH, model, opt, step=2)\n" + full
        )
        params, adam, rows = saved.item(0)
        assert rows == 4  # 16 rows over 4 ranks
        own.scale(2)
        own.push({"PATH": str(tmp_path), "SEED": 1})
        loaded = own.run(build + "step = checkpoint.load(PATH, model, opt)\n" + full)
    finally:
        if own.world_size != 2:
            own.scale(2)
    assert checkpoint.info(tmp_path)["world_size"] == 4
    for got_params, got_adam, got_rows in loaded.values():
        assert got_rows == 8  # the same 16 rows over 2 ranks
        assert got_params.keys() == params.keys() and got_adam.keys() == adam.keys() == {
            "exp_avg",
            "exp_avg_sq",
        }
        for k in params:
            assert torch.equal(got_params[k], params[k]), k
        for k in adam:
            assert torch.equal(got_adam[k], adam[k]), k


def test_a_tensor_parallel_model_loads_into_a_plain_one(own, tmp_path):
    """On this module's cluster: a model parallelized so holds the process group (as DDP does)
    after the namespace is gone, and the shared cluster's tests of Ctrl-C need it free."""
    own.push({"PATH": str(tmp_path)})
    mesh = own.run(
        NETS
        + textwrap.dedent("""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel, RowwiseParallel, parallelize_module
        )

        model = net(0)
        mesh = init_device_mesh("cpu", (world_size,))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        train(model, opt, 2)
        checkpoint.save(PATH, model, opt, step=2)
        plain = net(1)
        checkpoint.load(PATH, plain)
        (
            model[0].weight.to_local().shape[0],
            all(torch.equal(v.full_tensor(), plain.state_dict()[k])
                for k, v in model.state_dict().items()),
        )
        """)
    )
    assert mesh.values() == [(8, True)] * 2  # 16 rows, 8 on each rank, all 16 in the plain model


# -- a rank lost mid-run --------------------------------------------------------------------
TRAIN = textwrap.dedent("""
    import time
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from monarch_nb import checkpoint

    def run(path, steps, every=5, pause=0.0):
        torch.manual_seed(0)
        layers = (torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        model = DDP(torch.nn.Sequential(*layers))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        torch.manual_seed(1 + rank)  # each rank's own data, drawn from its generator
        start = checkpoint.load(path, model, opt) if checkpoint.latest(path) is not None else 0
        losses = {}
        for step in range(start, steps):
            x = torch.randn(32, 8)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[step] = loss.item()
            if (step + 1) % every == 0:
                checkpoint.save(path, model, opt, step=step + 1)
            time.sleep(pause)
        return losses
""")


def test_a_loop_that_lost_a_rank_goes_on_from_the_latest_checkpoint_with_the_same_losses(
    own, tmp_path
):
    own.run(TRAIN)
    whole = own.run(f"run({str(tmp_path / 'whole')!r}, 30)").values()
    assert sorted(whole[0]) == list(range(30))

    path = tmp_path / "cut"
    handle = own.run(f"run({str(path)!r}, 30, pause=0.05)", block=False)
    assert wait_for(lambda: (checkpoint.latest(path) or 0) >= 10, timeout=60, interval=0.01)
    pid = own.status()[1]["pid"]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(CellError) as info:
        handle.result(timeout=60)
    assert info.value.errors[1].ename == "WorkerLost"
    notices: list[str] = []
    assert wait_for(
        lambda: (
            notices.extend(own.notices())
            or any("process group was formed again" in n for n in notices)
        )
    ), notices
    last = checkpoint.latest(path)
    # a directory named as a step is one whose save finished
    assert [n for n in on_disk(path) if n.startswith("step-")] == [
        f"step-{s:08d}" for s in checkpoint.steps(path)
    ]

    own.run(TRAIN)  # the new rank 1 starts with an empty namespace
    resumed = own.run(f"run({str(path)!r}, 30)").values()
    assert own.status()[1]["pid"] != pid
    for rank in (0, 1):
        assert sorted(resumed[rank]) == list(range(last, 30))
        for step, loss in resumed[rank].items():
            assert loss == pytest.approx(whole[rank][step], rel=1e-5, abs=1e-7), (rank, step)


# -- mistakes and failures: one line, the latest kept, the cluster answering ----------------
def test_a_path_that_cannot_be_written_is_one_line(nets, tmp_path):
    """A path under a regular file: not writable for root either (a chmod-ed directory is)."""
    ctl, _ = nets
    (tmp_path / "file").write_text("")
    ctl.push({"BAD": str(tmp_path / "file" / "ckpt"), "GOOD": str(tmp_path / "good")})
    errors = failed(ctl, "checkpoint.save(BAD, net(0), step=1)")
    expected = f"checkpoints cannot be written to {tmp_path / 'file' / 'ckpt'} (Not a directory"
    assert {r: e[0] for r, e in errors.items()} == {0: "ValueError", 1: "ValueError"}
    assert all(text.startswith(expected) for _, text in errors.values()), errors
    # one rank only: the other does not wait in a collective for it, it says the same
    errors = failed(ctl, "checkpoint.save(BAD if rank == 1 else GOOD, net(0), step=1)")
    assert all(text.startswith(f"rank 1: {expected}") for _, text in errors.values()), errors
    assert not (tmp_path / "good" / "latest").exists()
    assert [n for n in on_disk(tmp_path / "good") if not n.startswith(".probe")] == []


def test_a_checkpoint_of_another_model_is_refused_naming_the_first_difference(nets):
    ctl, path = nets
    ctl.run("checkpoint.save(PATH, net(0), step=1)")
    where = path / "step-00000001"
    another = f"{where} is of another model:"
    cases = {
        "net(0, width=32)": f"{another} '0.weight' is (16, 8) there and (32, 8) here",
        "torch.nn.Linear(8, 2)": f"{another} it has no 'weight', which this model has",
        "torch.nn.Sequential(*net(0)[:2])": f"{another} it has '2.weight', which this model lacks",
    }
    for model, message in cases.items():
        errors = failed(
            ctl,
            f"model = {model}\nbefore = [p.clone() for p in model.parameters()]\n"
            "checkpoint.load(PATH, model)",
        )
        assert errors == {0: ("ValueError", message), 1: ("ValueError", message)}, model
        assert ctl.run(
            "all(torch.equal(a, b) for a, b in zip(before, model.parameters()))"
        ).values() == [True, True]
    errors = failed(
        ctl,
        "model = net(0)\ncheckpoint.load(PATH, model, torch.optim.SGD(model.parameters(), lr=0.1))",
    )
    assert errors[0] == (
        "ValueError",
        f"{where} holds no optimizer state (saved without one): load it without the optimizer",
    )


def test_a_save_that_fails_on_one_rank_leaves_the_previous_latest(nets):
    ctl, path = nets
    ctl.run(
        textwrap.dedent("""
        class Broken(torch.nn.Linear):
            def state_dict(self, *args, **kwargs):
                if rank == 1 and BROKEN:
                    raise OSError("the disk is full")
                return super().state_dict(*args, **kwargs)

        BROKEN = False
        model = Broken(4, 2)
        checkpoint.save(PATH, model, step=1)
        """)
    )
    with pytest.raises(CellError) as info:
        ctl.run("BROKEN = True\ncheckpoint.save(PATH, model, step=2)")
    message = "step 2 was not saved (rank 1: OSError: the disk is full); the latest is still step 1"
    errors = info.value.errors
    assert {r: (e.ename, e.evalue) for r, e in errors.items()} == {
        r: ("RuntimeError", message) for r in (0, 1)
    }
    assert "the disk is full" in "\n".join(errors[1].traceback)  # the cause, where it was raised
    assert on_disk(path) == ["latest", "step-00000001"]
    assert checkpoint.latest(path) == 1
    assert ctl.run(ALL_REDUCE).values() == [2.0, 2.0]


def test_a_save_that_dcp_fails_on_one_rank_after_the_others_wrote_is_not_published(own, tmp_path):
    """A model on the meta device on rank 1: DCP's writing fails there, rank 0's is written.
    On this module's cluster: after DCP's own failure the ranks hold the process group (a rank
    leaving it closes none of its connections), and the shared cluster's tests of Ctrl-C in a
    collective need it free."""
    ctl, path = own, tmp_path / "ckpt"
    ctl.run(NETS)
    ctl.push({"PATH": str(path)})
    ctl.run("checkpoint.save(PATH, net(0), step=1)")
    errors = failed(
        ctl,
        "with torch.device('meta' if rank == 1 else 'cpu'):\n    model = net(0)\n"
        "checkpoint.save(PATH, model, step=2)",
    )
    message = (
        "step 2 was not saved (rank 1: NotImplementedError: Cannot copy out of meta tensor; "
        "no data!); the latest is still step 1"
    )
    assert errors == {r: ("RuntimeError", message) for r in (0, 1)}
    assert on_disk(path) == ["latest", "step-00000001"]


def test_a_save_where_the_ranks_do_not_share_the_directory_is_not_published(nets, tmp_path):
    """Rank 0 finds the others' files missing once DCP has written: what it wrote is removed and
    its latest stays where it was."""
    ctl, _ = nets
    ctl.push({"MINE": str(tmp_path / "r") + "{}"})
    ctl.run("checkpoint.save(MINE.format(0), net(0), step=1)")  # shared, the first time
    errors = failed(ctl, "checkpoint.save(MINE.format(rank), net(0), step=2)")
    expected = (
        f"rank 0: only 1 of the 2 ranks' files are in {tmp_path / 'r0'}/.step-00000002.partial-"
    )
    assert all(text.startswith(expected) for _, text in errors.values()), errors
    assert all(
        text.endswith(
            "is not one directory shared by every rank (put checkpoints on a "
            "file system they all mount)"
        )
        for _, text in errors.values()
    )
    assert on_disk(tmp_path / "r0") == ["latest", "step-00000001"]
    assert checkpoint.latest(tmp_path / "r0") == 1
    assert checkpoint.steps(tmp_path / "r1") == []  # only a hidden partial directory there


def test_ctrl_c_during_a_save_leaves_the_previous_latest_and_the_group_usable(nets):
    ctl, path = nets
    ctl.run(
        textwrap.dedent("""
        import time

        class Slow(torch.nn.Linear):
            def state_dict(self, *args, **kwargs):
                t0 = time.time()
                while rank == 1 and SLOW and time.time() - t0 < 60:
                    time.sleep(0.05)
                return super().state_dict(*args, **kwargs)

        SLOW = False
        model = Slow(4, 2)
        checkpoint.save(PATH, model, step=1)
        """)
    )
    ended = threading.Event()
    timer = threading.Timer(1.0, lambda: ended.is_set() or _thread.interrupt_main())
    timer.start()
    with pytest.raises(CellError) as info:
        try:
            ctl.run("SLOW = True\ncheckpoint.save(PATH, model, step=2)")
        finally:
            ended.set()
    timer.join()
    # rank 0 waited in the save's first collective; the other leaving the group set it free
    assert {e.ename for e in info.value.errors.values()} == {"KeyboardInterrupt"}
    assert on_disk(path) == ["latest", "step-00000001"]
    assert ctl.run(ALL_REDUCE).values() == [2.0, 2.0]
    assert ctl.run(
        "SLOW = False\ncheckpoint.save(PATH, model, step=2)\ncheckpoint.latest(PATH)"
    ).values() == [2, 2]


BAD_CALLS = {
    "checkpoint.save(PATH, net(0), step=-1)": "step must be a whole number of at least 0, got -1",
    "checkpoint.save(PATH, net(0), step='3')": "step must be a whole number of at least 0, got '3'",
    "checkpoint.save(PATH, net(0), step=1, keep=0)": "keep must be a count of at least 1, got 0",
    "checkpoint.save(PATH, net(0), step=1, extra={'f': len})": (
        "extra['f'] is a builtin_function_or_method: a checkpoint's extra keeps numbers, "
        "strings, tensors, and lists, tuples and dicts of them"
    ),
    "checkpoint.save(PATH, net(0), step=1, extra=[1])": "extra must be a dict, got list",
    "checkpoint.save(PATH, 'model', step=1)": "model must be a torch.nn.Module, got str",
    "checkpoint.load(PATH, net(0))": (
        "no checkpoint in {path} (no 'latest' marker there): save one first, or pass step="
    ),
}


def test_bad_arguments_are_one_line_on_every_rank(nets):
    ctl, path = nets
    for call, message in BAD_CALLS.items():
        message = message.format(path=path)
        assert failed(ctl, call) == {r: ("ValueError", message) for r in (0, 1)}, call
    ctl.run("checkpoint.save(PATH, net(0), step=5)")
    assert failed(ctl, "checkpoint.load(PATH, net(0), step=5 + rank)")[0] == (
        "ValueError",
        "rank 1: " + f"{path} has no finished checkpoint step-00000006 (steps: 5)",
    )
    assert failed(ctl, "checkpoint.load(PATH, net(0), step=4)")[0] == (
        "ValueError",
        f"{path} has no finished checkpoint step-00000004 (steps: 5)",
    )
    # a checkpoint torch.distributed.checkpoint wrote without this module
    ctl.run(
        "import torch.distributed.checkpoint as dcp\n"
        "dcp.save({'model': net(0).state_dict()}, checkpoint_id=PATH + '/step-00000007')"
    )
    assert failed(ctl, "checkpoint.load(PATH, net(0), step=7)")[0][1].startswith(
        f"{path / 'step-00000007'} is a torch.distributed.checkpoint without monarch.json"
    )
    assert checkpoint.steps(path) == [5]


def test_without_a_process_group_it_says_so(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"^checkpoints are saved and loaded over the torch.distributed process group, "
        "and this process has none",
    ):
        checkpoint.save(tmp_path, torch.nn.Linear(2, 2), step=1)
    with pytest.raises(ValueError, match="this process has none"):
        checkpoint.load(tmp_path, torch.nn.Linear(2, 2))
    assert checkpoint.latest(tmp_path) is None and checkpoint.steps(tmp_path) == []
