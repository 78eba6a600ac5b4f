"""``%monarch`` and ``%%monarch``: argument parsing and showing results and errors. No cluster
logic lives here; everything goes through the current Controller."""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import keyword
import os
import re
import sys
import tokenize
from typing import Any

from IPython.core.displayhook import DisplayHook
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import (
    MagicArgumentParser,
    argument,
    kwds,
    magic_arguments,
    parse_argstring,
)

from monarch_nb import errors
from monarch_nb.actors import mesh as actors
from monarch_nb.controller import start, syntax
from monarch_nb.controller.controller import CellHandle, ClusterError
from monarch_nb.controller.launch import run_script
from monarch_nb.controller.names import notebook_name
from monarch_nb.controller.results import CellError, CellSyntaxError, Interrupted
from monarch_nb.controller.targets import TargetError, format_ranks
from monarch_nb.notebook import plots
from monarch_nb.notebook.widgets import (
    NO_WIDGETS,
    CellWatch,
    LivePanel,
    static_bundle,
    widgets_available,
)
from monarch_nb.telemetry import metrics

NO_CLUSTER = "no cluster is up; start one with %monarch up (or %monarch connect ADDRESS)"


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "?"


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def _device(d: dict[str, Any]) -> str:
    if not d:
        return "-"
    return f"{d.get('kind', '?')}: {d.get('name', '?')} ({_gib(d.get('memory'))})"


class _Parser(MagicArgumentParser):
    """IPython's parser with ``-h/--help`` (IPython leaves it out) in argparse's plain layout
    (IPython's is reStructuredText for docstrings: a ``::`` line and a second ``%``), and an
    unbalanced quote reported as a UsageError (shlex raises ValueError) like every other
    mistake in the arguments. ``commands`` lists the sub-commands once they are added."""

    def __init__(self, *args, add_help=True, formatter_class=argparse.HelpFormatter, **kwargs):
        super().__init__(*args, add_help=add_help, formatter_class=formatter_class, **kwargs)
        self.commands: list[str] = []

    def parse_argstring(self, argstring):
        try:
            return super().parse_argstring(argstring)
        except ValueError as e:
            raise UsageError(f"cannot read the arguments {argstring.strip()!r}: {e}") from None


