"""Every parallelism through a ``%%monarch`` cell against the same script under ``torchrun``,
and Monarch tensor parallelism against dense tensor parallelism, side by side.

    python benchmarks/bench_parallel.py [--ranks 2 4] [--steps 20] [--repeats 3]

For each world size and strategy of ``parallel_steps.py`` (ddp, fsdp, tp, pp; 2d at 4 ranks):

- ``torchrun``: ``torchrun --nproc-per-node N parallel_steps.py STRATEGY``, steps/s timed in
  the script between two barriers after a warm-up;
- ``cell``: the same ``timed()`` called from a cell on a monarch-nb cluster of N CPU ranks, the
  mesh built by ``%monarch mesh`` (``Controller.set_mesh``);
- ``cell, wall``: one cell running the steps, timed by the notebook from send to reply.

Medians of ``--repeats`` runs, the two ways taking turns. Target: a cell within 3% of torchrun.
Then the Monarch layer sharded by block against column/row-parallel dense layers
(``monarch_tp.py``): bytes moved per layer and step time at the same world sizes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import machine
import parallel_steps

HERE = Path(__file__).parent


def torchrun(strategy: str, world: int, steps: int) -> float:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(world),
            str(HERE / "parallel_steps.py"),
            strategy,
            "--steps",
            str(steps),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])["steps_per_s"]


def in_cell(ctl, strategy: str, steps: int) -> tuple[float, float]:
    """(steps/s on rank 0's clock, steps/s from the notebook's send to the reply)."""
    ctl.set_mesh(parallel_steps.mesh_shape(strategy, ctl.world_size))
    ctl.run(f"import parallel_steps\nstep = parallel_steps.make_step({strategy!r}, mesh)")
    rate = ctl.run(f"parallel_steps.timed({strategy!r}, mesh, {steps})").item(0)
    ctl.run("for _ in range(3):\n    step()")  # warm, as timed() is
    start = time.perf_counter()
    ctl.run(f"for _ in range({steps}):\n    step()")
    return rate, steps / (time.perf_counter() - start)


def strategies(world: int) -> list[str]:
    return [s for s in parallel_steps.STRATEGIES if s != "2d" or (world % 2 == 0 and world > 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-monarch-tp", action="store_true", help="skip the Monarch TP table")
    args = parser.parse_args()

    import monarch_nb

    print(f"# {machine.cpu()}")
    print(f"# {machine.versions(('torch', 'distributed'))}; gloo, CPU ranks")
    print(f"# {args.steps} steps a run, median of {args.repeats}; steps/s (higher is better)\n")
    print("| ranks | strategy | torchrun | cell | cell, wall | cell / torchrun |")
    print("|---|---|---|---|---|---|")
    for world in args.ranks:
        ctl = monarch_nb.up(workers=world, cpu=True, current=False)
        try:
            ctl.sync(str(HERE / "parallel_steps.py"))
            for strategy in strategies(world):
                runs, cells, walls = [], [], []
                for _ in range(args.repeats):
                    runs.append(torchrun(strategy, world, args.steps))
                    rate, wall = in_cell(ctl, strategy, args.steps)
                    cells.append(rate)
                    walls.append(wall)
                t, c, w = (statistics.median(x) for x in (runs, cells, walls))
                print(f"| {world} | {strategy} | {t:.1f} | {c:.1f} | {w:.1f} | {c / t:.3f} |")
        finally:
            ctl.down()
    if not args.no_monarch_tp:
        import monarch_tp

        rows = monarch_tp.run(worlds=args.ranks, steps=args.steps)
        print("\n# Monarch TP against dense TP: width 1024, 4 blocks, batch 512, float32")
        print(monarch_tp.table(rows))


if __name__ == "__main__":
    main()
