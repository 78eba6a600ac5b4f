"""The bad-input catalogue: each mistake gets one clear error, and the system keeps working.

Cases run against the shared 2-rank cluster through a real IPython shell (magics, target specs,
cell code, pushed values), straight against the API (actors, kernels), and against a real
Jupyter server (the sidebar's REST API). After each, a follow-up cell (or request) must work.
Hypothesis fuzzes the %monarch argument parser and the push-item splitter.
"""

from __future__ import annotations

import threading
import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError
from monarch_kernels import MonarchLinear, monarch_matmul
from tornado.httpclient import HTTPClientError

from monarch_nb import ActorError, registry
from monarch_nb.actors import mesh as actors
from monarch_nb.notebook.magic import MonarchMagics
from monarch_nb.notebook.magic_args import pop_targets, split_items

pytest_plugins = ["pytest_jupyter.jupyter_server"]


# -- magics, targets, cell code and pushed values, through the shell ---------------------------
# (id, cell source, error type name, text the message must contain)
CELLS = [
    ("unknown-command", "%monarch frobnicate", "UsageError", "invalid choice: 'frobnicate'"),
    ("no-command", "%monarch", "UsageError", "needs a command"),
    ("unknown-flag", "%monarch status --bogus", "UsageError", "unrecognized arguments: --bogus"),
    ("cell-unknown-flag", "%%monarch --bogus\n1", "UsageError", "unrecognized arguments"),
    ("unbalanced-quote", "%monarch pull 'x", "UsageError", "No closing quotation"),
    ("cell-unbalanced-quote", "%%monarch --out 'x\n1", "UsageError", "No closing quotation"),
    ("up-while-up", "%monarch up --cpu", "UsageError", "already up"),
    ("connect-while-up", "%monarch connect tcp://127.0.0.1:9", "UsageError", "already up"),
    ("workers-not-int", "%monarch up --workers many", "UsageError", "invalid int value: 'many'"),
    ("timeout-not-float", "%%monarch --timeout soon\n1", "UsageError", "invalid float value"),
    ("run-no-script", "%monarch run no/such/script.py", "UsageError", "no script at"),
    ("target-out-of-range", "%%monarch --targets 7\n1", "UsageError", "rank 7 is out of range"),
    ("target-not-a-rank", "%%monarch -t x\n1", "UsageError", "'x' is not a rank"),
    ("target-empty-slice", "%%monarch -t 1:1\n1", "UsageError", "selects no ranks"),
    ("target-zero-step", "%%monarch -t ::0\n1", "UsageError", "step cannot be zero"),
    ("target-empty-item", "%%monarch -t 0,,1\n1", "UsageError", "has an empty item"),
    ("target-missing-value", "%monarch push a=1 --targets", "UsageError", "--targets needs"),
    ("pull-bad-target", "%monarch pull rank --targets 5", "UsageError", "rank 5 is out of range"),
    ("cell-syntax", "%%monarch\nx = (", "CellSyntaxError", "nothing was sent to the ranks"),
    ("cell-null-byte", "%%monarch\nx = '\0'", "CellSyntaxError", "null bytes"),
    ("cell-yield", "%%monarch\nyield 1", "CellError", "SyntaxError: 'yield' outside function"),
    ("cell-raises", "%%monarch\n1 / (rank - rank)", "CellError", "2 of 2 ranks failed"),
    ("cell-system-exit", "%%monarch\nraise SystemExit(3)", "CellError", "SystemExit: 3"),
    ("cell-unbound-name", "%%monarch\nnot_defined_here", "CellError", "NameError"),
    ("push-nothing", "%monarch push", "UsageError", "usage: %monarch push"),
    ("push-undefined", "%monarch push not_in_notebook", "UsageError", "is not defined"),
    ("push-not-a-name", "%monarch push 1+1", "UsageError", "is not a name; use NAME=EXPR"),
    ("push-raises", "%monarch push q=1/0", "UsageError", "ZeroDivisionError"),
    ("push-unpicklable", "%monarch push lk=threading.Lock()", "UsageError", "cannot be pickled"),
    ("push-unbalanced", "%monarch push a=(1", "UsageError", "push: cannot read"),
    ("push-double-star", "%monarch push **{'a': 1}", "UsageError", "**mapping is not supported"),
    ("pull-missing", "%monarch pull never_set", "UsageError", "not defined on ranks 0-1"),
    ("scatter-not-a-sequence", "%monarch scatter n 5", "UsageError", "needs a sequence"),
    ("scatter-no-value", "%monarch scatter n", "UsageError", "usage: %monarch scatter"),
    ("gather-missing", "%monarch gather never_set", "UsageError", "not defined on ranks 0-1"),
]


