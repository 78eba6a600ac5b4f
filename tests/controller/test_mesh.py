"""The device mesh: ``%monarch up --mesh``, ``%monarch mesh``, ``mesh`` on every rank, its
coordinates in ``%monarch status``, ``scale`` resizing it, and rank labels reaching the views;
on a real cluster of 4 worker processes with a real gloo group."""

from __future__ import annotations

import psutil
import pytest
from _wait import wait_for
from IPython.core.error import UsageError

from monarch_nb import CellError, errors
from monarch_nb.controller import mesh as device_mesh
from monarch_nb.notebook.panel_svg import panel_view, render
from monarch_nb.telemetry.figures import rank_view


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("dp=2,dp=2", "mesh: dp is named twice"),
        ("dp=0", "mesh: dp=0: a size is at least 1"),
        ("dp=two", "mesh: dp='two': a size is a whole number"),
        ("dp=²", "mesh: dp='²': a size is a whole number"),  # a digit to str.isdigit
        ("dp=" + "9" * 5000, "mesh: dp has 5000 digits: no cluster is that large"),
        ("2d=2", "mesh: '2d' is not a dimension name"),
        ("dp", "mesh: 'dp' has no size"),
        ({"dp": 2.5}, "mesh: dp=2.5: a size is a whole number"),
        (7, "mesh: give a mapping of names to sizes"),
    ],
)
def test_a_bad_shape_is_one_line(spec, says):
    with pytest.raises(ValueError, match="^" + says.replace("(", r"\(")) as e:
        device_mesh.parse(spec)
    assert "\n" not in str(e.value)


def test_shapes_their_coordinates_and_rescaling():
    shape = device_mesh.parse("dp=2, tp=3")
    assert shape == {"dp": 2, "tp": 3}
    assert device_mesh.parse({"pp": 2, "dp": 1}) == {"pp": 2, "dp": 1}  # the order is kept
    assert device_mesh.parse("off") is None
    assert [device_mesh.coordinates(shape, r) for r in (0, 1, 4, 5)] == [
        {"dp": 0, "tp": 0},
        {"dp": 0, "tp": 1},
        {"dp": 1, "tp": 1},
        {"dp": 1, "tp": 2},
    ]
    assert device_mesh.rescaled(shape, 9) == {"dp": 3, "tp": 3}
    with pytest.raises(ValueError, match=r"^8 ranks do not fit the mesh dp=2,tp=3: dp grows"):
        device_mesh.rescaled(shape, 8)
    with pytest.raises(ValueError, match=r"^mesh dp=2,tp=3 covers 6 ranks but the cluster has 4"):
        device_mesh.check_world(shape, 4)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_up_with_a_mesh_that_cannot_be_starts_nothing(cell, no_current):
    before = _children()
    for line, says in [
        ("--workers 2 --mesh dp=3", "mesh dp=3 covers 3 ranks but the cluster has 2 ranks"),
        ("--mesh dp=2 --no-dist", "a device mesh is built over the torch.distributed"),
        ("--mesh dp=2,tp=0", "mesh: tp=0: a size is at least 1"),
        ("--mesh dp=²", "mesh: dp='²': a size is a whole number, at least 1"),
        (
            "--mesh dp=99999999999999999999",
            "up --mesh dp=99999999999999999999 (99999999999999999999 ranks) is more than this "
            "machine can hold: ",
        ),
        ("--mesh dp=2 --mesh tp=2", "argument --mesh: given twice (dp=2 and tp=2); give the"),
    ]:
        cell(f"%monarch up --cpu {line}", expect_error=True)
        assert isinstance(cell.error, UsageError)
        assert str(cell.error).startswith(says) and "\n" not in str(cell.error)
        assert errors.current() is None
    assert _children() <= before


def test_every_rank_has_its_place_in_the_mesh(mesh4, cell):
    places = mesh4.run(
        "import torch, torch.distributed as dist\n"
        "t = torch.tensor([float(rank)])\n"
        "dist.all_reduce(t, group=mesh['tp'].get_group())\n"  # the two ranks of this tp group
        "(mesh.mesh_dim_names, tuple(mesh.get_coordinate()), t.item())"
    )
    assert places.values() == [
        (("dp", "tp"), (0, 0), 1.0),
        (("dp", "tp"), (0, 1), 1.0),
        (("dp", "tp"), (1, 0), 5.0),
        (("dp", "tp"), (1, 1), 5.0),
    ]
    assert [mesh4.coordinates(r) for r in (1, 2)] == [{"dp": 0, "tp": 1}, {"dp": 1, "tp": 0}]
    cell("%monarch status")
    head, *rows = cell.out.splitlines()
    assert head.split()[:5] == ["rank", "host", "pid", "device", "mesh"]
    assert "dp=1 tp=0" in rows[2] and "dp=0 tp=1" in rows[1]


