"""IPython's syntax in a rank's cells (``!cmd``, ``x = !cmd``, %time, %%bash...), on the shared
real cluster and through a real IPython shell: what runs, what each rank prints, and the
magics refused before anything is sent."""

from __future__ import annotations

import os
import time

import pytest
from _wait import running
from IPython.core.magics.execution import TimeitResult

from monarch_nb import CellError, CellTimeout
from monarch_nb.dispatch.syntax import UnavailableMagic, parse
from monarch_nb.rank.shell import pip_turn


def test_shell_commands_run_on_every_rank_with_names_filled_in(cell, clean):
    cell("%%monarch\nname = 'r' + str(rank)\n!echo {name} of $world_size; echo oops >&2")
    assert "[rank 0] r0 of 2" in cell.out and "[rank 1] r1 of 2" in cell.out
    assert "oops" in cell.out + cell.err
    assert clean.run("!exit 3\n_exit_code").values() == [3, 3]
    with pytest.raises(CellError, match="background processes are not supported in !cmd"):
        clean.run("!sleep 30 &")


def test_output_of_a_command_is_a_list_of_lines_even_inside_a_function(clean):
    code = "def lines(n):\n    out = !printf 'a%s\\nb\\n' {n}\n    return out\nlines(rank)"
    got = clean.run(code)
    assert got.values() == [["a0", "b"], ["a1", "b"]]
    assert type(got[0]).__name__ == "SList"  # IPython's: .grep, .fields, .n work on it


def test_time_prints_the_times_and_gives_the_value(cell, clean):
    got = cell("%%monarch\n%time sum(range(rank + 3))")
    assert got.values() == [3, 6]
    assert "CPU times: user" in cell.out and "Wall time:" in cell.out
    assert clean.run("%%time\nx = rank * 2\nx + 1").values() == [1, 3]
    assert clean.run("x").values() == [0, 2]  # the timed cell ran in the rank's namespace


def test_timeit_times_and_returns_its_result_with_o(cell, clean):
    got = clean.run("%timeit -n 5 -r 2 -o sum(range(rank + 10))")
    assert all(isinstance(r, TimeitResult) for r in got.values())
    assert [(r.loops, r.repeat) for r in got.values()] == [(5, 2), (5, 2)]
    cell("%%monarch\n%%timeit -n 3 -r 1 y = rank\ny + 1")
    assert "per loop (mean ± std. dev. of 1 run, 3 loops each)" in cell.out
    with pytest.raises(CellError) as info:
        clean.run("%timeit -n 0 pass")
    assert "%timeit takes -n N" in str(info.value)


def test_a_magics_error_points_at_the_cells_own_line(clean):
    with pytest.raises(CellError) as info:
        clean.run("\n\nx = 1\n%time 1 / 0")
    trace = "\n".join(info.value.errors[0].traceback)
    assert "line 4" in trace and "%time 1 / 0" in trace
    assert "rank_shell" not in trace  # the shell's own frames are left out
    with pytest.raises(CellError) as info:
        clean.run("!true\ny = 1\n1 / 0")
    trace = "\n".join(info.value.errors[0].traceback)
    assert "line 3" in trace and "1 / 0" in trace


def test_bash_and_sh_cells_and_their_exit_status(cell, clean):
    cell("%%monarch\n%%bash\nfor i in 1 2; do echo step $i; done")
    assert "step 1" in cell.out and "step 2" in cell.out
    with pytest.raises(CellError) as info:
        clean.run("%%sh\necho before; exit 4")
    assert "CalledProcessError" in str(info.value) and "exit status 4" in str(info.value)
    assert clean.run("%%sh --no-raise-error\nexit 4").values() == [None, None]
    assert clean.run("_exit_code").values() == [4, 4]


