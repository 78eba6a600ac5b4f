"""``%monarch`` and ``%%monarch``: the one ``Magics`` class IPython registers, which reads the
arguments (magic_args.py), hands each command to its module (magic_cluster.py manages the
cluster, magic_data.py moves values, magic_show.py shows metrics) and runs cells. No cluster
logic lives here; everything goes through the current Controller."""

from __future__ import annotations

import keyword

from IPython.core.displayhook import DisplayHook
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from monarch_nb import errors
from monarch_nb.dispatch import syntax
from monarch_nb.dispatch.handles import CellHandle
from monarch_nb.dispatch.names import notebook_name
from monarch_nb.dispatch.results import CellError, CellSyntaxError, Interrupted
from monarch_nb.dispatch.targets import TargetError
from monarch_nb.errors import ClusterError
from monarch_nb.notebook import (
    magic_cluster,
    magic_data,
    magic_debug,
    magic_keep,
    magic_show,
    magic_stacks,
    magic_sync,
)
from monarch_nb.notebook.magic_args import cell_parser, line_parser
from monarch_nb.notebook.magic_cluster import NO_CLUSTER, controller, guard
from monarch_nb.notebook.widgets import CellWatch, LivePanel

# %monarch COMMAND -> fn(magics, args); push and scatter read their raw text (magic_data.py).
_COMMANDS = {
    "up": magic_cluster.up,
    "connect": magic_cluster.connect,
    "attach": magic_keep.attach,
    "detach": magic_keep.detach,
    "actors": magic_keep.actors,
    "run": magic_cluster.run,
    "status": magic_cluster.status,
    "down": magic_cluster.down,
    "restart": magic_cluster.restart,
    "scale": magic_cluster.scale,
    "kill": magic_cluster.kill,
    "mesh": magic_cluster.mesh,
    "reset": magic_cluster.reset,
    "interrupt": magic_cluster.interrupt,
    "stacks": magic_stacks.stacks,
    "debug": magic_debug.debug,
    "metrics": magic_show.metrics_table,
    "dashboard": magic_show.dashboard,
    "plot": magic_show.plot,
    "profile": magic_show.profile,
    "pull": magic_data.pull,
    "gather": magic_data.gather,
    "sync": magic_sync.sync,
    "autoreload": magic_sync.autoreload,
}


@magics_class
class MonarchMagics(Magics):
    """``%monarch COMMAND`` controls the cluster; ``%%monarch`` runs a cell on every rank."""

    def __init__(self, shell):
        super().__init__(shell)
        self.parser = line_parser()
        self.cell_parser = cell_parser()
        self.auto = False
        self.dashboard: LivePanel | None = None

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

        Commands: up, attach, detach, actors, connect, run, status, down, restart, scale, kill,
        mesh, auto, metrics, dashboard, plot, reset, interrupt, stacks, debug, push, pull,
        scatter, gather, sync, autoreload (``%monarch -h`` says what each does, ``%monarch
        COMMAND -h`` shows its options).

        Training that goes on through a lost rank (torchft; docs/training.md)::

            In [1]: %monarch up --ft           # starts torchft's Lighthouse too
            In [2]: %%monarch --setup          # imports, model, data: run again on new ranks
            In [3]: %%monarch                  # ft.wrap(model, opt); for step in ft.steps(n)
            In [4]: %monarch kill 1            # SIGKILL rank 1's worker: the loop goes on

        A cluster that outlives the kernel (a restart, a crash)::

            In [1]: %monarch up --keep 2h      # shuts itself down after 2 h without a kernel
            In [2]: %monarch detach            # or restart the kernel, then:
            In [3]: %monarch attach            # the ranks' namespaces are as they were

        Cell magic (``%%monarch [--targets SPEC] [--noblock] [--out NAME] [--no-stream]
        [--no-collapse] [--timeout S] [--local] [--setup] [--profile [SCHEDULE]]``;
        ``%%monarch -h`` explains them)::

            In [7]: %%monarch
               ...: import torch
               ...: t = torch.ones(2) * rank
               ...: print("sum", t.sum().item())
               ...: t
            [rank 0] sum 0.0
            [rank 1] sum 2.0
            Out[7]: ValueMesh({0: tensor([0., 0.]), 1: tensor([1., 1.])})

        ``%%monarch debug [--rank R]`` is ``%monarch debug`` with the cell's lines typed at the
        rank's pdb prompts, for a notebook that runs unattended.

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
        if head in ("push", "scatter"):
            if {"-h", "--help"}.isdisjoint(rest.split()):
                return (magic_data.push if head == "push" else magic_data.scatter)(self, rest)
            line = f"{head} -h"
        try:
            args = self.parser.parse_argstring(line)
        except SystemExit:  # -h printed the help
            return None
        if args.command == "auto":
            return self._auto(args)
        return _COMMANDS[args.command](self, args)

    def _auto(self, args):
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

    def _cell(self, line: str, cell: str):
        if line.split()[:1] == ["debug"]:
            return magic_debug.debug_cell(self, line, cell)
        try:
            args = self.cell_parser.parse_argstring(line)
        except SystemExit:  # -h printed the help; the cell does not run
            return None
        if args.out is not None and (not args.out.isidentifier() or keyword.iskeyword(args.out)):
            raise UsageError(f"--out takes a Python name to store the result as, got {args.out!r}")
        if args.out is not None:
            args.out = guard(
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
        ctl = controller()
        try:
            parsed = syntax.parse(cell)  # the one parse: run() sends it as it is
        except syntax.UnavailableMagic as e:
            raise UsageError(str(e)) from None
        except SyntaxError as e:
            raise CellSyntaxError(e) from None
        hidden = DisplayHook.semicolon_at_end_of_expression(cell)  # `x;  # hidden` too
        has_value = parsed.ends_in_expression and not hidden
        block = True if args.block is None else args.block
        watch = CellWatch(ctl, block) if args.panel is not False else None
        try:
            result = ctl.run(
                parsed,
                targets=args.targets,
                block=block,
                timeout=args.timeout,
                stream=args.stream is not False,
                collapse=args.collapse is not False,
                watch=watch,
                setup=args.setup,
                profile=args.profile,
            )
        except (TargetError, ClusterError, ValueError) as e:
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


def _auto_transform(lines: list[str]) -> list[str]:
    first = next((ln for ln in lines if ln.strip()), "")
    if not first or first.lstrip().startswith(("%monarch", "%%monarch")):
        return lines
    return ["%%monarch\n", *lines]


_loaded: dict[int, MonarchMagics] = {}


def load(ipython) -> None:
    magics = MonarchMagics(ipython)
    ipython.register_magics(magics)
    magic_debug.install_hint(ipython)
    _loaded[id(ipython)] = magics


def unload(ipython) -> None:
    magics = _loaded.pop(id(ipython), None)
    magic_debug.remove_hint(ipython)
    if magics is not None and magics.auto:
        transforms = ipython.input_transformers_cleanup
        while _auto_transform in transforms:
            transforms.remove(_auto_transform)
