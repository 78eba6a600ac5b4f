"""The arguments of ``%monarch COMMAND`` and ``%%monarch``: the parsers (the commands and their
options are written once, here) and the readers of push and scatter's Python expressions, which
argparse would split on their spaces."""

from __future__ import annotations

import argparse
import io
import re
import shlex
import tokenize

from IPython.core.error import UsageError
from IPython.core.magic_arguments import MagicArgumentParser

from monarch_nb.controller import start
from monarch_nb.notebook.rank_groups import GROUP_FROM

_TARGETS_HELP = "ranks: all, 0, 0,2, 1:3 or ::2"


class Parser(MagicArgumentParser):
    r"""IPython's parser with ``-h/--help`` (IPython leaves it out) in argparse's plain layout
    (IPython's is reStructuredText for docstrings: a ``::`` line and a second ``%``), words
    split as a shell splits them, and an unbalanced quote reported as a UsageError (shlex
    raises ValueError) like every other mistake in the arguments. ``commands`` lists the
    sub-commands once they are added.

    IPython splits magic arguments keeping the quotes (``posix=False``), so ``%monarch sync
    'dir with spaces'`` looked for a path with quotes in its name; here ``'a b'``, ``"a b"``
    and ``a\ b`` are the path ``a b``, for every path (sync, run and its script's arguments,
    plot --save, connect's files)."""

    def __init__(self, *args, add_help=True, formatter_class=argparse.HelpFormatter, **kwargs):
        super().__init__(*args, add_help=add_help, formatter_class=formatter_class, **kwargs)
        self.commands: list[str] = []

    def parse_argstring(self, argstring):
        try:
            return self.parse_args(shlex.split(argstring))
        except ValueError as e:
            raise UsageError(f"cannot read the arguments {argstring.strip()!r}: {e}") from None


