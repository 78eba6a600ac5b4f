"""The rank's cell runner without a cluster: how a cell compiles (its last expression apart,
hidden by ``;``, top-level ``await``) and how an exception becomes the traceback the notebook
shows (from the cell on, the package's own frames left out of an interrupt's)."""

from __future__ import annotations

import asyncio
import inspect
import linecache
import threading

import pytest

from monarch_nb.rank import cells
from monarch_nb.telemetry import recorder


def run(source: str, namespace: dict, n: int = 1):
    body, expr, _ = cells.compile_cell({"code": source, "n": n})
    exec(body, namespace)
    return eval(expr, namespace) if expr is not None else None


def test_the_last_expression_is_the_value_and_a_semicolon_hides_it():
    body, expr, silent = cells.compile_cell({"code": "x = 20\nx + 1", "n": 3})
    ns: dict = {}
    exec(body, ns)
    assert eval(expr, ns) == 21 and not silent
    assert cells.compile_cell({"code": "x + 1;  # hide", "n": 4})[2]
    assert cells.compile_cell({"code": "x = 1", "n": 5})[1] is None


def test_top_level_await_compiles_to_a_coroutine():
    _, expr, _ = cells.compile_cell({"code": "import asyncio\nawait asyncio.sleep(0, 7)"})
    assert expr.co_flags & inspect.CO_COROUTINE
    assert asyncio.run(eval(expr, {"asyncio": asyncio})) == 7


def test_the_traceback_shows_the_cell_as_written():
    # The code that runs is the rewritten cell; the lines shown are what the user typed.
    source = "!true\n1 / 0"
    body, expr, _ = cells.compile_cell({"code": "pass\n1 / 0", "source": source, "n": 9})
    exec(body, {})
    with pytest.raises(ZeroDivisionError) as info:
        eval(expr, {})
    error = cells.format_error(info.value)
    assert error["ename"] == "ZeroDivisionError" and error["evalue"] == "division by zero"
    text = "\n".join(error["traceback"])
    assert 'File "<monarch cell 9>", line 2' in text and "1 / 0" in text
    assert __file__ not in text  # what called the cell is not the user's
    assert linecache.getline("<monarch cell 9>", 1) == "!true\n"


class OneElement:
    """A one-element tensor whose ``item()`` is interrupted."""

    def numel(self):
        return 1

    def item(self):
        raise KeyboardInterrupt


def test_an_interrupt_inside_the_package_ends_at_the_users_line():
    # log() (telemetry/, outside rank/) calls back into user code: every frame of the package,
    # wherever in it, is left out, and what it called back with it.
    ns = {"scalar": recorder._scalar, "OneElement": OneElement}
    with pytest.raises(KeyboardInterrupt) as info:
        run("x = 1\nscalar('loss', OneElement())", ns, n=2)
    error = cells.format_error(info.value)
    assert error["ename"] == "KeyboardInterrupt" and error["evalue"] == "interrupted"
    text = "\n".join(error["traceback"])
    assert 'File "<monarch cell 2>", line 2' in text
    assert "recorder.py" not in text and "in item" not in text


def test_a_value_that_cannot_travel_says_why():
    assert cells.pack(lambda: 1)["value"]  # cloudpickle sends a lambda by value
    assert cells.pack(threading.Lock())["value_error"].startswith("lock cannot be pickled")


def test_a_cell_run_again_is_named_after_its_own_run():
    # Compiled once and kept; each run's code, its functions and comprehensions included,
    # carries its own cell number, so tracebacks and inspect point at the right run.
    source = "def f():\n    return [1 / i for i in (0,)]\nf"
    first, second = ({} for _ in range(2))
    f1 = run(source, first, n=41)
    f2 = run(source, second, n=42)
    assert f1.__code__.co_filename == "<monarch cell 41>"
    assert f2.__code__.co_filename == "<monarch cell 42>"
    inner = [c for c in f2.__code__.co_consts if inspect.iscode(c)]
    assert inner and all(c.co_filename == "<monarch cell 42>" for c in inner)
    try:
        f2()
    except ZeroDivisionError as e:
        lines = cells.format_error(e)["traceback"]
    assert any('"<monarch cell 42>", line 2' in line for line in lines), lines
    assert not any("cell 41" in line for line in lines), lines
    assert inspect.getsource(f1).startswith("def f():")


def test_a_syntax_error_on_the_rank_names_its_cell():
    # The controller parses first; a rank on another Python may still refuse a cell.
    with pytest.raises(SyntaxError) as info:
        cells.compile_cell({"code": "x = (", "n": 43})
    assert info.value.filename == "<monarch cell 43>"