def test_writefile_cd_pwd_and_env_act_on_each_ranks_process(cell, clean, tmp_path):
    before = clean.run("%pwd").values()
    try:
        clean.run(f"%cd {tmp_path}")
        assert clean.run("%pwd").values() == [str(tmp_path)] * 2
        cell("%%monarch\n%%writefile part{rank}.txt\nhello\n")
        assert "Writing part0.txt" in cell.out
        assert (tmp_path / "part1.txt").read_text() == "hello\n"
        cell("%%monarch\n%%writefile -a part{rank}.txt\nagain\n")
        assert (tmp_path / "part0.txt").read_text() == "hello\nagain\n"
        clean.run("%cd -")
        assert clean.run("%pwd").values() == before
    finally:
        clean.run(f"import os\nos.chdir({before[0]!r})")
    name = f"MONARCH_NB_TEST_{os.getpid()}"
    cell(f"%%monarch\n%env {name}=rank{{rank}}")
    assert f"env: {name}=rank0" in cell.out
    assert clean.run(f"%env {name}").values() == ["rank0", "rank1"]
    with pytest.raises(CellError) as info:
        clean.run("%env MONARCH_NB_NOT_SET_ANYWHERE")
    assert "the environment has no MONARCH_NB_NOT_SET_ANYWHERE" in str(info.value)


def test_pip_runs_in_the_ranks_python(cell, clean):
    cell("%%monarch --targets 0\n%pip --version")
    assert "pip " in cell.out and " from " in cell.out
    with pytest.raises(CellError) as info:
        clean.run("%pip")
    assert "%pip needs a pip command" in str(info.value)


def test_the_ranks_of_a_host_take_turns_with_pip(clean):
    with pip_turn():  # held here, as a rank's pip would hold it
        handle = clean.run("%pip --version", block=False)
        assert not handle.wait(1.5)
    assert handle.result(timeout=60).values() == [None, None]


def test_interrupting_a_command_stops_it(clean, tmp_path):
    pidfile = tmp_path / "pid"
    with pytest.raises(CellTimeout) as info:
        clean.run(f"!echo $$ > {pidfile}{{rank}}; exec sleep 60", timeout=1.5)
    trace = "\n".join(info.value.errors[0].traceback)
    assert "exec sleep 60" in trace  # ends at the cell's line: no pump or selector frames
    assert "children.py" not in trace and "selectors.py" not in trace
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
    deadline = time.monotonic() + 10
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running(pids) == []
    assert clean.run("'still usable'").values() == ["still usable"] * 2


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("x = 1\n%matplotlib inline", "%matplotlib is not available on the ranks; their cells"),
        ("x = 1\n%%bash\necho", "%%bash is a cell magic: it goes on the cell's first line"),
        ("%%capture\nx = 1", "%%capture is not available on the ranks"),
        ("x = 1\nx?", "help (name? or name??) is not available in a %%monarch cell"),
        ("%monarch status", "%monarch runs in the notebook, not on the ranks"),
    ],
)
def test_magics_the_ranks_lack_are_refused_before_anything_runs(cell, clean, source, message):
    cell("%%monarch\n" + source, expect_error=True)
    assert message in str(cell.error)
    assert str(cell.error).count("\n") == 0
    with pytest.raises(UnavailableMagic) as info:
        clean.run(source)
    assert str(info.value) == str(cell.error)
    assert clean.run("'x' in globals()").values() == [False, False]


def test_cells_without_ipython_syntax_are_sent_as_written():
    for code in ["x = 1\nx % 3", "s = 'a?'  # why?", "a = b != c", 'print("%d" % 3)']:
        assert parse(code).python is code
    assert parse("  x = 1\n  x").python.splitlines() == ["x = 1", "x"]  # an indented cell
    assert parse("\n\n!ls").python.splitlines() == ["", "", "get_ipython().system('ls')"]
    code = "s = '''\n!not a command\n'''"
    assert parse(code).python is code


def test_a_syntax_error_in_a_cell_with_commands_is_reported_before_sending(cell, clean):
    cell("%%monarch\n!echo hi\nx = (", expect_error=True)
    assert "nothing was sent to the ranks" in str(cell.error)
