"""%monarch and %%monarch through a real IPython shell."""

from __future__ import annotations

import _thread
import math
import threading

import pytest
from _wait import wait_for

import monarch_nb
from monarch_nb.notebook import magic
from monarch_nb.notebook.magic import MonarchMagics
from monarch_nb.notebook.magic_args import split_items


def test_everything_before_up_says_to_start_a_cluster(cell, no_current):
    for source in [
        "%%monarch\n1",
        "%monarch push x",
        "%monarch pull x",
        "%monarch status",
        "%monarch down",
        "%monarch interrupt",
        "%monarch scatter a [1]",
    ]:
        cell(source, expect_error=True)
        assert "no cluster is up; start one with %monarch up" in str(cell.error), source


def test_up_status_down_and_up_while_up(cell, no_current):
    cell("%monarch up --workers 1 --cpu")
    assert "monarch-nb: started 1 rank at tcp://127.0.0.1:" in cell.out
    assert "rank  host" in cell.out
    cell("%monarch up --cpu", expect_error=True)
    assert "already up" in str(cell.error)
    cell("%monarch status")
    assert "idle" in cell.out and "cpu:" in cell.out
    cell("%monarch down")
    assert "cluster shut down" in cell.out
    cell("%monarch up --workers 0", expect_error=True)
    assert "--workers must be at least 1" in str(cell.error)


def test_cell_magic_returns_a_valuemesh_in_underscore_and_out(cell, clean):
    result = cell("%%monarch --out got\nx = rank + 1\nx * 2")
    assert result.values() == [2, 4]
    assert cell.shell.user_ns["got"] is result
    assert cell("_") is result
    assert cell("%%monarch\ny = 1") is None
    assert cell("%%monarch\nx;") is None


def test_targets_and_bad_targets(cell, clean):
    assert cell("%%monarch --targets 1\nrank").values() == [1]
    assert cell("%%monarch -t ::2\nrank").values() == [0]
    for spec, message in [
        ("7", "rank 7 is out of range"),
        ("x", "'x' is not a rank"),
        ("1:1", "selects no ranks"),
    ]:
        cell(f"%%monarch --targets {spec}\nrank", expect_error=True)
        assert message in str(cell.error)


def test_syntax_error_is_shown_before_dispatch(cell, clean):
    cell("%%monarch\nsent = 1\nx = (", expect_error=True)
    assert type(cell.error).__name__ == "CellSyntaxError"
    rendered = "\n".join(cell.error._render_traceback_())
    assert "SyntaxError" in rendered and "nothing was sent to the ranks" in rendered
    cell("%monarch pull sent", expect_error=True)
    assert "sent is not defined on ranks 0-1" in str(cell.error)


def test_remote_errors_render_with_ranks(cell, clean):
    cell("%%monarch --out partial\n[][rank] if rank == 0 else 'ok'", expect_error=True)
    rendered = cell.error._render_traceback_()
    assert rendered[0] == "1 of 2 ranks failed"
    assert "[rank 0] IndexError: list index out of range" in rendered
    assert cell.shell.user_ns["partial"].to_dict() == {1: "ok"}


def test_streaming_output_with_and_without_collapse(cell, clean):
    cell("%%monarch\nprint('hi')")
    assert cell.out.splitlines() == ["[ranks 0-1] hi"]
    cell("%%monarch --no-collapse\nprint('hi')")
    assert sorted(cell.out.splitlines()) == ["[rank 0] hi", "[rank 1] hi"]
    cell("%%monarch --no-stream\nprint('a', rank)\nprint('b', rank)")
    assert cell.out.splitlines() == ["[rank 0] a 0", "[rank 0] b 0", "[rank 1] a 1", "[rank 1] b 1"]


