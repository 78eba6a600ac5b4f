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

HELPER = Path(__file__).parents[1] / "_kernel_helpers.py"


def _configs(config_set: str, kind: str):
    from monarch_kernels.configs import _cuda_configs, _hip_configs

    if config_set == "cuda":
        return _cuda_configs(kind)
    return _hip_configs(kind, arch=config_set.split("-", 1)[1])


def _interpret(config_set: str, directions: list[str]) -> None:
    # the launcher autotunes over the set (the interpreter takes its first config); the
    # directions in one process, which imports torch and Triton once
    backend = "hip" if config_set.startswith("hip") else "cuda"
    env = {**os.environ, "TRITON_INTERPRET": "1", "MONARCH_KERNELS_CONFIGS": backend}
    proc = subprocess.run(
        [sys.executable, str(HELPER), config_set, ",".join(directions)],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for direction in directions:
        passed = re.search(rf"^{direction}: (\d+) checks passed$", proc.stdout, re.M)
        assert passed and int(passed[1]) > 0, (direction, proc.stdout)


@pytest.mark.parametrize("config_set", ["cuda", "hip-gfx942", "hip-gfx950"])
def test_kernels_match_reference_under_interpreter(config_set):
    _interpret(config_set, ["forward", "backward"])


def test_custom_op_and_autograd_through_kernels_under_interpreter():
    # on its own: benchmarks/gpu_check.py's dry-run runs it in place of the GPU tests
    _interpret("cuda", ["op"])


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
                flag = {"stage": "TRANS_OUT"}.get(kind)
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

    for kind in ("stage", "wgrad"):
        cuda, mi300, mi355 = (
            _cuda_configs(kind),
            _hip_configs(kind, "gfx942"),
            _hip_configs(kind, "gfx950"),
        )
        assert cuda and mi300 and mi355
        assert all("waves_per_eu" in c.kwargs and "matrix_instr_nonkdim" in c.kwargs for c in mi300)
        assert not any("waves_per_eu" in c.kwargs for c in cuda)
        assert all(_fits(c, _SMEM_BYTES["gfx942"]) for c in mi300)
        assert len(mi355) >= len(mi300)


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
    assert [c.kwargs["BLOCK_M"] for c in configs.get_configs("wgrad")] == [128, 32]
    monkeypatch.setenv(configs.ENV_VAR, "BLOCK_M=64")
    with pytest.raises(ValueError, match="lacks BLOCK_C, BLOCK_O"):
        configs.get_configs("stage")
    monkeypatch.setenv(configs.ENV_VAR, "BLOCK_M=x")
    with pytest.raises(ValueError, match="KEY=INT"):
        configs.get_configs("stage")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="checks the no-GPU refusal")
def test_launcher_refuses_bad_input():
    import torch
    from monarch_kernels import triton_launch

    x, w1, w2 = torch.randn(4, 12), torch.randn(3, 4, 4), torch.randn(2, 5, 6)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        triton_launch.monarch_forward(x.double(), w1.double(), w2.double())
    with pytest.raises(ValueError, match="need a GPU"):
        triton_launch.monarch_forward(x, w1, w2)
    with pytest.raises(ValueError, match=r"path must be one of \('three_kernel', 'blas'\)"):
        triton_launch._path("fused")  # a deleted path, forced
    with pytest.raises(ValueError, match="expected x"):
        triton_launch._shapes(torch.randn(4, 13), w1, w2)


def test_path_choice_times_each_direction_once_per_batch_bucket(monkeypatch):
    """The chooser's bookkeeping, with the timing (which needs a GPU) answered by a table of
    times: the faster path wins and is kept per direction, weight shapes and batch bucket (the
    next power of two), and a shape first seen inside a graph capture takes three_kernel
    without being remembered."""
    import torch
    from monarch_kernels import triton_launch

    times = {"three_kernel": 1.0, "blas": 2.0}
    made = []

    def bench(fn):
        fn()
        return times[fn.path]

    def runs():
        made.append(1)
        out = {}
        for p in triton_launch.PATHS:
            out[p] = lambda: None
            out[p].path = p
        return out

    capturing = [False]
    monkeypatch.setattr(triton_launch, "_call_ms", bench)
    monkeypatch.setattr(triton_launch, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(triton_launch, "_path_choice", {})
    w = torch.randn(2, 4, 4)
    choose = triton_launch._choose
    assert choose("forward", torch.randn(100, 8), (w, w), runs) == "three_kernel"
    times.update(three_kernel=3.0)  # were it timed again, blas would win
    # 65 to 128 rows share the bucket of 128: timed once
    assert choose("forward", torch.randn(128, 8), (w, w), runs) == "three_kernel"
    assert choose("forward", torch.randn(65, 8), (w, w), runs) == "three_kernel"
    assert len(made) == 1
    assert choose("forward", torch.randn(129, 8), (w, w), runs) == "blas"  # the next bucket
    assert choose("backward", torch.randn(100, 8), (w, w, None), runs) == "blas"
    assert len(made) == 3
    capturing[0] = True
    assert choose("forward", torch.randn(1000, 8), (w, w), runs) == "three_kernel"
    assert len(made) == 3 and len(triton_launch._path_choice) == 3  # nothing timed or kept
    capturing[0] = False

    # a path that does not build here is left out, with a warning, and the other still runs
    def too_big():
        raise triton.OutOfResources(300000, 232448, "shared memory")

    def one_fails():
        out = runs()
        out["blas"] = too_big
        return out

    y = torch.randn(6, 8)
    with pytest.warns(RuntimeWarning, match="blas path failed here.*OutOfResources"):
        assert choose("forward", y, (w, w), one_fails) == "three_kernel"
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="no backward path runs"):
        choose("backward", y, (w, w, None), lambda: {"blas": too_big})


def test_blas_weight_gradients_use_the_vendor_gemm_only_where_it_is_deterministic(monkeypatch):
    """cuBLAS (reproducible by design) takes the blas path's weight gradients; ROCm builds
    (rocBLAS allows atomics) and torch's deterministic mode keep the split-reduction kernel.
    Both routes are checked against the reference under the interpreter."""
    import torch
    from monarch_kernels import triton_launch

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not triton_launch.vendor_weight_grads(cpu)
    monkeypatch.setattr(torch.version, "hip", None)
    assert triton_launch.vendor_weight_grads(cuda)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert not triton_launch.vendor_weight_grads(cuda)
    finally:
        torch.use_deterministic_algorithms(previous)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert not triton_launch.vendor_weight_grads(cuda)


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
    launch(a, a, 120, 4, 8, 8, 1)  # 120 rows: 100's bucket (128), the config chosen for 100
    launch(a, a, 200, 4, 8, 8, 1)  # the next bucket (256): autotuner (BLOCK_M 224)
    assert [(who, g) for who, g, _args, _kw in launches] == [
        ("tuner", ("callable",)),
        ("kernel", (32,)),
        ("tuner", ("callable",)),
        ("tuner", ("callable",)),
        ("tuner", ("callable",)),
        ("kernel", (96,)),
        ("kernel", (32,)),
        ("tuner", ("callable",)),
    ]
    assert launches[1][2] == (100, 4, 9, 9, 1) and launches[1][3]["BLOCK_M"] == 32


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
def test_register_table_reads_compiled_code():
    """``benchmarks/kernel_registers.py``: a row per config with the registers, spills and
    shared memory its compiled code declares, on both vendors."""
    root = Path(__file__).resolve().parents[2]
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
