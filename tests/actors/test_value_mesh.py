"""ValueMesh, Extent and Point as torchmonarch has them: the strings are what torchmonarch 0.7.0
printed for the same meshes (its ValueMesh built from a Shape over the values ``v0``..``v5``)."""

import pickle

import pytest

from monarch_nb.actors.actor import Point
from monarch_nb.actors.value_mesh import Extent, ValueMesh


def xy() -> Extent:
    return Extent(["x", "y"], [2, 3])


def mesh() -> ValueMesh:
    return ValueMesh(xy(), [f"v{i}" for i in range(6)])


# Extent


def test_extent_prints_as_torchmonarch_does():
    assert str(xy()) == repr(xy()) == "{x: 2, y: 3}"
    assert str(Extent([], [])) == "{}"
    # labels that are not [A-Za-z0-9_]* are quoted, as torchmonarch's Rust Display quotes them
    assert str(Extent(["it's", 'a"b', "é", "dim/0"], [2, 1, 1, 3])) == (
        '{"it\'s": 2, "a\\"b": 1, "é": 1, "dim/0": 3}'
    )


def test_extent_reads_like_a_mapping():
    assert xy().labels == ["x", "y"] and xy().sizes == [2, 3]
    assert xy().nelements == 6 and Extent([], []).nelements == 1
    assert dict(xy()) == {"x": 2, "y": 3} and list(xy()) == ["x", "y"] and len(xy()) == 2
    assert xy()["y"] == 3 and "y" in xy() and "z" not in xy() and xy().get("z") is None
    with pytest.raises(KeyError, match=r"'z' is not a dimension of \{x: 2, y: 3\}"):
        xy()["z"]


def test_extent_equality():
    assert xy() == Extent(["x", "y"], [2, 3])
    assert xy() != Extent(["y", "x"], [3, 2])  # order matters between Extents, as in torchmonarch
    assert xy() != Extent(["x", "y"], [2, 4])
    assert xy() == {"x": 2, "y": 3}  # torchmonarch says False; monarch_nb compares with dicts
    assert xy() != {"x": 2} and xy() != 1
    with pytest.raises(TypeError, match="unhashable"):
        hash(xy())


def test_extent_pickles():
    back = pickle.loads(pickle.dumps(xy()))
    assert isinstance(back, Extent) and back == xy() and str(back) == "{x: 2, y: 3}"


@pytest.mark.parametrize(
    ("labels", "sizes", "error", "message"),
    [
        (["x"], [2, 3], ValueError, "1 labels and 2 sizes: give one size per label"),
        (["x", "x"], [2, 3], ValueError, "labels must differ: 'x' given more than once"),
        (["x"], [-1], ValueError, r"cannot be negative \(x=-1\)"),
        ([1], [2], TypeError, "labels are strings, not int 1"),
        ("xy", [2, 3], TypeError, "a list of labels, not the string 'xy'"),
        (["x"], [2.0], TypeError, r"sizes are ints, not float \(x=2.0\)"),
    ],
)
def test_extent_refuses_what_is_not_an_extent(labels, sizes, error, message):
    with pytest.raises(error, match=message):
        Extent(labels, sizes)


# Point


def test_point_prints_as_torchmonarch_does():
    assert repr(Point(4, xy())) == str(Point(4, xy())) == "{'x': 1/2, 'y': 1/3}"
    assert repr(Point(0, Extent([], []))) == repr(Point(0, {})) == "{}"
    assert repr(Point(1, Extent(["rank"], [4]))) == "{'rank': 1/4}"


def test_point_extent_and_size():
    point = Point(4, {"x": 2, "y": 3})  # a dict is taken and kept as an Extent
    assert isinstance(point.extent, Extent) and point.extent == xy()
    assert point.size("x") == 2 and point.size("y") == 3
    with pytest.raises(KeyError, match="'z' is not a dimension"):
        point.size("z")
    assert dict(point) == {"x": 1, "y": 1} and point.rank == 4


def test_point_pickles():
    back = pickle.loads(pickle.dumps(Point(4, xy())))
    assert back == Point(4, xy()) and isinstance(back.extent, Extent)
    assert repr(back) == "{'x': 1/2, 'y': 1/3}"


# ValueMesh


def test_repr_is_torchmonarchs():
    assert repr(mesh()) == (
        "ValueMesh({x: 2, y: 3}):\n"
        "  (({'x': 0/2, 'y': 0/3}, 'v0'),\n"
        "   ({'x': 0/2, 'y': 1/3}, 'v1'),\n"
        "   ({'x': 0/2, 'y': 2/3}, 'v2'),\n"
        "   ({'x': 1/2, 'y': 0/3}, 'v3'),\n"
        "   ({'x': 1/2, 'y': 1/3}, 'v4'),\n"
        "   ({'x': 1/2, 'y': 2/3}, 'v5'))"
    )
    row = "ValueMesh({x: 2}):\n  (({'x': 0/2}, 'v1'), ({'x': 1/2}, 'v4'))"
    assert repr(mesh().slice(y=1)) == row
    assert repr(mesh().slice(x=1, y=2)) == "ValueMesh({}):\n  (({}, 'v5'),)"