@pytest.mark.parametrize(
    ("source", "etype", "text"), [c[1:] for c in CELLS], ids=[c[0] for c in CELLS]
)
def test_bad_cells(cell, clean, source, etype, text):
    cell.shell.user_ns["threading"] = threading
    cell(source, expect_error=True)
    err = cell.error
    assert type(err).__name__ == etype, repr(err)
    assert text in str(err), str(err)
    if etype == "UsageError":
        assert "\n" not in str(err)  # one line: what went wrong and how to fix it
    assert cell("%%monarch\nrank").values() == [0, 1]  # the cluster is as it was


# -- actors and kernels, through the API -------------------------------------------------------
class Echo(actors.Actor):
    @actors.endpoint
    def echo(self, x):
        return x

    @actors.endpoint
    def fail(self):
        raise KeyError("no such entry")

    def helper(self):
        return 1


@pytest.fixture(scope="module")
def echoes(ctl):
    mesh = actors.proc_mesh(ctl).spawn("echoes", Echo)
    yield mesh
    mesh.stop().get(timeout=10)


def _spawn_plain_class(m):
    actors.proc_mesh().spawn("plain", dict)


def _spawn_unnamed(m):
    actors.proc_mesh().spawn("", Echo)


w1, w2 = torch.randn(3, 4, 4), torch.randn(2, 5, 6)  # x: (..., 12) -> (..., 10)
x = torch.randn(8, 12)

# (id, call taking the Echo mesh, exception type, text the message must contain)
API = [
    ("spawn-non-actor", _spawn_plain_class, TypeError, "needs a subclass of"),
    ("spawn-no-name", _spawn_unnamed, TypeError, "spawn needs a name"),
    ("endpoint-called-directly", lambda m: m.echo(1), TypeError, "call it with an adverb"),
    ("not-an-endpoint", lambda m: m.helper.call(), TypeError, "is not an endpoint"),
    ("unknown-endpoint", lambda m: m.nothing, AttributeError, "has no endpoint 'nothing'"),
    ("call-one-on-many", lambda m: m.echo.call_one(1), ValueError, "exactly one actor"),
    ("slice-unknown-dim", lambda m: m.slice(racks=0), ValueError, "cannot slice by 'racks'"),
    ("slice-out-of-range", lambda m: m.slice(gpus=9), IndexError, "out of range"),
    ("slice-bad-type", lambda m: m.slice(gpus="1"), TypeError, "takes an int or a slice"),
    (
        "unpicklable-argument",
        lambda m: m.echo.call(threading.Lock()),
        TypeError,
        "argument 0 (lock) cannot be pickled",
    ),
    ("endpoint-raises", lambda m: m.fail.call().get(timeout=30), ActorError, "KeyError"),
    ("kernel-int-dtype", lambda m: monarch_matmul(x.long(), w1, w2), TypeError, "floating dtype"),
    (
        "kernel-mixed-dtypes",
        lambda m: monarch_matmul(x.double(), w1, w2),
        TypeError,
        "mixed dtypes",
    ),
    ("kernel-not-a-tensor", lambda m: monarch_matmul([1.0], w1, w2), TypeError, "torch.Tensor"),
    ("kernel-scalar-input", lambda m: monarch_matmul(x[0, 0], w1, w2), ValueError, "dimension"),
    ("kernel-wrong-width", lambda m: monarch_matmul(x[:, :11], w1, w2), ValueError, "11"),
    ("kernel-w1-2d", lambda m: monarch_matmul(x, w1[0], w2), ValueError, "w1"),
    ("layer-zero-features", lambda m: MonarchLinear(0, 4), ValueError, "must be >= 1"),
    ("layer-zero-blocks", lambda m: MonarchLinear(8, 4, nblocks=0), ValueError, "nblocks=0"),
    (
        "layer-wrong-input",
        lambda m: MonarchLinear(8, 8, nblocks=2)(torch.randn(2, 9)),
        ValueError,
        "expected input (..., 8)",
    ),
]


@pytest.mark.parametrize(("call", "etype", "text"), [c[1:] for c in API], ids=[c[0] for c in API])
def test_bad_api_calls(clean, echoes, call, etype, text):
    with pytest.raises(etype) as info:
        call(echoes)
    message = str(info.value)
    assert text in message, message
    if etype is not ActorError:
        assert "\n" not in message
    assert echoes.echo.call("still here").get(timeout=30).values() == ["still here"] * 2
    assert MonarchLinear(12, 10, nblocks=3)(x).shape == (8, 10)


# -- the sidebar's REST API --------------------------------------------------------------------
@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"monarch_nb.server": True}}}


