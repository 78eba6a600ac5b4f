"""Launch plans (``monarch_kernels/replay.py``): what is recorded, what is refused, what a
replay computes.

The launcher here is a small one written for the test: it allocates, takes views and launches
a "kernel" through ``direct.launch``. The kernel is a Python object with Triton's
``kernel[grid](*args)`` calling convention that computes with torch, which is how
``direct.launch`` treats any kernel that is not a compiled Triton function (the interpreter's
among them). The Monarch launchers' own plans are checked in ``test_monarch_launch.py`` and,
for results, under the interpreter in ``test_monarch_triton.py``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from monarch_kernels import direct, replay  # noqa: E402


class _Kernel:
    """``out[:n] = 2 * inp[:n] + scale`` for a block of ``n`` rows at ``row``; counts launches."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid):
        def run(inp, out, row, n, scale=0):
            self.launches += 1
            out[row : row + n] = 2 * inp[row : row + n] + scale

        return run


def _launcher(kernel, x, *, extra=None):
    """Doubles x into a fresh tensor in two launches (the second on a view of rows 2:), plus
    whatever ``extra`` does to it."""
    out = x.new_empty(x.shape)
    direct.launch(kernel, (1,), (x, out, 0, 2), {"scale": 1})
    direct.launch(kernel, (1,), (x[2:], out[2:], 0, x.shape[0] - 2), {"scale": 1})
    return extra(out) if extra else out


def _call(kernel, x, **kw):
    key = ("test", *[(t.shape, t.stride(), t.dtype, t.data_ptr() % 16) for t in (x,)])
    return replay.call(key, (x,), lambda: _launcher(kernel, x, **kw))


def test_third_call_replays_on_the_new_tensors(replays):
    kernel = _Kernel()
    held = []
    for i in range(5):
        x = torch.arange(6.0) + 10 * i
        held.append(x)  # no address is reused
        got = _call(kernel, x)
        assert torch.equal(got, 2 * x + 1)
        assert got.data_ptr() not in {t.data_ptr() for t in held[:-1]}
        held.append(got)
    assert len(replays) == 3  # seen, recorded, then replayed
    assert kernel.launches == 10  # a replay makes the same launches


def test_replay_reads_an_input_at_its_own_offset(replays):
    kernel = _Kernel()
    storage = torch.arange(20.0)
    for _ in range(3):
        x = storage[4:10]  # a view whose data starts 16 bytes into the storage
        assert torch.equal(_call(kernel, x), 2 * x + 1)
    storage2 = torch.arange(20.0) * 3
    x2 = storage2[4:10]
    assert torch.equal(_call(kernel, x2), 2 * x2 + 1)
    assert len(replays) == 2


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(lambda out: out.clone(), id="a copy"),
        pytest.param(lambda out: out.add_(0), id="an in-place op"),
        pytest.param(lambda out: out[1:], id="a view as the result"),
    ],
)
def test_a_launcher_that_computes_with_torch_is_never_replayed(replays, extra):
    kernel = _Kernel()
    for _ in range(replay.MAX_TRIES + 3):
        x = torch.arange(6.0)
        assert torch.equal(_call(kernel, x, extra=extra), extra(2 * x + 1))
    assert replays == []


def test_recording_is_given_up_after_max_tries(replays, monkeypatch):
    kernel = _Kernel()
    recordings = []
    enter = replay.Recorder.__enter__
    monkeypatch.setattr(replay.Recorder, "__enter__", lambda s: recordings.append(1) or enter(s))

    def spoiling(out):
        replay.spoil()  # as the launchers do before Triton's autotuner launches
        return out

    for _ in range(replay.MAX_TRIES + 4):
        _call(kernel, torch.arange(6.0), extra=spoiling)
    assert len(recordings) == replay.MAX_TRIES and replays == []


def test_a_launcher_calling_another_is_not_recorded(replays):
    """The path choice runs each candidate path through the launcher inside the first
    caller's call: those timing launches must not become the caller's plan."""
    kernel = _Kernel()
    for _ in range(4):
        x = torch.arange(6.0)

        def choosing(out, x=x):
            replay.call(("candidate",), (x,), lambda: _launcher(kernel, x))  # a timing run
            return out

        assert torch.equal(_call(kernel, x, extra=choosing), 2 * x + 1)
    assert replays == []


def test_overlapping_inputs_are_not_recorded(replays):
    kernel = _Kernel()

    def launcher(a, b):
        out = a.new_empty(a.shape)
        direct.launch(kernel, (1,), (a, out, 0, a.shape[0]), {})
        return out

    base = torch.arange(8.0)
    for _ in range(4):
        a, b = base[:6], base[2:]  # b starts inside a
        got = replay.call(("overlap",), (a, b), lambda a=a, b=b: launcher(a, b))
        assert torch.equal(got, 2 * a)
    assert replays == []


def test_a_launch_outside_the_call_tensors_is_not_recorded(replays):
    kernel = _Kernel()
    scratch = torch.zeros(6)  # made before the call: neither an input nor an allocation

    def launcher(x):
        direct.launch(kernel, (1,), (x, scratch, 0, 6), {})
        return x.new_empty(0)

    for _ in range(4):
        x = torch.ones(6)
        replay.call(("outside",), (x,), lambda x=x: launcher(x))
    assert replays == []


def test_plans_can_be_turned_off(replays, monkeypatch):
    monkeypatch.setenv(replay.ENV_VAR, "0")
    assert not replay.enabled(interpreting=False)
    monkeypatch.delenv(replay.ENV_VAR)
    assert replay.enabled(interpreting=False)
    monkeypatch.setattr(replay, "ENABLED", None)
    assert replay.enabled(interpreting=False) and not replay.enabled(interpreting=True)