def test_item():
    values = mesh()
    assert [values.item(x=x, y=y) for x in (0, 1) for y in (0, 1, 2)] == values.values()
    assert values.item(x=-1, y=-1) == "v5"  # from the end, as ActorMesh.slice counts
    assert values.slice(x=1, y=2).item() == "v5"


def test_item_mistakes():
    values = mesh()
    with pytest.raises(KeyError, match=r"item\(\) needs y= too: this ValueMesh is \{x: 2, y: 3\}"):
        values.item(x=1)
    with pytest.raises(KeyError, match=r"item has extra dimensions: \['z'\]"):
        values.item(x=1, y=2, z=0)
    with pytest.raises(IndexError, match=r"item\(y=3\) is out of range: y has size 3"):
        values.item(x=0, y=3)  # torchmonarch returns v3 here: x=0, y=3 is rank 3 in its numbering
    with pytest.raises(IndexError, match=r"item\(y=3\)"):
        values.slice(y=slice(0, 2)).item(x=0, y=3)
    with pytest.raises(TypeError, match=r"item\(x=...\) takes an int, not str 'a'"):
        values.item(x="a", y=0)


def test_items_values_iteration_len_get():
    values = mesh()
    points = [point for point, _ in values.items()]
    assert all(isinstance(p, Point) and p.extent == xy() for p in points)
    assert [p.rank for p in points] == list(range(6))
    assert [dict(p) for p in points[:2]] == [{"x": 0, "y": 0}, {"x": 0, "y": 1}]
    assert [v for _, v in values.items()] == values.values() == [f"v{i}" for i in range(6)]
    assert list(values) == list(values.items())
    assert len(values) == 6 and values.get(5) == "v5" and values.get(-1) == "v5"
    with pytest.raises(ValueError, match=r"get\(6\) is out of range: this ValueMesh holds 6"):
        values.get(6)
    assert values.extent == xy() and values.sizes == {"x": 2, "y": 3}
    assert values.size() == 6 and values.size("y") == 3 and values.size(["x", "y"]) == 6
    with pytest.raises(KeyError, match="'z' is not a dimension"):
        values.size("z")


def test_slice_by_int_drops_the_dimension_and_points_are_local():
    row = mesh().slice(y=1)
    assert row.extent == Extent(["x"], [2]) and row.values() == ["v1", "v4"]
    assert [(p.rank, dict(p), p.extent) for p, _ in row.items()] == [
        (0, {"x": 0}, Extent(["x"], [2])),
        (1, {"x": 1}, Extent(["x"], [2])),
    ]
    assert row.item(x=1) == "v4" and row.get(1) == "v4"


def test_slice_by_slice_keeps_the_dimension():
    part = mesh().slice(y=slice(1, 3))
    assert part.extent == Extent(["x", "y"], [2, 2])
    assert part.values() == ["v1", "v2", "v4", "v5"]
    assert [dict(p) for p, _ in part.items()][-1] == {"x": 1, "y": 1}
    assert part.item(x=1, y=0) == "v4"
    assert mesh().slice(y=slice(-1, None)).values() == ["v2", "v5"]
    assert mesh().slice(y=slice(0, 10)).values() == mesh().values()
    assert mesh().slice().values() == mesh().values()
    # torchmonarch refuses a step on an inner dimension ("nonrectangular shape")
    assert mesh().slice(y=slice(None, None, 2)).values() == ["v0", "v2", "v3", "v5"]
    assert mesh().slice(y=slice(None, None, -1)).values() == ["v2", "v1", "v0", "v5", "v4", "v3"]


def test_slice_mistakes():
    with pytest.raises(TypeError, match="Shape does not have dimension labeled 'z'"):
        mesh().slice(z=0)
    with pytest.raises(IndexError, match=r"slice\(x=5\) is out of range: x has size 2"):
        mesh().slice(x=5)
    with pytest.raises(ValueError, match="y=2:1 selects nothing"):
        mesh().slice(y=slice(2, 1))
    with pytest.raises(TypeError, match="takes an int, not True"):
        mesh().slice(x=True)


def test_flatten():
    flat = mesh().flatten("rank")
    assert flat.extent == Extent(["rank"], [6]) and flat.values() == mesh().values()
    assert flat.item(rank=4) == "v4"
    assert repr(flat).startswith("ValueMesh({rank: 6}):\n  (({'rank': 0/6}, 'v0'),\n")
    # torchmonarch: "cannot flatten sparse mesh"
    assert mesh().slice(y=slice(1, 3)).flatten("r").values() == ["v1", "v2", "v4", "v5"]


def test_construction():
    assert ValueMesh({"x": 2, "y": 3}, range(6)).extent == xy()
    with pytest.raises(ValueError, match=r"a ValueMesh of \{x: 2, y: 3\} holds 6 values .*got 2"):
        ValueMesh(xy(), [1, 2])


def test_pickles():
    part = mesh().slice(y=slice(1, 3))
    back = pickle.loads(pickle.dumps(part))
    assert isinstance(back, ValueMesh) and repr(back) == repr(part)
