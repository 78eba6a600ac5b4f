"""``python -m monarch_kernels.bench`` prints its table (a small CPU case, quickly)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_bench_prints_every_method_with_ratios_to_dense():
    proc = subprocess.run(
        [sys.executable, "-m", "monarch_kernels.bench", "--cases", "256:4:64,128:8:32",
         "--no-compile", "--min-time", "0.01", "--calls", "3"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "3 call(s) back to back" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "ms" not in line]
    methods = {row.split("|")[6].strip() for row in rows}
    assert methods == {"dense nn.Linear", "bmm pipeline", "fused op"}
    assert len(rows) == 6  # two cases x three methods
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        fwd_ms, fb_ms = float(cells[6]), float(cells[10])
        assert fwd_ms > 0 and fb_ms > 0
        assert cells[9].endswith("x") and cells[13].endswith("x")
    dense = [r for r in rows if "dense" in r]
    assert all(r.split("|")[10].strip() == "1.00x" for r in dense)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--calls", "0"], "--calls must be at least 1"),
        (["--paths", "blas,fastest"], "--paths: unknown fastest"),
    ],
)
def test_bench_refuses_bad_arguments(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "monarch_kernels.bench", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and message in proc.stderr
