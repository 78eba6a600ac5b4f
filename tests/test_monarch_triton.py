"""The Triton kernels themselves: results under the Triton interpreter, and compilation.

The interpreter has no bfloat16, so results are checked in float32; each config set runs in
a subprocess because ``TRITON_INTERPRET`` must be set before the kernels are decorated.
Every config is also compiled ahead of time for its GPUs (cubin for sm_80/sm_90, hsaco for
gfx942/gfx950), which needs no GPU. Running the compiled kernels needs one and is not part of
CPU CI.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

HELPER = Path(__file__).with_name("_kernel_helpers.py")


def _configs(config_set: str, kind: str):
    from monarch_kernels.configs import _cuda_configs, _hip_configs

    if config_set == "cuda":
        return _cuda_configs(kind)
    return _hip_configs(kind, arch=config_set.split("-", 1)[1])


def _interpret(config_set: str, direction: str) -> None:
    # the launcher's own choices (which grouped configs fit a block count) follow the set
    backend = "hip" if config_set.startswith("hip") else "cuda"
    env = {**os.environ, "TRITON_INTERPRET": "1", "MONARCH_KERNELS_CONFIGS": backend}
    proc = subprocess.run(
        [sys.executable, str(HELPER), config_set, direction],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checks passed" in proc.stdout and not proc.stdout.startswith("0 ")


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("config_set", ["cuda", "hip-gfx942", "hip-gfx950"])
def test_kernels_match_reference_under_interpreter(config_set, direction):
    _interpret(config_set, direction)


def test_custom_op_and_autograd_through_kernels_under_interpreter():
    _interpret("cuda", "op")


def test_launch_plans_compute_what_the_launchers_do_under_interpreter():
    """Replayed calls (``replay.py``) on new tensors, strided ones and one whose storage
    starts 4 bytes on, match the reference; a launcher call that copies is never replayed."""
    _interpret("cuda", "replay")


# Shared memory / LDS one program may use: H100/H200 227 KB, A100 163 KB, MI300X 64 KB,
# MI355X 160 KB.
TARGETS = {
    "cuda": [("cuda", 90, 32, 227 * 1024), ("cuda", 80, 32, 163 * 1024)],
    "hip-gfx942": [("hip", "gfx942", 64, 64 * 1024)],
    "hip-gfx950": [("hip", "gfx950", 64, 160 * 1024)],
}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
@pytest.mark.parametrize("config_set", ["cuda", "hip-gfx942", "hip-gfx950"])
def test_every_config_compiles_for_its_gpus(config_set):
    """Ahead-of-time compilation to cubin / hsaco, no GPU needed: every config of the set, in
    bfloat16 (and the first in float16 and float32), within the chip's shared memory."""
    from _aot import LAUNCH_CONSTANTS, compile_config

    compiled = 0
    for backend, arch, warp, smem_limit in TARGETS[config_set]:
        for kind in LAUNCH_CONSTANTS:
            cfgs = _configs(config_set, kind)
            variants = [(c, "bf16") for c in cfgs] + [(cfgs[0], "fp16"), (cfgs[0], "fp32")]
            for cfg, dtype in variants:
                if arch == 80 and dtype == "bf16" and cfg is not cfgs[0]:
                    continue  # sm_80 shares sm_90's configs; one of them is enough
                flag = {"fused": "FULL_SCRATCH", "stage": "TRANS_OUT", "stage_wgrad": "TRANS_OUT"}
                flag = flag.get(kind)
                for value in (False, True) if flag else (None,):
                    flags = {flag: value} if flag else {}
                    target = (backend, arch, warp)
                    binary = compile_config(kind, cfg, target, dtype, **flags)
                    assert ("cubin" if backend == "cuda" else "hsaco") in binary.asm
                    assert binary.metadata.shared <= smem_limit, (kind, cfg, binary.metadata.shared)
                    if backend == "hip":  # no vector registers spilled to scratch memory
                        spills = re.search(r"\.vgpr_spill_count:\s+(\d+)", binary.asm["amdgcn"])
                        assert spills and spills.group(1) == "0", (kind, cfg, dtype, spills)
                    compiled += 1
    assert compiled >= 10


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
@pytest.mark.parametrize("config_set", ["cuda", "hip-gfx942", "hip-gfx950"])
def test_permutation_kernels_compile_for_its_gpus(config_set):
    """The kernels with block sizes fixed by their launchers: the two data-movement kernels
    (both directions) and the split-partial sum."""
    from _aot import compile_ahead
    from monarch_kernels.triton_kernels import (
        _batch_last_kernel,
        _sum_splits_kernel,
        _transpose_rows_kernel,
    )

    for backend, arch, warp, _smem in TARGETS[config_set]:
        for dtype in ("bf16", "fp32"):
            for to_flat in (False, True):
                consts = {"TO_FLAT": to_flat, "BLOCK_M": 64, "BLOCK_O": 64}
                binary = compile_ahead(_batch_last_kernel, consts, {}, (backend, arch, warp), dtype)
                assert ("cubin" if backend == "cuda" else "hsaco") in binary.asm
            for p, q in ((64, 64), (1024, 4), (5, 3)):  # (s, l) at 64 and 4 blocks, odd sizes
                bp, bq = min(64, triton.next_power_of_2(p)), min(64, triton.next_power_of_2(q))
                consts = {"P": p, "Q": q, "BLOCK_M": max(1, 8192 // (bp * bq))}
                consts.update(BLOCK_P=bp, BLOCK_Q=bq)
                binary = compile_ahead(
                    _transpose_rows_kernel, consts, {}, (backend, arch, warp), dtype
                )
                assert ("cubin" if backend == "cuda" else "hsaco") in binary.asm
            binary = compile_ahead(
                _sum_splits_kernel, {"BLOCK": 1024}, {}, (backend, arch, warp), dtype
            )
            assert ("cubin" if backend == "cuda" else "hsaco") in binary.asm


def test_config_sets_are_distinct_and_fit_their_chip():
    from monarch_kernels.configs import _SMEM_BYTES, _cuda_configs, _fits, _hip_configs

    for kind in ("stage", "group", "fused", "wgrad", "stage_wgrad", "pipeline"):
        cuda, mi300, mi355 = (
            _cuda_configs(kind),
            _hip_configs(kind, "gfx942"),
            _hip_configs(kind, "gfx950"),
        )
        assert cuda and mi300 and mi355
        assert all("waves_per_eu" in c.kwargs and "matrix_instr_nonkdim" in c.kwargs for c in mi300)
        assert not any("waves_per_eu" in c.kwargs for c in cuda)
        resident = kind == "stage_wgrad"
        assert all(_fits(c, _SMEM_BYTES["gfx942"], resident=resident) for c in mi300)
        assert len(mi355) >= len(mi300)
    assert all(
        c.kwargs["BLOCK_M"] <= 64 for c in _cuda_configs("fused") + _hip_configs("fused", "gfx942")
    )


def test_env_override(monkeypatch):
    from monarch_kernels import configs

    monkeypatch.setenv(configs.ENV_VAR, "hip")
    assert all("waves_per_eu" in c.kwargs for c in configs.get_configs("stage"))
    monkeypatch.setenv(configs.ENV_VAR, "cuda")
    assert not any("waves_per_eu" in c.kwargs for c in configs.get_configs("stage"))
    monkeypatch.setenv(
        configs.ENV_VAR,
        "BLOCK_M=128,BLOCK_O=32,BLOCK_C=16,num_warps=8; BLOCK_M=32,BLOCK_O=16,BLOCK_C=16",
    )
    stage = configs.get_configs("stage")
    assert [c.kwargs["BLOCK_M"] for c in stage] == [128, 32]
    assert stage[0].num_warps == 8
    assert [c.kwargs["BLOCK_M"] for c in configs.get_configs("fused")] == [32]
    monkeypatch.setenv(configs.ENV_VAR, "BLOCK_M=64")
    with pytest.raises(ValueError, match="lacks BLOCK_C, BLOCK_O"):
        configs.get_configs("stage")
    monkeypatch.setenv(configs.ENV_VAR, "BLOCK_M=x")
    with pytest.raises(ValueError, match="KEY=INT"):
        configs.get_configs("stage")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="checks the no-GPU refusal")
def test_launcher_refuses_bad_input():
    import torch
    from monarch_kernels import forward_launch, triton_launch

    x, w1, w2 = torch.randn(4, 12), torch.randn(3, 4, 4), torch.randn(2, 5, 6)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        forward_launch.monarch_forward(x.double(), w1.double(), w2.double())
    with pytest.raises(ValueError, match="need a GPU"):
        forward_launch.monarch_forward(x, w1, w2)
    with pytest.raises(ValueError, match="expected x"):
        triton_launch._shapes(torch.randn(4, 13), w1, w2)


def test_path_choice_times_each_direction_once_per_shape(monkeypatch):
    """The chooser's bookkeeping, with the timing (which needs a GPU) answered by a table of
    times: the fastest candidate wins, is kept per (direction, shape), and a shape first seen
    inside a graph capture takes the fixed path without being remembered."""
    import torch
    from monarch_kernels import backward_launch, forward_launch, path_choice, triton_launch

    times = {"two_kernel": 3.0, "three_kernel": 1.0, "blas": 2.0}
    made = []

    def bench(fn):
        fn()
        return times[fn.path]

    def runs(paths):
        def make():
            made.append(paths)
            out = {}
            for p in paths:
                out[p] = lambda: None
                out[p].path = p
            return out

        return make

    capturing = [False]
    monkeypatch.setattr(path_choice, "_call_ms", bench)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(path_choice, "_path_choice", {})
    x = torch.randn(4, 8)
    all3 = runs(("two_kernel", "three_kernel", "blas"))
    assert path_choice._choose("forward", (x,), all3, "two_kernel") == "three_kernel"
    assert path_choice._choose("forward", (x,), all3, "two_kernel") == "three_kernel"
    assert len(made) == 1  # timed once
    two = runs(("two_kernel", "blas"))
    assert path_choice._choose("backward", (x,), two, "two_kernel") == "blas"  # apart
    capturing[0] = True
    assert path_choice._choose("forward", (x.t(),), all3, "two_kernel") == "two_kernel"
    assert len(made) == 2 and len(path_choice._path_choice) == 2  # nothing timed or kept
    capturing[0] = False

    # within 3% of the fastest the first listed wins (candidates come fewest launches first)
    times.update(two_kernel=1.02, three_kernel=1.0, blas=1.5)
    z = torch.randn(5, 8)
    assert path_choice._choose("forward", (z,), all3, "two_kernel") == "two_kernel"
    times.update(two_kernel=1.04)
    assert path_choice._choose("forward", (z.t(),), all3, "two_kernel") == "three_kernel"
    times.update(two_kernel=3.0, three_kernel=1.0, blas=2.0)

    # a path that does not build here is left out, with a warning, and the rest still choose
    def too_big():
        raise triton.OutOfResources(300000, 232448, "shared memory")

    def one_fails():
        out = runs(("two_kernel", "three_kernel", "blas"))()
        out["three_kernel"] = too_big
        return out

    y = torch.randn(6, 8)
    with pytest.warns(RuntimeWarning, match="three_kernel path failed here.*OutOfResources"):
        assert path_choice._choose("forward", (y,), one_fails, "two_kernel") == "blas"
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="no backward path runs"):
        path_choice._choose("backward", (y,), lambda: {"blas": too_big}, "two_kernel")

    # the candidates: three_kernel only where it differs from two_kernel
    seen = []
    monkeypatch.setattr(triton_launch, "interpreting", lambda: False)
    for module in (forward_launch, backward_launch):
        monkeypatch.setattr(
            module, "_choose", lambda d, ts, make, cap: seen.append((d, sorted(make())))
        )
    narrow, wide = torch.randn(2, 4, 4), torch.randn(2, 256, 256)
    forward_launch._choose_forward_path(x, narrow, narrow, 2)
    forward_launch._choose_forward_path(x, narrow, narrow, 1)
    backward_launch._choose_backward_path(x, x, narrow, narrow, None)
    backward_launch._choose_backward_path(x, x, wide, wide, None)
    # and chunked where the batch comes in more than one chunk (rows of 32 bytes, a quarter
    # of the 16 KiB stand-in L2: 128 rows a chunk)
    many = torch.randn(129, 8)
    forward_launch._choose_forward_path(many, narrow, narrow, 2)
    backward_launch._choose_backward_path(many, many, narrow, narrow, None)
    assert seen == [
        ("forward", ["blas", "three_kernel", "two_kernel"]),
        ("forward", ["blas", "two_kernel"]),  # one output block: no output permutation
        ("backward", ["blas", "three_kernel", "two_kernel"]),
        ("backward", ["blas", "two_kernel"]),  # too wide to fuse the weight gradients
        ("forward", ["blas", "chunked", "three_kernel", "two_kernel"]),
        ("backward", ["blas", "chunked", "three_kernel", "two_kernel"]),
    ]