def test_push_pull_scatter_gather(cell, clean):
    cell("import threading\nw = 3\nlock = threading.Lock()")
    cell("%monarch push w v=[1, 2] u=(w + 1) s='a b'")
    assert cell("%monarch pull w v u s").item(0) == (3, [1, 2], 4, "a b")
    cell("%monarch push w, z=2 --targets 0")
    cell("%monarch pull z", expect_error=True)
    assert "z is not defined on rank 1" in str(cell.error)
    cell("%monarch push lock", expect_error=True)
    assert "cannot push 'lock': lock cannot be pickled" in str(cell.error)
    cell("%monarch push nothere", expect_error=True)
    assert "'nothere' is not defined in the notebook" in str(cell.error)
    cell("%monarch push q=1/0", expect_error=True)
    assert "ZeroDivisionError" in str(cell.error)
    cell("%monarch scatter part list(range(6))")
    assert cell("%monarch pull part").values() == [[0, 1, 2], [3, 4, 5]]
    assert cell("%monarch gather part") == list(range(6))
    cell("%monarch scatter part", expect_error=True)
    assert "usage: %monarch scatter" in str(cell.error)


def test_unknown_commands_and_flags(cell, clean):
    cell("%monarch frobnicate", expect_error=True)
    assert "invalid choice: 'frobnicate'" in str(cell.error)
    cell("%monarch status --bogus", expect_error=True)
    assert "unrecognized arguments: --bogus" in str(cell.error)
    cell("%%monarch --bogus\n1", expect_error=True)
    assert "unrecognized arguments: --bogus" in str(cell.error)
    cell("%monarch", expect_error=True)
    assert "needs a command" in str(cell.error)
    cell("%monarch -h")
    assert "connect" in cell.out


def test_local_also_runs_the_cell_in_the_notebook_once_the_ranks_have(cell, clean):
    ns = cell.shell.user_ns
    cell("%%monarch --local\nimport math\ndef area(r):\n    return math.pi * r * r\narea(1)")
    assert cell("area(2)") == pytest.approx(4 * math.pi)  # defined here as well
    assert clean.run("area(2)").values() == [pytest.approx(4 * math.pi)] * 2
    cell("%%monarch --local\nlocal_not_here = 1\n1 / 0", expect_error=True)
    assert "local_not_here" not in ns  # the ranks failed: it did not run here
    ns.pop("rank", None)
    cell("%%monarch --local\nlocal_rank_copy = rank", expect_error=True)
    assert isinstance(cell.error, NameError)  # ran on the ranks, then failed here
    cell("%%monarch --local --noblock\n1", expect_error=True)
    assert "--local runs the cell here once the ranks have run it" in str(cell.error)


def test_auto_mode(cell, clean):
    cell("%monarch auto")
    try:
        assert cell("r = rank * 3\nr").values() == [0, 3]
        cell("!echo auto on {rank}")  # the cell reaches the ranks before IPython's ! would
        assert "[rank 1] auto on 1" in cell.out
        cell("%monarch status")
        assert "idle" in cell.out
        cell("%monarch auto on")  # set, not toggled
        assert cell("rank").values() == [0, 1]
    finally:
        cell("%monarch auto off")
    assert cell("1 + 1") == 2
    cell("%monarch auto off")
    assert "auto off" in cell.out and cell("1 + 1") == 2


def test_reset_interrupt_restart_messages(cell, clean):
    cell("%%monarch\nkeep = 1")
    cell("%monarch reset --targets 0")
    assert "cleared the namespaces of rank 0" in cell.out
    cell("%monarch interrupt")
    assert cell.out == "monarch-nb: ranks 0-1 were running nothing\n"


def test_interrupt_says_which_ranks_it_stopped_and_which_are_still_busy(cell, clean):
    handle = cell("%%monarch --noblock\nwhile True: pass")
    assert wait_for(lambda: _busy(clean), 10)  # started: one still on its way is not running
    cell("%monarch interrupt --targets 0")
    assert cell.out == "monarch-nb: interrupted rank 0\n"
    cell("%monarch interrupt")
    assert cell.out == "monarch-nb: interrupted rank 1; rank 0 was running nothing\n"
    with pytest.raises(monarch_nb.CellError, match="KeyboardInterrupt"):
        handle.result(timeout=30)

    # A KeyboardInterrupt lands between two bytecodes, not inside time.sleep: named, as a
    # Ctrl-C names it, never "interrupted" (the next cell waited out the sleep behind it).
    handle = cell("%%monarch --noblock\nimport time\ntime.sleep(5)")
    assert wait_for(lambda: _busy(clean), 10)
    cell("%monarch interrupt")
    assert cell.out == ""
    assert cell.err == (
        "monarch-nb: ranks 0-1 are still busy: their cell did not stop within 1.5 s of the "
        "interrupt (stuck in a C call, such as a long time.sleep?); %monarch interrupt again, "
        "or %monarch restart for fresh workers\n"
    )
    with pytest.raises(monarch_nb.CellError, match="KeyboardInterrupt"):
        handle.result(timeout=30)  # it lands once the sleep returns