def _line_parser() -> _Parser:
    parser = _Parser(
        prog="%monarch", description="Control the cluster (see %monarch? for examples)."
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    p = sub.add_parser("up", help="start a local cluster: one worker per GPU, or 2 CPU workers")
    p.add_argument(
        "--workers", "-n", type=int, default=None, metavar="N", help="default: one per GPU, else 2"
    )
    p.add_argument("--cpu", action="store_true", help="CPU workers even where GPUs are visible")
    p.add_argument("--threads", type=int, default=1, metavar="T", help="threads per worker")
    p.add_argument(
        "--tls", action="store_true", help="TLS on every Dask comm, with temporary certificates"
    )
    _dist(p)
    p = sub.add_parser("connect", help="join a scheduler or wrap a distributed cluster object")
    p.add_argument("address", nargs="?")
    p.add_argument("--scheduler-file")
    p.add_argument("--cluster", metavar="MODULE:FACTORY")
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=8,
        metavar="S",
        help="seconds to reach the scheduler (default: %(default)g)",
    )
    p.add_argument(
        "--workers", "-n", type=int, default=None, metavar="N", help="wait for this many workers"
    )
    p.add_argument(
        "--wait",
        type=_seconds,
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
    p = sub.add_parser("run", help="run a torchrun-style script on every rank")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    _targets(p)
    for name, text in [
        ("status", "a table of the ranks"),
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
    p = sub.add_parser("reset", help="clear the namespaces")
    _targets(p)
    p = sub.add_parser("interrupt", help="interrupt the running cell on the ranks")
    _targets(p)
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


def _dist(parser) -> None:
    parser.add_argument(
        "--no-dist",
        dest="dist",
        action="store_false",
        help="do not form a torch.distributed process group",
    )
    parser.add_argument("--backend", default=None, metavar="B", help="nccl (RCCL on ROCm) or gloo")


def _seconds(text: str) -> float:
    """A --timeout: a number of seconds above 0 (0 would give up before the ranks could start)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def _targets(parser) -> None:
    parser.add_argument(
        "--targets", "-t", default=None, metavar="SPEC", help="ranks: all, 0, 0,2, 1:3 or ::2"
    )


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


@magics_class
class MonarchMagics(Magics):
    """``%monarch COMMAND`` controls the cluster; ``%%monarch`` runs a cell on every rank."""

    def __init__(self, shell):
        super().__init__(shell)
        self.parser = _line_parser()
        self.auto = False
        self.dashboard: LivePanel | None = None

    # -- helpers ----------------------------------------------------------------------------
    def _ctl(self):
        ctl = errors.current()
        if ctl is None or ctl.closed:
            raise UsageError(NO_CLUSTER)
        ctl.announce()
        return ctl

    def _print_ranks(self, ctl, verb: str) -> None:
        rows = ctl.status()
        for r in rows:
            r["device"] = _device(r["device"])
        dash = ""
        with contextlib.suppress(Exception):
            dash = f" (dashboard {ctl.client.dashboard_link})"
        ranks = "1 rank" if ctl.world_size == 1 else f"{ctl.world_size} ranks"
        print(f"monarch-nb: {verb} {ranks} at {ctl.scheduler_address}{dash}")
        print(format_table(rows, ["rank", "host", "pid", "device"]))
        if ctl.dist_backend:
            print(f"torch.distributed: {ctl.dist_backend} process group over all ranks")
        elif ctl.dist_error:
            print(f"torch.distributed: {ctl.dist_error}", file=sys.stderr)

    # -- the magics -------------------------------------------------------------------------
    @line_cell_magic
    def monarch(self, line: str, cell: str | None = None):
        """Drive the cluster from the notebook.

        Line magic::

            In [1]: %load_ext monarch_nb
            In [2]: %monarch up                 # one worker per GPU; 2 CPU workers without GPUs
            In [3]: %monarch push lr=0.1
            In [4]: %monarch pull lr
            Out[4]: ValueMesh({0: 0.1, 1: 0.1})
            In [5]: %monarch status
            In [6]: %monarch down

        Commands: up, connect, run, status, down, restart, auto, metrics, dashboard, plot,
        reset, interrupt, push, pull, scatter, gather (``%monarch -h`` says what each does,
        ``%monarch COMMAND -h`` shows its options).

        Cell magic (``%%monarch [--targets SPEC] [--noblock] [--out NAME] [--no-stream]
        [--no-collapse] [--timeout S] [--local]``; ``%%monarch -h`` explains them)::

            In [7]: %%monarch
               ...: import torch
               ...: t = torch.ones(2) * rank
               ...: print("sum", t.sum().item())
               ...: t
            [rank 0] sum 0.0
            [rank 1] sum 2.0
            Out[7]: ValueMesh({0: tensor([0., 0.]), 1: tensor([1., 1.])})

        The cell may use IPython's shell syntax: ``!cmd``, ``out = !cmd``, ``%time``,
        ``%timeit``, ``%pip``, ``%cd``, ``%pwd``, ``%env``, and on its first line ``%%time``,
        ``%%timeit``, ``%%bash``, ``%%sh`` or ``%%writefile`` (other magics are refused).
        """
        __tracebackhide__ = True  # only dispatches
        if cell is not None:
            return self._cell(line, cell)
        try:
            return self._line(line)
        except Interrupted:
            raise
        except KeyboardInterrupt as e:  # one line: where it landed in our code is no help
            command = line.strip().split(" ", 1)[0]
            raise Interrupted(str(e) or f"%monarch {command} was interrupted") from None

    def _line(self, line: str):
        if not line.strip():
            *most, last = self.parser.commands
            raise UsageError(
                f"%monarch needs a command: {', '.join(most)} or {last} "
                "(%monarch -h says what each does)"
            )
        head, _, rest = line.strip().partition(" ")
        # push and scatter take Python expressions, which argparse would split on their spaces;
        # only their help comes from the parser.
        if head in ("push", "scatter") and not {"-h", "--help"}.isdisjoint(rest.split()):
            line = f"{head} -h"
        elif head == "push":
            targets, rest = _pop_targets(rest)
            return self._push(rest, targets)
        elif head == "scatter":
            targets, rest = _pop_targets(rest)
            name, _, expr = rest.strip().partition(" ")
            if not name or not expr.strip():
                raise UsageError("usage: %monarch scatter NAME SEQUENCE [--targets SPEC]")
            return self._guard(lambda: self._ctl().scatter(name, self._eval(expr), targets))
        try:
            args = self.parser.parse_argstring(line)
        except SystemExit:  # -h printed the help
            return None
        return getattr(self, f"_cmd_{args.command}")(args)

    def _guard(self, fn):
        try:
            return fn()
        except (ClusterError, TargetError, ValueError, NameError, TypeError) as e:
            raise UsageError(str(e)) from None

    def _eval(self, expr: str):
        try:
            return eval(expr, self.shell.user_ns)
        except Exception as e:
            raise UsageError(
                f"cannot evaluate {expr.strip()!r} in the notebook: {type(e).__name__}: {e}"
            ) from None

    def _cmd_up(self, args):
        ctl = self._guard(
            lambda: start.up(
                workers=args.workers,
                cpu=args.cpu,
                threads=args.threads,
                dist=args.dist,
                backend=args.backend,
                tls=args.tls,
            )
        )
        self._print_ranks(ctl, "started")

    def _cmd_connect(self, args):
        ctl = self._guard(
            lambda: start.connect(
                address=args.address,
                scheduler_file=args.scheduler_file,
                cluster=args.cluster,
                timeout=args.timeout,
                dist=args.dist,
                backend=args.backend,
                workers=args.workers,
                wait=args.wait,
                tls=args.tls,
                tls_ca_file=args.tls_ca_file,
                tls_cert=args.tls_cert,
                tls_key=args.tls_key,
            )
        )
        self._print_ranks(ctl, "connected to")
        if ctl.owns_cluster:
            print(f"monarch-nb: {args.cluster} made this cluster; %monarch down shuts it down")

    def _cmd_run(self, args):
        ctl = self._ctl()
        if not os.path.exists(args.script) and not os.path.isabs(args.script):
            raise UsageError(f"run: no script at {args.script!r} (relative to {os.getcwd()})")
        codes = self._guard(lambda: run_script(ctl, args.script, args.args, args.targets))
        print(f"monarch-nb: {args.script} exited with code 0 on {format_ranks(codes.ranks)}")

    def _cmd_dashboard(self, args):
        ctl = self._ctl()
        if self.dashboard is not None:
            self.dashboard.freeze()
            self.dashboard = None
        from IPython.display import display

        if not widgets_available():
            display(static_bundle(ctl, "monarch-nb dashboard", NO_WIDGETS), raw=True)
            return
        self.dashboard = LivePanel(ctl, title="monarch-nb dashboard")
        self.dashboard.show()
        self.dashboard.start()

    def _cmd_plot(self, args):
        history = metrics.history()
        if not history.names():
            raise UsageError(
                "plot: nothing was logged yet; call monarch_nb.log(step=..., loss=...) "
                "in a %%monarch cell first"
            )
        if args.save:
            path = self._guard(lambda: plots.save(history, args.save))
            print(f"monarch-nb: wrote {path}")
            return None
        return plots.show(history)

    def _cmd_metrics(self, args):
        self._ctl()
        print(metrics.format_latest())

    def _cmd_status(self, args):
        ctl = self._ctl()
        rows = ctl.status()
        for r in rows:
            r["device"] = _device(r["device"])
            r["pid"] = r["pid"] or "-"
            r["names"] = "-" if r["names"] is None else r["names"]
        print(format_table(rows, ["rank", "host", "pid", "device", "state", "names"]))
        dead = actors.dead_actors(ctl)
        if dead:
            print("dead actors:")
            for mesh, rank, cause in dead:
                print(f"  {mesh} on rank {rank}: {cause}")

    def _cmd_down(self, args):
        ctl = self._ctl()
        owned = ctl.owns_cluster
        ctl.down()
        print(
            "monarch-nb: cluster shut down"
            if owned
            else "monarch-nb: disconnected; the cluster keeps running"
        )

    def _cmd_restart(self, args):
        ctl = self._ctl()
        ctl.restart()
        print(
            f"monarch-nb: restarted {format_ranks(range(ctl.world_size))}: fresh worker "
            "processes, same ranks, empty namespaces"
        )

    def _cmd_reset(self, args):
        ranks = self._guard(lambda: self._ctl().reset(args.targets))
        print(f"monarch-nb: cleared the namespaces of {format_ranks(ranks)}")

    def _cmd_interrupt(self, args):
        ranks = self._guard(lambda: self._ctl().interrupt(args.targets))
        print(f"monarch-nb: interrupted {format_ranks(ranks)}")

    def _cmd_pull(self, args):
        names = args.names
        return self._guard(
            lambda: self._ctl().pull(names if len(names) > 1 else names[0], args.targets)
        )

    def _cmd_gather(self, args):
        return self._guard(lambda: self._ctl().gather(args.name, args.targets))

    def _cmd_auto(self, args):
        self.auto = not self.auto if args.state is None else args.state == "on"
        transforms = self.shell.input_transformers_cleanup
        if self.auto:
            if _auto_transform not in transforms:
                transforms.append(_auto_transform)
            print(
                "monarch-nb: auto on: cells run on the workers (cells starting with %monarch "
                "run here); %monarch auto turns it off"
            )
        else:
            while _auto_transform in transforms:
                transforms.remove(_auto_transform)
            print("monarch-nb: auto off: cells run in the notebook again")

    def _push(self, text: str, targets):
        ctl = self._ctl()
        if not text.strip():
            raise UsageError("usage: %monarch push NAME [NAME=EXPR ...] [--targets SPEC]")
        try:
            call = ast.parse(f"_({split_items(text)})", mode="eval").body
        except SyntaxError:
            raise UsageError(
                f"push: cannot read {text.strip()!r}; write names and NAME=EXPR "
                "items, with spaces inside an expression in parentheses"
            ) from None
        values = {}
        for node in call.args:
            if not isinstance(node, ast.Name):
                raise UsageError(f"push: {ast.unparse(node)!r} is not a name; use NAME=EXPR")
            if node.id not in self.shell.user_ns:
                raise UsageError(f"push: {node.id!r} is not defined in the notebook")
            values[node.id] = self.shell.user_ns[node.id]
        for kw in call.keywords:
            if kw.arg is None:
                raise UsageError("push: **mapping is not supported; use NAME=EXPR")
            values[kw.arg] = self._eval(ast.unparse(kw.value))
        self._guard(lambda: ctl.push(values, targets))

    def _cell(self, line: str, cell: str):
        try:
            args = parse_argstring(self._cell_args, line)
        except ValueError as e:  # an unbalanced quote
            raise UsageError(f"cannot read the arguments {line.strip()!r}: {e}") from None
        except SystemExit:  # -h printed the help; the cell does not run
            return None
        if args.out is not None and (not args.out.isidentifier() or keyword.iskeyword(args.out)):
            raise UsageError(f"--out takes a Python name to store the result as, got {args.out!r}")
        if args.out is not None:
            args.out = self._guard(
                lambda: notebook_name(args.out, self.shell.user_ns_hidden, "--out cannot store as")
            )
        if args.local and args.block is False:
            raise UsageError(
                "--local runs the cell here once the ranks have run it, so it cannot be --noblock"
            )
        if self.auto and (errors.current() is None or errors.current().closed):
            raise UsageError(
                f"{NO_CLUSTER}; auto mode is on, so this cell was sent to the "
                "workers: %monarch auto off runs cells in the notebook again"
            )
        ctl = self._ctl()
        try:
            tree = ast.parse(syntax.to_python(cell), "<cell>")
        except syntax.UnavailableMagic as e:
            raise UsageError(str(e)) from None
        except SyntaxError as e:
            raise CellSyntaxError(e) from None
        except ValueError as e:  # null bytes: Python 3.11 raises ValueError, 3.12 SyntaxError
            where = cell[: cell.find("\0")].count("\n") + 1
            error = SyntaxError(str(e), ("<cell>", where, 1, cell.splitlines()[where - 1]))
            raise CellSyntaxError(error) from None
        has_value = (
            bool(tree.body)
            and isinstance(tree.body[-1], ast.Expr)
            and not DisplayHook.semicolon_at_end_of_expression(cell)  # `x;  # hidden` too
        )
        block = True if args.block is None else args.block
        watch = CellWatch(ctl, block) if args.panel is not False else None
        try:
            result = ctl.run(
                cell,
                targets=args.targets,
                block=block,
                timeout=args.timeout,
                stream=args.stream is not False,
                collapse=args.collapse is not False,
                watch=watch,
            )
        except (TargetError, ClusterError) as e:
            raise UsageError(str(e)) from None
        except CellError as e:
            if args.out:
                self.shell.user_ns[args.out] = e.results
            raise
        finally:
            if watch is not None:
                watch.finish()
        if args.out:
            self.shell.user_ns[args.out] = result
        if isinstance(result, CellHandle):
            return result
        if args.local:
            __tracebackhide__ = True  # an error here is the notebook code's: show only that
            self._run_here(cell)
        if not has_value or all(v is None for v in result.values()):
            return None
        return result

    def _run_here(self, cell: str) -> None:
        """The cell in the notebook's own namespace (``--local``), as IPython would run it;
        its value is not shown (the ranks' is the cell's), an error raises as the cell's."""
        __tracebackhide__ = True  # IPython leaves this frame out of the traceback
        code = self.shell.transform_cell(cell)
        name = self.shell.compile.cache(code, self.shell.execution_count)
        compiled = self.shell.compile(code, name, "exec")
        exec(compiled, self.shell.user_global_ns, self.shell.user_ns)

    @magic_arguments("%%monarch")
    @kwds(add_help=True, formatter_class=argparse.HelpFormatter)
    @argument(
        "--targets", "-t", default=None, metavar="SPEC", help="ranks: all, 0, 0,2, 1:3 or ::2"
    )
    @argument(
        "--block",
        dest="block",
        action="store_true",
        default=None,
        help="wait for the cell (the default)",
    )
    @argument(
        "--noblock",
        dest="block",
        action="store_false",
        help="return a handle at once; output still streams",
    )
    @argument(
        "--out",
        "-o",
        default=None,
        metavar="NAME",
        help="also store the ValueMesh (or handle) as NAME",
    )
    @argument(
        "--stream",
        dest="stream",
        action="store_true",
        default=None,
        help="show output as it happens (the default)",
    )
    @argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="show output when the cell ends, grouped by rank",
    )
    @argument(
        "--collapse",
        dest="collapse",
        action="store_true",
        default=None,
        help="show a line printed by several ranks once (the default)",
    )
    @argument(
        "--no-collapse",
        dest="collapse",
        action="store_false",
        help="show every rank's copy of a line",
    )
    @argument(
        "--timeout",
        type=_seconds,
        default=None,
        metavar="S",
        help="interrupt the ranks still running after S seconds",
    )
    @argument(
        "--panel",
        dest="panel",
        action="store_true",
        default=None,
        help="show the live panel under a cell that runs past a second (the default)",
    )
    @argument("--no-panel", dest="panel", action="store_false", help="no live panel")
    @argument(
        "--local",
        action="store_true",
        help="also run the cell here, in the notebook, once every rank has run it",
    )
    def _cell_args(self, line):
        """Run the cell on every targeted rank (see %monarch? for examples). It may use
        IPython's !cmd, out = !cmd, %time, %timeit, %pip, %cd, %pwd and %env, and a first
        line %%time, %%timeit, %%bash, %%sh or %%writefile."""


# --targets SPEC, -t SPEC or --targets=SPEC as whole words; a quoted string is matched whole
# (and skipped) so that a flag-like word inside one stays part of the expression.
_TARGETS_FLAG = re.compile(
    r"""'(?:\\.|[^'\\])*'|"(?:\\.|[^"\\])*"|"""
    r"(?<!\S)(?P<flag>--targets|-t)(?:=(?P<eq>\S*)|\s+(?P<spec>\S+))?(?!\S)"
)


def _pop_targets(text: str) -> tuple[str | None, str]:
    """The --targets value of push/scatter arguments, and the text without the flag: its span
    is cut out, so the expressions keep their own spacing (``s='a    b'``)."""
    for m in _TARGETS_FLAG.finditer(text):
        if m["flag"]:
            spec = m["spec"] if m["eq"] is None else m["eq"]
            if not spec:
                raise UsageError(f"{m['flag']} needs a value: all, 0, 0,2, 1:3 or ::2")
            return spec, text[: m.start()] + text[m.end() :]
    return None, text


def _auto_transform(lines: list[str]) -> list[str]:
    first = next((ln for ln in lines if ln.strip()), "")
    if not first or first.lstrip().startswith(("%monarch", "%%monarch")):
        return lines
    return ["%%monarch\n", *lines]


_loaded: dict[int, MonarchMagics] = {}


def load(ipython) -> None:
    magics = MonarchMagics(ipython)
    ipython.register_magics(magics)
    _loaded[id(ipython)] = magics


def unload(ipython) -> None:
    magics = _loaded.pop(id(ipython), None)
    if magics is not None and magics.auto:
        transforms = ipython.input_transformers_cleanup
        while _auto_transform in transforms:
            transforms.remove(_auto_transform)
