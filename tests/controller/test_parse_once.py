"""A cell is parsed once on the controller: the magic parses it and hands the parsed cell to
``Controller.run``, which sends it as it is. (Each rank compiles the text again in its own
process, which a patch in this process does not see.)"""

from __future__ import annotations

import ast
import uuid

import pytest


@pytest.fixture
def parses(monkeypatch):
    """The sources ``ast.parse`` is given in this process from now on."""
    seen: list[str] = []
    real = ast.parse

    def counted(source, *args, **kwargs):
        seen.append(source if isinstance(source, str) else repr(source))
        return real(source, *args, **kwargs)

    monkeypatch.setattr(ast, "parse", counted)
    return seen


def _marker() -> str:
    return f"m{uuid.uuid4().hex}"


def test_a_monarch_cell_is_parsed_once(cell, clean, parses):
    marker = _marker()
    assert cell(f"%%monarch\n{marker} = rank * 2\n{marker}").values() == [0, 2]
    assert [s for s in parses if marker in s] == [f"{marker} = rank * 2\n{marker}\n"]


def test_a_cell_with_ipython_syntax_is_parsed_once(cell, clean, parses):
    marker = _marker()
    mesh = cell(f"%%monarch\nout = !echo {marker}\nout")
    assert [list(v) for v in mesh.values()] == [[marker], [marker]]
    assert len([s for s in parses if marker in s]) == 1, parses


def test_run_with_a_string_parses_it_once(clean, parses):
    marker = _marker()
    assert clean.run(f"x = !echo {marker}\nx[0]").values() == [marker, marker]
    assert len([s for s in parses if marker in s]) == 1, parses