def _busy(ctl) -> bool:
    return all(row["state"].startswith("busy") for row in ctl.status())


def test_kernel_interrupt_of_a_blocking_cell(cell, clean):
    threading.Timer(1.0, _thread.interrupt_main).start()
    cell("%%monarch\nwhile True: pass", expect_error=True)
    assert "interrupted ranks 0-1" in cell.error._render_traceback_()[0]
    assert cell("%%monarch\n'alive'").values() == ["alive", "alive"]


def test_timeout_flag(cell, clean):
    cell("%%monarch --timeout 0.5\nwhile True: pass", expect_error=True)
    assert isinstance(cell.error, monarch_nb.CellTimeout)
    assert "ran past --timeout 0.5 s" in str(cell.error)


def test_noblock_returns_a_handle(cell, clean):
    handle = cell("%%monarch --noblock --out h\nimport time\ntime.sleep(0.3)\nrank")
    assert isinstance(handle, monarch_nb.CellHandle)
    assert cell.shell.user_ns["h"] is handle
    assert handle.result(timeout=30).values() == [0, 1]


def test_connect_errors(cell, no_current):
    cell("%monarch connect tcp://127.0.0.1:9 --timeout 2", expect_error=True)
    assert "cannot reach a Dask scheduler at tcp://127.0.0.1:9" in str(cell.error)
    cell("%monarch connect --cluster nonsense", expect_error=True)
    assert "--cluster takes module:factory" in str(cell.error)
    cell("%monarch connect", expect_error=True)
    assert "exactly one of ADDRESS" in str(cell.error)


def test_help_of_every_command_and_of_the_cell_magic(cell, no_current):
    """-h needs no cluster: it prints the usage and runs nothing."""
    cell("%monarch -h")
    assert cell.out.startswith("usage: %monarch [-h] COMMAND ...")
    commands = MonarchMagics(cell.shell).parser.commands
    assert {"plot", "dashboard", "push", "scatter"} <= set(commands)
    for command in commands:
        cell(f"%monarch {command} -h")
        assert cell.out.startswith(f"usage: %monarch {command} [-h]"), command
    for source in ["%monarch pull x -h", "%monarch push s='a b' --help", "%monarch scatter -h"]:
        cell(source)
        assert cell.out.startswith("usage: %monarch "), source
    cell("%%monarch -h\nraise SystemExit('the cell ran')")
    assert cell.out.startswith("usage: %%monarch [-h]") and "--timeout S" in cell.out
    # The commands are written once, in the parser; the docstring names each one too.
    cell("%monarch", expect_error=True)
    assert f"{', '.join(commands[:-1])} or {commands[-1]}" in str(cell.error)
    assert all(command in MonarchMagics.monarch.__doc__ for command in commands)


def test_every_command_of_the_parser_has_a_handler(shell):
    """The commands are written once, in the parser; each reaches its function (push and
    scatter read their raw text, auto toggles the magics' own state)."""
    handled = {*magic._COMMANDS, "auto", "push", "scatter"}
    assert sorted(MonarchMagics(shell).parser.commands) == sorted(handled)


def test_push_and_scatter_targets_keep_the_expression_as_written(cell, clean):
    cell("%monarch push s='a    b' --targets 0")
    assert cell("%monarch pull s -t 0").values() == ["a    b"]
    cell("%monarch push m='use -t 1' -t=1")  # a flag-like word inside a string stays there
    assert cell("%monarch pull m -t 1").values() == ["use -t 1"]
    cell("%monarch scatter parts ['x  y', 'z'] -t 0,1")
    assert cell("%monarch pull parts").values() == [["x  y"], ["z"]]