@pytest.fixture
def registered(tmp_path, monkeypatch):
    """One registered cluster whose scheduler and dashboard are not there (port 1)."""
    from types import SimpleNamespace

    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    ctl = SimpleNamespace(
        id=uuid.uuid4().hex,
        client=SimpleNamespace(dashboard_link="http://127.0.0.1:1/status"),
        scheduler_address="tcp://127.0.0.1:1",
        world_size=2,
        owns_cluster=True,
    )
    registry.register(ctl)
    return ctl.id


UNKNOWN = "0" * 32
BIG = b"x" * (2 * 2**20)
# (id, method, path below the server root, headers, body, status, text the message contains)
REQUESTS = [
    ("malformed-id", "GET", "monarch/api/clusters/not-an-id", None, None, 400, "malformed"),
    ("unknown-id", "GET", f"monarch/api/clusters/{UNKNOWN}", None, None, 404, "no cluster"),
    ("unknown-metrics", "GET", f"monarch/api/clusters/{UNKNOWN}/metrics", None, None, 404, ""),
    ("delete-unknown", "DELETE", f"monarch/api/clusters/{UNKNOWN}", None, None, 404, ""),
    ("traversal-id", "GET", "monarch/proxy/..%2F..%2Fapi/x", None, None, 400, ""),
    ("proxy-traversal", "GET", "monarch/proxy/{id}/a/%2e%2e/%2e%2e/api", None, None, 400, ""),
    ("proxy-dotdot", "GET", "monarch/proxy/{id}/../../api/contents", None, None, 400, ""),
    ("proxy-host-as-id", "GET", "monarch/proxy/127.0.0.1:22/x", None, None, 400, ""),
    ("no-token", "GET", "monarch/api/clusters", {"Authorization": ""}, None, 403, ""),
    ("wrong-token", "GET", "monarch/api/clusters", {"Authorization": "token no"}, None, 403, ""),
    (
        "wrong-token-delete",
        "DELETE",
        "monarch/api/clusters/{id}",
        {"Authorization": "token no"},
        None,
        403,
        "",
    ),
    ("post-not-allowed", "POST", "monarch/api/clusters", None, b"", 405, ""),
    ("get-with-a-body", "GET", "monarch/api/clusters", None, b"{}", 413, "no request body"),
    ("oversized-body", "DELETE", "monarch/api/clusters/{id}", None, BIG, 413, "no request body"),
]


@pytest.mark.parametrize(
    ("method", "path", "headers", "body", "status", "text"),
    [c[1:] for c in REQUESTS],
    ids=[c[0] for c in REQUESTS],
)
async def test_bad_requests(
    jp_serverapp, http_server_client, registered, method, path, headers, body, status, text
):
    token = jp_serverapp.identity_provider.token
    sent = {"Authorization": f"token {token}", **(headers or {})}
    url = "/a%40b/" + path.format(id=registered)  # raw: the client must not normalise it
    kw = {"allow_nonstandard_methods": True} if body else {}
    try:
        response = await http_server_client.fetch(
            url, method=method, headers=sent, body=body, raise_error=False, **kw
        )
    except HTTPClientError as e:
        response = e.response
    assert response.code == status, response.body[:200]
    assert text.encode() in (response.body or b"")
    assert registry.get_entry(registered) is not None  # nothing happened to the cluster
    ok = await http_server_client.fetch(
        f"/a%40b/monarch/api/clusters/{registered}",
        headers={"Authorization": f"token {token}"},
    )
    assert ok.code == 200


# -- fuzzing the parsers -----------------------------------------------------------------------
WORDS = st.sampled_from(
    [
        "up", "connect", "status", "down", "restart", "reset", "push", "pull", "scatter",
        "gather", "run", "auto", "metrics", "plot", "interrupt", "dashboard", "--targets", "-t",
        "--workers", "-n", "--cpu", "--threads", "--no-dist", "--backend", "--timeout",
        "--scheduler-file", "--cluster", "--save", "0", "-1", "1:3", "::2", "x", "'a b", '"',
        "=", "a=1", "--", "-",
    ]
)  # fmt: skip
ARGS = st.one_of(st.text(max_size=40), st.lists(WORDS, max_size=6).map(" ".join))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ARGS)
def test_fuzz_the_magic_argument_parser(shell, line):
    parser = MonarchMagics(shell).parser
    try:
        args = parser.parse_argstring(line)
    except UsageError as e:
        assert str(e)
        return
    except SystemExit as e:  # -h / --help printed the help
        assert e.code == 0 and ("-h" in line or "--help" in line)
        return
    assert args.command is None or isinstance(args.command, str)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_fuzz_the_push_item_splitter(text):
    try:
        items = split_items(text)
        targets, rest = pop_targets(text)
    except UsageError as e:
        assert "\n" not in str(e).strip("\n") or "\n" in text
        return
    assert isinstance(items, str) and isinstance(rest, str)
    assert targets is None or isinstance(targets, str)
