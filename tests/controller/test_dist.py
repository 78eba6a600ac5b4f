"""torch.distributed over the ranks: real gloo process groups between worker processes."""

from __future__ import annotations

import re
import textwrap

import pytest

import monarch_nb
from monarch_nb.controller.dist import DistError, default_backend, form_group, master_host
from monarch_nb.controller.launch import host_visibility


def test_all_reduce_sums_the_ranks(clean):
    assert clean.dist_backend == "gloo"
    mesh = clean.run(
        "import os, torch, torch.distributed as dist\n"
        "t = torch.tensor([rank + 1.0])\n"
        "dist.all_reduce(t)\n"
        "(t.item(), dist.get_rank(), dist.get_world_size(), 'MASTER_PORT' in os.environ)"
    )
    assert mesh.values() == [(3.0, 0, 2, False), (3.0, 1, 2, False)]


def test_ddp_gradients_agree_across_ranks(clean):
    mesh = clean.run(
        textwrap.dedent("""
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(4, 2))
        torch.manual_seed(100 + rank)              # different data on every rank
        model(torch.randn(8, 4)).pow(2).sum().backward()
        model.module.weight.grad.clone()
    """)
    )
    g0, g1 = mesh.values()
    assert g0.abs().sum() > 0
    assert (g0 - g1).abs().max() < 1e-6


def test_two_clusters_at_once_on_one_machine(clean):
    other = monarch_nb.up(workers=2, cpu=True, current=False)
    try:
        code = (
            "import torch, torch.distributed as dist\n"
            "t = torch.tensor([1.0])\ndist.all_reduce(t)\nt.item()"
        )
        assert other.run(code).values() == [2.0, 2.0]
        assert clean.run(code).values() == [2.0, 2.0]
        assert monarch_nb.current() is clean
    finally:
        other.down()


def test_a_group_that_cannot_form_leaves_the_cluster_usable(clean):
    with pytest.raises(DistError, match=r"nccl process group could not form.*usable without it"):
        form_group(clean, backend="nccl", timeout=10)
    assert clean.run("rank").values() == [0, 1]
    assert form_group(clean) == "gloo"
    assert clean.run("import torch.distributed as d\nd.is_initialized()").values() == [True, True]


def test_helpers():
    # as init_process_group() with no backend: CPU tensors' collectives work on GPU ranks too
    assert default_backend(["cuda", "cuda"]) == "cpu:gloo,cuda:nccl"
    assert default_backend(["rocm"]) == "cpu:gloo,cuda:nccl"
    assert default_backend(["cuda", "cpu"]) == "gloo"
    assert master_host("tcp://10.1.2.3:4567") == "10.1.2.3"
    assert master_host("tcp://[::1]:4567") == "::1"


SCRIPT = """
import os, sys
import torch, torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(os.environ["RANK"]) + 1])
dist.all_reduce(t)
print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "local", os.environ["LOCAL_RANK"],
      os.environ["LOCAL_WORLD_SIZE"], "sum", t.item(), "args", sys.argv[1:])
dist.destroy_process_group()
sys.exit(int(os.environ["RANK"]) * 3 if "fail" in sys.argv else 0)
"""


def test_run_a_torchrun_style_script(cell, clean, tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    cell("%monarch run train.py --lr 0.1")
    assert "[rank 0] rank 0 of 2 local 0 2 sum 3.0 args ['--lr', '0.1']" in cell.out
    assert "[rank 1] rank 1 of 2 local 1 2 sum 3.0" in cell.out
    assert "exited with code 0 on ranks 0-1" in cell.out
    cell("%monarch run --targets 1 train.py")
    assert "[rank 1] rank 0 of 1 local 0 1 sum 1.0" in cell.out
    cell("%monarch run train.py fail", expect_error=True)
    rendered = "\n".join(cell.error._render_traceback_())
    # rank 0 may still be ending when rank 1 fails, and is then released
    assert re.search(
        r"train\.py failed on (1 of 2 ranks|rank 1: .*code 3 \(rank 0 released\))", rendered
    )
    assert "[rank 1] ScriptExit: train.py exited with code 3" in rendered
    cell("%monarch run missing.py", expect_error=True)
    assert "run: no script at 'missing.py'" in str(cell.error)
    cell("%monarch run /nonexistent/abs.py", expect_error=True)
    assert "FileNotFoundError" in "\n".join(cell.error._render_traceback_())


def test_run_a_module_of_the_package_as_python_m_does(cell, clean, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing here: notebook 04's script ships in the package
    cell("%monarch run -m monarch_nb.examples.train_digits --model dense --steps 2 --warmup 1")
    assert '[rank 0] {"model": "dense", "world": 2' in cell.out, cell.out
    assert "-m monarch_nb.examples.train_digits exited with code 0 on ranks 0-1" in cell.out
    cell("%monarch run -m monarch_nb.no_such_module", expect_error=True)
    rendered = "\n".join(cell.error._render_traceback_())
    assert "ModuleNotFoundError: no module named 'monarch_nb.no_such_module' on" in rendered


def test_scripts_see_their_hosts_pinned_gpus_in_local_rank_order():
    a, b = "node-a", "node-b"
    pins = [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "1"}, {}, {}]
    assert host_visibility([a, a, b, b], pins) == [
        {"CUDA_VISIBLE_DEVICES": "3,1"},
        {"CUDA_VISIBLE_DEVICES": "3,1"},
        {},  # not pinned: keeps the worker's own environment
        {},
    ]
    rocm = [{"ROCR_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": str(i)} for i in range(2)]
    assert host_visibility([a, a], rocm) == [{"HIP_VISIBLE_DEVICES": "0,1"}] * 2
    shared = [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "0"}]
    assert host_visibility([a, a], shared) == [{}, {}]  # one GPU for both: nothing to choose
    assert host_visibility([a, b], pins[:2]) == [{}, {}]  # alone on its host: its one GPU


PINNED = """
import os
print("local", os.environ["LOCAL_RANK"], "sees", os.environ["CUDA_VISIBLE_DEVICES"])
"""


def test_a_pinned_ranks_script_finds_its_own_gpu_at_local_rank(cell, clean, tmp_path):
    # Pinned as %monarch up pins GPU workers; on this machine the variable is only read.
    clean.run("import os\nos.environ['CUDA_VISIBLE_DEVICES'] = str(7 - rank)")
    try:
        (tmp_path / "pinned.py").write_text(PINNED)
        cell(f"%monarch run {tmp_path / 'pinned.py'}")
        assert "[rank 0] local 0 sees 7,6" in cell.out
        assert "[rank 1] local 1 sees 7,6" in cell.out  # entry 1 is rank 1's GPU, 6
    finally:
        clean.run("del os.environ['CUDA_VISIBLE_DEVICES']")