def test_the_shared_cache_is_the_l2_on_nvidia_and_the_infinity_cache_on_instinct(monkeypatch):
    """What the chunked and pipelined paths size their scratch by, from the device's
    properties as torch reports them (ROCm builds name the architecture)."""
    import types

    import torch
    from monarch_kernels import triton_launch

    def props(**kw):
        return lambda device: types.SimpleNamespace(**kw)

    gpu = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_properties", props(L2_cache_size=50 * 2**20))
    assert triton_launch._cache_bytes(gpu) == 50 * 2**20  # H200: no gcnArchName
    for arch in ("gfx942:sramecc+:xnack-", "gfx950"):
        monkeypatch.setattr(
            torch.cuda, "get_device_properties", props(L2_cache_size=4 * 2**20, gcnArchName=arch)
        )
        assert triton_launch._cache_bytes(gpu) == 256 * 2**20
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", props(L2_cache_size=6 * 2**20, gcnArchName="gfx1100")
    )
    assert triton_launch._cache_bytes(gpu) == 6 * 2**20  # a Radeon: its L2 as reported


def test_pipelined_items_and_lag(monkeypatch):
    """The pipelined forward's work items hold about 512 outputs of blocks that divide the
    block count, and its stages lie as many rounds apart as the programs hold, within half
    the shared cache for the ring of 2*lag + 2 slots."""
    import torch
    from monarch_kernels import pipeline_launch, triton_launch

    items = pipeline_launch._blocks_per_item
    assert [items(64, 64), items(16, 128), items(6, 64), items(5, 100), items(4, 1024)] == [
        8, 4, 2, 1, 1,
    ]  # fmt: skip
    gpu, mib = torch.device("cuda"), 2**20
    monkeypatch.setattr(triton_launch, "_cache_bytes", lambda device: 50 * mib)  # H200
    # 264 programs (two on each of 132 SMs) take 14 rounds of 20 items; 1 MiB slots: 24 fit
    assert pipeline_launch._pipeline_lag(264, 20, mib, gpu) == 11
    assert pipeline_launch._pipeline_lag(40, 20, mib, gpu) == 2
    monkeypatch.setattr(triton_launch, "_cache_bytes", lambda device: 256 * mib)  # MI300X
    assert pipeline_launch._pipeline_lag(608, 20, mib, gpu) == 31
    monkeypatch.setattr(triton_launch, "_cache_bytes", lambda device: 4 * mib)
    assert pipeline_launch._pipeline_lag(608, 20, mib, gpu) == 1  # never less than one round


