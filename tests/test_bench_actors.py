"""``benchmarks/bench_actors.py``'s Monarch-API path (issue 51) cannot rot between full runs: a
tiny run of ``monarch_nb.actor`` prints its row, with numbers, and only the table asked for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_actors.py"


def test_the_monarch_api_path_prints_its_row(runtime):
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--only", "monarch-api", "--actors", "2", "--rounds", "1",
         "--calls", "3", "--warmup", "1", "--timeout", "100"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "Monarch API (issue 51)" in out and "1000 broadcasts" not in out, out
    rows = [line.split() for line in out.splitlines() if line.startswith("monarch_nb.actor ")]
    assert len(rows) == 1 and "not" not in rows[0], out
    _, actors, start, _, one_med, one_p90, _, send_med, send_p90, _ = rows[0]
    assert actors == "2"
    assert all(float(v) > 0 for v in (start, one_med, one_p90, send_med, send_p90)), out
    assert "target" not in out  # no torchmonarch asked for: nothing to compare against
