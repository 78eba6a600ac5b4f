"""Registers, spills and shared memory of every kernel config, read from compiled code: no GPU.

    PYTHONPATH=kernels:tests python benchmarks/kernel_registers.py \
        [--targets sm_90,gfx942] [--kinds ...]

Each config of a target's set (the CUDA set for sm_90, the HIP sets for gfx942 and gfx950) is
compiled ahead of time as the launchers specialise it at width 4096 with 64 blocks, in
bfloat16 (``tests/_aot.py``). For each: registers a thread (on AMD, vector registers a lane,
the accumulation registers included), bytes a thread (lane) spills to memory, shared memory
(LDS on AMD) a program, and how many programs one SM (CU) holds by registers and by shared
memory: a memory-bound kernel hides latency with the programs it holds. The NVIDIA figures
come from ``cuobjdump`` on the cubin, the AMD ones from the code object's metadata.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from _aot import LAUNCH_CONSTANTS, compile_config
from monarch_kernels import configs

TARGETS = {  # name: (backend, arch, warp size, config set)
    "sm_90": ("cuda", 90, 32, "cuda"),
    "gfx942": ("hip", "gfx942", 64, "gfx942"),
    "gfx950": ("hip", "gfx950", 64, "gfx950"),
}
# per SM / CU: registers (NVIDIA: 32-bit registers; AMD: a SIMD's 512 vector registers a lane,
# four SIMDs a CU), shared memory / LDS bytes
SM = {"sm_90": (65536, 228 * 1024), "gfx942": (512, 64 * 1024), "gfx950": (512, 160 * 1024)}


def usage(binary, target: str, warps: int) -> tuple[int, int, int, int, int]:
    """(registers, spilled bytes, shared bytes, programs an SM/CU holds by registers, by shared)."""
    shared = binary.metadata.shared
    regs_per_sm, shared_per_sm = SM[target]
    if target.startswith("sm_"):
        tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(binary.asm["cubin"])
            f.flush()
            out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                                 text=True, check=True).stdout  # fmt: skip
        regs = int(re.search(r"REG:(\d+)", out).group(1))
        spill = int(re.search(r"STACK:(\d+)", out).group(1))
        by_regs = regs_per_sm // (-(-regs // 8) * 8 * 32 * warps)
    else:
        meta = binary.asm["amdgcn"]

        def field(name: str) -> int:
            found = re.search(rf"\.{name}:\s+(\d+)", meta)
            return int(found.group(1)) if found else 0

        regs = field("vgpr_count") + field("agpr_count")
        spill = 4 * field("vgpr_spill_count")  # to scratch memory (SGPRs spill to lanes)
        waves_per_simd = min(8, regs_per_sm // (-(-regs // 8) * 8))
        by_regs = 4 * waves_per_simd // warps  # a workgroup's waves spread over 4 SIMDs
    by_shared = shared_per_sm // shared if shared else 99
    return regs, spill, shared, by_regs, by_shared


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--targets", default="sm_90,gfx942")
    parser.add_argument("--kinds", default=",".join(LAUNCH_CONSTANTS))
    args = parser.parse_args()
    print("registers and shared memory from compiled code (width 4096, 64 blocks, bfloat16)\n")
    columns = ("kind", "config", "target", "registers", "spilled B", "shared KB")
    print(f"| {' | '.join(columns)} | programs/SM by regs | by shared |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for target in args.targets.split(","):
        set_name = TARGETS[target][3]
        for kind in args.kinds.split(","):
            sets = (
                configs._cuda_configs(kind)
                if set_name == "cuda"
                else configs._hip_configs(kind, set_name)
            )
            for cfg in sets:
                shape = "/".join(
                    f"{k.removeprefix('BLOCK_')}{v}"
                    for k, v in cfg.kwargs.items()
                    if k.startswith("BLOCK_")
                )
                if cfg.kwargs.get("DENSE"):
                    shape += " dense"
                if "PARTS" in cfg.kwargs:
                    shape += f" parts{cfg.kwargs['PARTS']}"
                shape += f" w{cfg.num_warps} s{cfg.num_stages}"
                if "waves_per_eu" in cfg.kwargs:
                    shape += f" wpe{cfg.kwargs['waves_per_eu']}"
                regs, spill, shared, by_regs, by_shared = usage(
                    compile_config(kind, cfg, TARGETS[target][:3]), target, cfg.num_warps
                )
                row = (kind, shape, target, regs, spill, f"{shared / 1024:.0f}", by_regs, by_shared)
                print(f"| {' | '.join(map(str, row))} |")


if __name__ == "__main__":
    main()