def test_chunks_fit_a_share_of_the_l2_cache_and_are_few(monkeypatch):
    """The chunked path's rows per chunk: each intermediate's chunk within a quarter of the
    L2 cache, in multiples of 128 rows (16 for small ones), and at most 16 chunks."""
    import torch
    from monarch_kernels import forward_launch, triton_launch

    gpu = torch.device("cuda")
    row = 4096 * 2  # width 4096, bfloat16
    monkeypatch.setattr(triton_launch, "_cache_bytes", lambda device: 50 * 2**20)  # H100, H200
    assert forward_launch._chunk_rows(16384, row, gpu) == 1536  # 12.5 MiB / 8 KiB = 1600 rows
    assert forward_launch._chunk_rows(1536, row, gpu) == 1536  # one chunk: not a candidate
    assert forward_launch._chunk_rows(10**6, row, gpu) == 62512  # 16 chunks, 16-row multiple
    monkeypatch.setattr(triton_launch, "_cache_bytes", lambda device: 4 * 2**20)
    assert forward_launch._chunk_rows(16384, row, gpu) == 1024  # 128 rows fit: 16 chunks
    assert forward_launch._chunk_rows(16384, 3 * row, gpu) == 1024
    assert forward_launch._chunk_rows(100, 4 * 2**20, gpu) == 16  # not even a row fits