def line_parser() -> Parser:
    parser = Parser(
        prog="%monarch", description="Control the cluster (see %monarch? for examples)."
    )
    sub = parser.add_subparsers(dest="command", parser_class=Parser, metavar="COMMAND")
    p = sub.add_parser("up", help="start a local cluster: one worker per GPU, or 2 CPU workers")
    p.add_argument(
        "--workers", "-n", type=int, default=None, metavar="N", help="default: one per GPU, else 2"
    )
    p.add_argument("--cpu", action="store_true", help="CPU workers even where GPUs are visible")
    p.add_argument("--threads", type=int, default=1, metavar="T", help="threads per worker")
    p.add_argument(
        "--tls", action="store_true", help="TLS on every Dask comm, with temporary certificates"
    )
    p.add_argument(
        "--keep",
        nargs="?",
        const=True,
        default=None,
        metavar="IDLE",
        help="outlive this kernel (%%monarch detach, then %%monarch attach in any kernel); "
        "shut down after IDLE without a kernel: 90s, 30m, 2h (the default), 1d",
    )
    p.add_argument("--name", default=None, help="a kept cluster's name (default: the notebook's)")
    _dist(p)
    _mesh(p)
    _ft(p)
    p = sub.add_parser("attach", help="attach to a kept cluster (up --keep); lists them")
    p.add_argument("name", nargs="?", default=None, metavar="NAME")
    p.add_argument(
        "--take", action="store_true", help="detach the kernel that holds it and attach here"
    )
    sub.add_parser("detach", help="let go of a kept cluster; it keeps running, state and all")
    sub.add_parser("actors", help="the live actor meshes; monarch_nb.actor_mesh(NAME) gets one")
    p = sub.add_parser("connect", help="join a scheduler or wrap a distributed cluster object")
    p.add_argument("address", nargs="?")
    p.add_argument("--scheduler-file")
    p.add_argument("--cluster", metavar="MODULE:FACTORY")
    p.add_argument(
        "--timeout",
        type=seconds,
        default=8,
        metavar="S",
        help="seconds to reach the scheduler (default: %(default)g)",
    )
    p.add_argument(
        "--workers", "-n", type=int, default=None, metavar="N", help="wait for this many workers"
    )
    p.add_argument(
        "--wait",
        type=seconds,
        default=start.DEFAULT_WAIT,
        metavar="S",
        help="seconds for the workers to join, jobs in a batch queue too (default: %(default)g)",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="join a TLS scheduler with the certificates in Dask's distributed.comm.tls config",
    )
    p.add_argument("--tls-ca-file", metavar="PEM", help="the CA that signed the cluster's certs")
    p.add_argument("--tls-cert", metavar="PEM", help="this client's certificate")
    p.add_argument("--tls-key", metavar="PEM", help="this client's private key")
    _dist(p)
    _mesh(p)
    _ft(p)
    p = sub.add_parser("scale", help="grow or shrink to N ranks; the process group forms again")
    p.add_argument("n", type=int, metavar="N", help="the number of ranks (at least 1)")
    p.add_argument(
        "--wait",
        type=seconds,
        default=None,
        metavar="S",
        help="seconds for new workers to join (default: 60 locally, else 600)",
    )
    p = sub.add_parser("kill", help="SIGKILL a rank's worker (to see fault tolerance at work)")
    p.add_argument("rank", type=int, metavar="RANK")
    p = sub.add_parser("mesh", help="a device mesh on every rank (dp=2,tp=2), or show it")
    p.add_argument(
        "shape",
        nargs="?",
        default=None,
        metavar="SHAPE",
        help="NAME=SIZE,... whose sizes multiply to the world size; off drops it",
    )
    p = sub.add_parser("run", help="run a torchrun-style script on every rank")
    p.add_argument(
        "-m",
        dest="module",
        action="store_true",
        help="SCRIPT names a module the ranks can import, run as python -m SCRIPT",
    )
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    _targets(p)
    p = sub.add_parser("status", help="a table of the ranks")
    p.add_argument(
        "--ranks",
        action="store_true",
        help=f"a row per rank (from {GROUP_FROM} ranks, ranks alike share a row)",
    )
    for name, text in [
        ("down", "stop or leave the cluster"),
        ("restart", "fresh worker processes, same ranks, empty namespaces"),
        ("metrics", "the latest logged values and telemetry of every rank"),
        ("dashboard", "a live panel of every rank's GPU and loss, until the cluster goes down"),
    ]:
        sub.add_parser(name, help=text)
    p = sub.add_parser("auto", help="toggle: run every following cell on the workers")
    p.add_argument("state", nargs="?", choices=("on", "off"), help="set it instead of toggling")
    p = sub.add_parser("plot", help="the logged metrics as a static bokeh figure")
    p.add_argument("--save", metavar="FILE", help="write a standalone .html file")
    p = sub.add_parser("profile", help="show a profiled cell's timeline again")
    p.add_argument("--last", action="store_true", help="the last profile of this cluster")
    p.add_argument("folder", nargs="?", metavar="DIR", help="a profile's folder")
    p = sub.add_parser("reset", help="clear the namespaces")
    _targets(p)
    p = sub.add_parser("interrupt", help="interrupt the running cell on the ranks")
    _targets(p)
    p = sub.add_parser("stacks", help="every thread's stack on the ranks, while a cell runs")
    p.add_argument("--native", action="store_true", help="C frames too, through py-spy")
    p.add_argument("--all", action="store_true", help="the worker's own threads too")
    _targets(p)
    p = sub.add_parser("debug", help="pdb on a rank's traceback of the last failed cell")
    p.add_argument(
        "--rank", type=int, default=None, metavar="R", help="default: the lowest that failed"
    )
    p = sub.add_parser("sync", help="send files or package folders to the ranks' sys.path")
    p.add_argument("paths", nargs="+", metavar="PATH", help="a file or a folder (a package)")
    _targets(p)
    p = sub.add_parser("autoreload", help="reload changed modules on the ranks before each cell")
    p.add_argument("state", choices=("on", "off"))
    p = sub.add_parser("push", help="copy names (a) or expressions (b=expr) to the ranks")
    p.add_argument("items", nargs="+", metavar="NAME[=EXPR]")
    _targets(p)
    p = sub.add_parser("pull", help="a ValueMesh of a name (a tuple for several) on every rank")
    p.add_argument("names", nargs="+", metavar="NAME")
    _targets(p)
    p = sub.add_parser("scatter", help="split a sequence across the ranks")
    p.add_argument("name", metavar="NAME")
    p.add_argument("sequence", nargs="+", metavar="SEQUENCE", help="a Python expression")
    _targets(p)
    p = sub.add_parser("gather", help="join a name's values from the ranks in rank order")
    p.add_argument("name", metavar="NAME")
    _targets(p)
    parser.commands = list(sub.choices)
    return parser


def cell_parser() -> Parser:
    parser = Parser(
        prog="%%monarch",
        description="Run the cell on every targeted rank (see %monarch? for examples). It may "
        "use IPython's !cmd, out = !cmd, %time, %timeit, %pip, %cd, %pwd and %env, and a first "
        "line %%time, %%timeit, %%bash, %%sh or %%writefile.",
    )
    _targets(parser)
    _paired(
        parser,
        "block",
        "--noblock",
        "wait for the cell",
        "return a handle at once; output still streams",
    )
    parser.add_argument(
        "--out",
        "-o",
        default=None,
        metavar="NAME",
        help="also store the ValueMesh (or handle) as NAME",
    )
    _paired(
        parser,
        "stream",
        "--no-stream",
        "show output as it happens",
        "show output when the cell ends, grouped by rank (the first 64 MiB)",
    )
    _paired(
        parser,
        "collapse",
        "--no-collapse",
        "show a line printed by several ranks once",
        "show every rank's copy of a line",
    )
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=None,
        metavar="S",
        help="interrupt the ranks still running after S seconds",
    )
    _paired(
        parser,
        "panel",
        "--no-panel",
        "show the live panel under a cell that runs past a second",
        "no live panel",
    )
    parser.add_argument(
        "--local",
        action="store_true",
        help="also run the cell here, in the notebook, once every rank has run it",
    )
    parser.add_argument(
        "--setup",
        action="store_true",
        help="imports and definitions: run again on every rank that joins later (a lost "
        "rank's replacement, %%monarch scale)",
    )
    parser.add_argument(
        "--profile",
        nargs="?",
        const=True,
        default=None,
        metavar="SCHEDULE",
        help="run under torch.profiler and show every rank's timeline: optimizer steps 1-3 after "
        "1 warm-up, or wait=N,warmup=N,active=N,shapes,dir=PATH",
    )
    return parser


