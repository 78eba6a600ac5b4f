import pytest
from hypothesis import given
from hypothesis import strategies as st

from monarch_nb.dispatch.targets import TargetError, compact, format_ranks, parse_targets


@pytest.mark.parametrize(
    ("spec", "n", "ranks"),
    [
        ("all", 4, [0, 1, 2, 3]),
        (None, 3, [0, 1, 2]),
        ("0", 4, [0]),
        ("-1", 4, [3]),
        ("0,2", 4, [0, 2]),
        ("1:3", 4, [1, 2]),
        ("::2", 5, [0, 2, 4]),
        ("3:", 5, [3, 4]),
        ("0, 2:4", 5, [0, 2, 3]),
        (2, 4, [2]),
        ([3, 1, 1], 4, [1, 3]),
        (range(2), 4, [0, 1]),
    ],
)
def test_specs(spec, n, ranks):
    assert parse_targets(spec, n) == ranks


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("4", "rank 4 is out of range"),
        ("-5", "out of range"),
        ("a", "'a' is not a rank"),
        ("0,,1", "empty item"),
        ("", "empty target spec"),
        ("::0", "step cannot be zero"),
        ("3:1", "selects no ranks"),
        ("1:2:3:4", "is not a slice"),
        ("0:9", "9 is out of range"),
        ([], "empty"),
        (["0"], "not an integer rank"),
        (True, "not a rank"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(TargetError, match=message):
        parse_targets(spec, 4)


def test_no_ranks():
    with pytest.raises(TargetError, match="no ranks"):
        parse_targets("all", 0)


def test_format():
    assert format_ranks([1]) == "rank 1"
    assert format_ranks([3, 0, 1, 2]) == "ranks 0-3"
    assert format_ranks([0, 2, 3, 7]) == "ranks 0,2-3,7"
    assert compact([]) == ""


@given(st.text(max_size=12), st.integers(min_value=1, max_value=9))
def test_parser_never_fails_unexpectedly(spec, n):
    try:
        ranks = parse_targets(spec, n)
    except TargetError as e:
        assert "\n" not in str(e)
        return
    assert ranks and ranks == sorted(set(ranks))
    assert all(0 <= r < n for r in ranks)


@given(
    st.integers(min_value=1, max_value=12),
    st.one_of(st.none(), st.integers(-14, 14)),
    st.one_of(st.none(), st.integers(-14, 14)),
    st.one_of(st.none(), st.integers(-3, 3).filter(bool)),
)
def test_slices_match_python(n, start, stop, step):
    spec = ":".join("" if v is None else str(v) for v in (start, stop, step))
    expected = list(range(n))[slice(start, stop, step)]
    in_range = all(v is None or -n <= v <= n for v in (start, stop))
    if expected and in_range:
        assert parse_targets(spec, n) == sorted(expected)
    else:
        with pytest.raises(TargetError):
            parse_targets(spec, n)