def test_pull_of_an_unpicklable_value_names_it_in_one_line(cell, clean):
    cell("%%monarch\nimport threading\nlk = threading.Lock()\ny = 5")
    cell("%monarch pull y lk", expect_error=True)
    assert str(cell.error) == (
        "cannot pull 'lk' from ranks 0-1: lock cannot be pickled "
        "(cannot pickle '_thread.lock' object)"
    )
    assert cell("%monarch pull y").values() == [5, 5]


def test_gather_stacks_0d_values_and_says_in_one_line_what_does_not_join(cell, clean):
    cell("%%monarch\nimport torch\nloss = torch.tensor(float(rank))\nbad = torch.ones(2, rank + 1)")
    assert cell("%monarch gather loss").tolist() == [0.0, 1.0]
    cell("%monarch gather bad", expect_error=True)
    assert str(cell.error).startswith("cannot gather 'bad': the ranks' values (Tensor) do not join")
    assert "\n" not in str(cell.error)


def test_small_mistakes_and_hidden_values(cell, clean):
    cell("%%monarch --timeout 0\nrank", expect_error=True)
    assert "argument --timeout: must be more than 0 seconds, got 0" in str(cell.error)
    cell("%monarch scatter 1bad [1, 2]", expect_error=True)
    assert "cannot scatter to '1bad': not a valid Python name" in str(cell.error)
    assert cell("%%monarch\nrank;  # hide") is None
    assert cell("%%monarch\nrank  # shown;").values() == [0, 1]


def test_split_items():
    assert split_items("a b=f(x, y) c='p q'") == "a, b=f(x, y), c='p q'"
    assert split_items("a, b=1") == "a, b=1"


def test_path_arguments_are_split_as_a_shell_splits_them(shell):
    parser = MonarchMagics(shell).parser
    cases = {
        "sync 'a b/é.py' c\\ d.py \"e é\"": ("paths", ["a b/é.py", "c d.py", "e é"]),
        "run 'my dir/train é.py' --name 'a b' \"c\"": ("script", "my dir/train é.py"),
        "plot --save 'loss plot é.html'": ("save", "loss plot é.html"),
        'connect --scheduler-file "shared dir/scheduler é.json"': (
            "scheduler_file",
            "shared dir/scheduler é.json",
        ),
    }
    for line, (name, value) in cases.items():
        assert getattr(parser.parse_argstring(line), name) == value, line
    assert parser.parse_argstring("run s.py --name 'a b' \"c\"").args == ["--name", "a b", "c"]


def test_status_of_64_ranks_fits_one_screen_and_ranks_shows_each():
    from monarch_nb.notebook.magic_cluster import _table

    rows = [
        {
            "rank": r,
            "host": f"node{r // 8}",
            "pid": 1000 + r,
            "device": "cuda: H100 (79.1 GiB)",
            "state": "not answering" if r == 9 else f"busy {10 + r / 8:.1f} s",
            "names": "-" if r == 9 else 4,
        }
        for r in range(64)
    ]
    columns = ["rank", "host", "pid", "device", "state", "names"]
    lines = _table(rows, columns).splitlines()
    assert lines[0].split() == ["ranks", "host", "device", "state", "names"]
    words = [" ".join(line.split()) for line in lines]
    assert words[1] == "0-7 node0 cuda: H100 (79.1 GiB) busy 10-11 s 4"
    assert words[2] == "8,10-15 node1 cuda: H100 (79.1 GiB) busy 11-12 s 4"
    assert words[3] == "9 node1 cuda: H100 (79.1 GiB) not answering -"
    assert len(lines) == 1 + 9 + 1, lines  # a row per host, rank 9 apart, and the note
    assert "%monarch status --ranks" in lines[-1]
    assert len(_table(rows, columns, every=True).splitlines()) == 1 + 64
    assert len(_table(rows[:15], columns).splitlines()) == 1 + 15  # under 16: a row per rank