def test_blas_weight_gradients_use_the_vendor_gemm_only_where_it_is_deterministic(monkeypatch):
    """cuBLAS (reproducible by design) takes the blas path's weight gradients; ROCm builds
    (rocBLAS allows atomics) and torch's deterministic mode keep the split-reduction kernel.
    Both routes are checked against the reference under the interpreter."""
    import torch
    from monarch_kernels import backward_launch

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not backward_launch.vendor_weight_grads(cpu)
    monkeypatch.setattr(torch.version, "hip", None)
    assert backward_launch.vendor_weight_grads(cuda)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert not backward_launch.vendor_weight_grads(cuda)
    finally:
        torch.use_deterministic_algorithms(previous)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert not backward_launch.vendor_weight_grads(cuda)


def test_autotuned_config_is_launched_directly_after_the_first_call(monkeypatch):
    """After Triton's autotuner has chosen for a key, the launcher runs the kernel with that
    config itself; a new key (sizes, dtype or constants) goes back to the autotuner. The
    kernel and the autotuner are stand-ins that record their launches (no GPU here)."""
    import torch
    from monarch_kernels import triton_launch

    launches = []

    class Kernel:
        arg_names = ("inp", "out", "B", "NBLK", "NOUT", "NRED", "stride_in_m", "BLOCK_M")

        def __init__(self, who):
            self.who = who
            self.best_config = None

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                shown = grid
                if self.who == "tuner":
                    self.best_config = triton.Config({"BLOCK_M": 32 * (1 + len(launches))})
                    shown = ("callable",)
                launches.append((self.who, shown, args[2:], kwargs))

            return launch

    monkeypatch.setattr(triton_launch, "interpreting", lambda: False)
    monkeypatch.setitem(triton_launch._KERNELS, "stage", Kernel("kernel"))
    monkeypatch.setitem(triton_launch._autotuned, "stage", Kernel("tuner"))
    monkeypatch.setitem(triton_launch._KEYS, "stage", ["B", "NBLK", "stride_in_m"])
    monkeypatch.setattr(triton_launch, "_tuned", {})
    monkeypatch.setattr(triton_launch, "_key_positions", {})
    a, b = torch.empty(2), torch.empty(2, dtype=torch.float64)

    def grid(meta):
        return (meta["BLOCK_M"],)

    def launch(*args, **const):
        triton_launch._launch("stage", grid, args, None, **const)

    launch(a, a, 100, 4, 8, 8, 1)  # autotuner: chooses BLOCK_M 32
    launch(a, a, 100, 4, 9, 9, 1)  # NOUT, NRED not in the key: the same config, direct
    launch(a, a, 100, 4, 8, 8, 2)  # stride in the key: autotuner again (BLOCK_M 96)
    launch(b, a, 100, 4, 8, 8, 1)  # another dtype: autotuner (BLOCK_M 128)
    launch(a, a, 100, 4, 8, 8, 1, FLAG=True)  # another constant: autotuner (BLOCK_M 160)
    launch(a, a, 100, 4, 8, 8, 2)  # direct, with the config chosen for it
    assert [(who, g) for who, g, _args, _kw in launches] == [
        ("tuner", ("callable",)),
        ("kernel", (32,)),
        ("tuner", ("callable",)),
        ("tuner", ("callable",)),
        ("tuner", ("callable",)),
        ("kernel", (96,)),
    ]
    assert launches[1][2] == (100, 4, 9, 9, 1) and launches[1][3]["BLOCK_M"] == 32


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
def test_register_table_reads_compiled_code():
    """``benchmarks/kernel_registers.py``: a row per config with the registers, spills and
    shared memory its compiled code declares, on both vendors."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root / 'kernels'}{os.pathsep}{root / 'tests'}"}
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks/kernel_registers.py"),
         "--targets", "sm_90,gfx942", "--kinds", "wgrad"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [r.strip("|").split("|") for r in proc.stdout.splitlines() if r.startswith("| wgrad")]
    from monarch_kernels.configs import _cuda_configs, _hip_configs

    assert len(rows) == len(_cuda_configs("wgrad")) + len(_hip_configs("wgrad", "gfx942"))
    for _kind, _config, target, regs, spilled, shared, by_regs, by_shared in rows:
        assert target.strip() in ("sm_90", "gfx942")
        assert 16 <= int(regs) <= 512 and int(spilled) >= 0 and float(shared) > 0
        assert int(by_regs) >= 1 and int(by_shared) >= 1


def test_pipelined_check_runs_under_interpreter():
    """``benchmarks/pipelined_check.py``, which a GPU run starts with (a failure there leaves
    the pipelined path out of the rest), checks its calls on the CPU under the interpreter."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root / "kernels")}
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks/pipelined_check.py"), "--case", "48:4:150"],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pipelined check passed" in proc.stdout
    assert proc.stdout.count("rel. error") == 4