def test_the_mesh_is_built_again_refused_and_dropped(mesh4, cell):
    cell("%monarch mesh tp=4")
    assert cell.out.splitlines()[0] == "monarch-nb: device mesh tp=4 built on every rank"
    assert mesh4.run("mesh.mesh_dim_names, mesh.size()").values() == [(("tp",), 4)] * 4
    cell("%monarch mesh dp=3", expect_error=True)
    assert str(cell.error).startswith("mesh dp=3 covers 3 ranks but the cluster has 4 ranks")
    assert mesh4.mesh_shape == {"tp": 4}

    cell("%monarch mesh off")
    assert cell.out.startswith("monarch-nb: no device mesh; %monarch mesh dp=4 builds one")
    with pytest.raises(CellError) as e:
        mesh4.run(
            "import torch\nfrom torch.distributed.fsdp import fully_shard\n"
            "fully_shard(torch.nn.Linear(2, 2), mesh=mesh)"
        )
    # every rank raises it, but one whose failure came first releases the others still running
    failure = next(err for err in e.value.errors.values() if err.ename != "Released")
    assert failure.ename == "RuntimeError"
    assert failure.evalue.startswith("this cluster has no device mesh: build one with %monarch")
    assert "monarch_nb" not in "\n".join(failure.traceback)  # the user's frames, torch's
    cell("%monarch status")
    assert "mesh" not in cell.out.splitlines()[0].split()


def test_scale_resizes_the_first_dimension_or_refuses(mesh4, cell):
    cell("%monarch scale 3", expect_error=True)
    assert str(cell.error) == (
        "3 ranks do not fit the mesh dp=2,tp=2: dp grows or shrinks and tp=2 stays, so the size "
        "must be a multiple of 2; or set another mesh first (%monarch mesh NAME=SIZE,...)"
    )
    assert mesh4.world_size == 4
    cell("%monarch scale 2")
    assert cell.out.rstrip().endswith("the device mesh is now dp=1,tp=2")
    assert mesh4.run("tuple(mesh.shape)").values() == [(1, 2)] * 2
    cell("%monarch scale 4")
    assert cell.out.rstrip().endswith("the device mesh is now dp=2,tp=2")
    assert mesh4.run("tuple(mesh.get_coordinate())").values() == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_labels_reach_status_the_metrics_and_the_panel(mesh4, cell):
    cell('%%monarch\nimport monarch_nb\nmonarch_nb.label(stage=f"s{rank}", part=None)')
    cell("%monarch status")
    head, *rows = cell.out.splitlines()
    assert head.split()[-1] == "labels"
    assert rows[3].split()[-1] == "stage=s3"

    def labelled() -> bool:
        got = {e["rank"]: e.get("labels") for e in mesh4.metrics.snapshot()["ranks"]}
        return all(got.get(r, {}).get("stage") == f"s{r}" for r in range(4))

    assert wait_for(labelled, timeout=15), "the ranks' labels did not reach the controller"
    snap = mesh4.metrics.snapshot()
    view = panel_view(snap, ranks=range(4))
    assert [r["labels"] for r in view["ranks"]] == [
        f"dp={d} tp={t} stage=s{2 * d + t}" for d in (0, 1) for t in (0, 1)
    ]
    assert "rank 2 · dp=1 tp=0 stage=s2" in render(view, "4 ranks")
    sidebar = rank_view({"workers": [], "metrics": snap})  # what the Jupyter server sends
    assert sidebar["ranks"][1]["labels"] == "dp=0 tp=1 stage=s1"

    with pytest.raises(CellError) as e:
        mesh4.run("monarch_nb.label(stage=[1])", targets=[0])
    assert e.value.errors[0].evalue == "label(): stage must be text or a number, got list"
    mesh4.run("monarch_nb.label(stage=None)")


def test_the_predefined_names_are_set_again_before_every_cell(clean, mesh4):
    """A cell's ``rank = 5`` or ``del mesh`` lasts that cell: the next cell, on every rank,
    reads the rank's own again (it read 5 on every rank, for good). A name of the cell's own
    (``display`` here) stays, as in IPython."""
    ident = "rank, world_size, local_rank, host == socket.gethostname(), str(device), repr(mesh)"
    changed = clean.run(
        "import socket\nrank, world_size, local_rank, host, device = 5, 0, 7, 'x', None\n"
        "del mesh\ndef display(*args):\n    return 'mine'\n"
        "for host in ['a', 'b']:\n    pass\nrank, host"
    )
    assert changed.values() == [(5, "b")] * 2  # the cell's own bindings stand within it
    assert clean.pull("rank").values() == [0, 1]  # a call reads them too
    no_mesh = "<no device mesh: %monarch mesh dp=N,... builds one>"
    assert clean.run(f"{ident}, display(1)").values() == [
        (0, 2, 0, True, "cpu", no_mesh, "mine"),
        (1, 2, 1, True, "cpu", no_mesh, "mine"),
    ]
    mesh4.run("mesh = rank = None")
    assert mesh4.run("rank, tuple(mesh.get_coordinate())").values() == [
        (0, (0, 0)),
        (1, (0, 1)),
        (2, (1, 0)),
        (3, (1, 1)),
    ]