def _paired(parser, name: str, off: str, on_help: str, off_help: str) -> None:
    """``--NAME`` (the default) and its opposite ``off``, both stored as ``NAME``: None when
    neither is given, so the caller applies the current default."""
    parser.add_argument(
        f"--{name}", dest=name, action="store_true", default=None, help=f"{on_help} (the default)"
    )
    parser.add_argument(off, dest=name, action="store_false", help=off_help)


def _dist(parser) -> None:
    parser.add_argument(
        "--no-dist",
        dest="dist",
        action="store_false",
        help="do not form a torch.distributed process group",
    )
    parser.add_argument(
        "--backend",
        default=None,
        metavar="B",
        help="gloo, nccl (RCCL on ROCm), or per device: cpu:gloo,cuda:nccl (on GPUs, the default)",
    )


class _Once(argparse.Action):
    """An option given once: argparse would keep the last of two ``--mesh``, and drop the
    first's dimensions without a word."""

    def __call__(self, parser, namespace, values, option_string=None):
        first = getattr(namespace, self.dest, None)
        if first is not None:
            raise argparse.ArgumentError(
                self,
                f"given twice ({first} and {values}); give the whole shape once, e.g. "
                f"{option_string} dp=2,tp=2",
            )
        setattr(namespace, self.dest, values)


def _mesh(parser) -> None:
    parser.add_argument(
        "--mesh",
        action=_Once,
        default=None,
        metavar="SHAPE",
        help="a torch DeviceMesh named mesh on every rank: NAME=SIZE,... e.g. dp=2,tp=2",
    )


def _ft(parser) -> None:
    parser.add_argument(
        "--ft",
        action="store_true",
        help="fault-tolerant training (torchft): a cell's ft.steps loop goes on through a lost "
        "rank, whose replacement heals from a live peer",
    )


def _targets(parser) -> None:
    parser.add_argument("--targets", "-t", default=None, metavar="SPEC", help=_TARGETS_HELP)


def seconds(text: str) -> float:
    """A --timeout: a number of seconds above 0 (0 would give up before the ranks could start)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def split_items(text: str) -> str:
    """``a b=f(x, y)`` -> ``a, b=f(x, y)``: whitespace at bracket depth 0 separates items."""
    pieces: list[str] = []
    depth, start, last_end = 0, 0, 0
    lines = text.splitlines(keepends=True) or [""]
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER):
                continue
            pos = offsets[tok.start[0] - 1] + tok.start[1]
            if depth == 0 and pos > last_end and last_end > start:
                pieces.append(text[start:last_end])
                start = pos
            if tok.string in "([{" and tok.type == tokenize.OP:
                depth += 1
            elif tok.string in ")]}" and tok.type == tokenize.OP:
                depth -= 1
            last_end = offsets[tok.end[0] - 1] + tok.end[1]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        raise UsageError(f"push: cannot read {text!r} as names and NAME=EXPR items") from None
    pieces.append(text[start:last_end])
    return ", ".join(p.strip().rstrip(",") for p in pieces if p.strip())


# --targets SPEC, -t SPEC or --targets=SPEC as whole words; a quoted string is matched whole
# (and skipped) so that a flag-like word inside one stays part of the expression.
_TARGETS_FLAG = re.compile(
    r"""'(?:\\.|[^'\\])*'|"(?:\\.|[^"\\])*"|"""
    r"(?<!\S)(?P<flag>--targets|-t)(?:=(?P<eq>\S*)|\s+(?P<spec>\S+))?(?!\S)"
)


def pop_targets(text: str) -> tuple[str | None, str]:
    """The --targets value of push/scatter arguments, and the text without the flag: its span
    is cut out, so the expressions keep their own spacing (``s='a    b'``)."""
    for m in _TARGETS_FLAG.finditer(text):
        if m["flag"]:
            spec = m["spec"] if m["eq"] is None else m["eq"]
            if not spec:
                raise UsageError(f"{m['flag']} needs a value: all, 0, 0,2, 1:3 or ::2")
            return spec, text[: m.start()] + text[m.end() :]
    return None, text
