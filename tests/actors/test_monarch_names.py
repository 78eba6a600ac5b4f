"""docs/actors.md's table has a row for every name torchmonarch's ``monarch.actor`` exports, and
says the truth about each: a name it calls the same or different is in ``monarch_nb.actor``; one
it calls absent is not."""

from __future__ import annotations

import re
from pathlib import Path

import monarch_nb.actor

DOC = Path(__file__).resolve().parent.parent.parent / "docs" / "actors.md"
# monarch.actor.__all__ in meta-pytorch/monarch at commit 3fc0a66e3 (tests/monarch_examples/)
MONARCH_ACTOR = [
    "Accumulator",
    "Actor",
    "ActorError",
    "current_actor_name",
    "as_endpoint",
    "current_rank",
    "current_size",
    "concurrent_endpoint",
    "endpoint",
    "Future",
    "Point",
    "ProcMesh",
    "ProcId",
    "Channel",
    "send",
    "shutdown_context",
    "ValueMesh",
    "debug_controller",
    "get_or_spawn_controller",
    "this_host",
    "this_proc",
    "default_bootstrap_cmd",
    "HostMesh",
    "context",
    "hosts_from_config",
    "Port",
    "PortReceiver",
    "Endpoint",
    "Extent",
    "run_worker_loop_forever",
    "attach_to_workers",
    "attach",
    "enable_transport",
    "Context",
    "ChannelTransport",
    "unhandled_fault_hook",
    "MeshFailure",
    "config",
    "get_meter",
    "span",
    "traced",
    "Uid",
]


def table() -> dict[str, str]:
    """Each name in the first column of the table of Monarch's names, and what its row says."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[1] not in ("same", "different", "accepted", "absent"):
            continue
        for name in re.findall(r"`([A-Za-z_.]+)", cells[0]):
            for part in name.split("."):  # `HostMesh.spawn_procs`: a row for both
                rows.setdefault(part, cells[1])
    return rows


def test_every_name_of_monarch_actor_has_a_row_that_tells_the_truth():
    rows = table()
    missing = [name for name in MONARCH_ACTOR if name not in rows]
    assert not missing, f"docs/actors.md has no row for {missing}"
    for name in MONARCH_ACTOR:
        here = hasattr(monarch_nb.actor, name)
        assert here == (rows[name] != "absent"), f"{name}: the table says {rows[name]}"
