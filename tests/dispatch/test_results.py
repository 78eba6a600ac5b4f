"""How a cell's failures read (dispatch/results.py's CellError), without a cluster."""

from __future__ import annotations

from monarch_nb.dispatch.results import CellError, RemoteError, ValueMesh


def test_lost_hosts_read_one_line_each():
    hosts = {r: f"n{r // 4:02d}" for r in range(16)}
    why = "the worker is out of reach: its connection timed out"
    errors = {
        r: RemoteError(r, hosts[r], "WorkerLost", f"on {hosts[r]}: {why}", []) for r in range(8, 16)
    }
    err = CellError(errors, ValueMesh({r: r for r in range(8)}), list(range(16)))
    assert err._render_traceback_() == [
        "8 of 16 ranks failed",
        "",
        "[ranks 8-15] WorkerLost, each rank's message below",
        f"[ranks 8-11] WorkerLost: on n02: {why}",
        f"[ranks 12-15] WorkerLost: on n03: {why}",
    ]
