"""The course's exercises: every checker in monarch_nb.examples.exercises is answered in the
answers notebooks (notebooks/answers/), and each answer there is right by its checker. The
lessons themselves run with their exercises unanswered in the browser test; each topic's wrong
answers are tested beside it (tests/examples/test_exercises_<topic>.py)."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import pkgutil
import re
from pathlib import Path

import nbformat
import pytest

import monarch_nb.examples.exercises as exercises

NOTEBOOKS = Path(__file__).parents[1] / "notebooks"
ANSWERS = sorted((NOTEBOOKS / "answers").glob("*.ipynb"))
TOPICS = [m.name for m in pkgutil.iter_modules(exercises.__path__)]
VERDICTS = (exercises.RIGHT, exercises.WRONG, exercises.UNANSWERED)
CALL = re.compile(r"\bcheck\.(\w+)\(")


def checkers(topic: str) -> set[str]:
    module = importlib.import_module(f"{exercises.__name__}.{topic}")
    return {
        name
        for name, f in vars(module).items()
        if inspect.isfunction(f) and f.__module__ == module.__name__ and not name.startswith("_")
    }


def test_every_lesson_has_its_answers_notebook_and_every_answer_is_right():
    lessons = {p.stem for p in NOTEBOOKS.glob("*.ipynb")}
    for path in ANSWERS:
        assert path.stem.removesuffix("-answers") in lessons, f"{path.name} answers no lesson"
    for path in ANSWERS:
        namespace: dict = {}
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "code":
                continue
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(cell.source, f"{path.name}", "exec"), namespace)
            verdicts = [
                line
                for line in printed.getvalue().splitlines()
                if line.startswith(tuple(f"{v}:" for v in VERDICTS))
            ]
            wrong = [v for v in verdicts if not v.startswith(exercises.RIGHT + ":")]
            assert verdicts or "check." not in cell.source, f"{path.name}: no verdict printed"
            assert not wrong, f"{path.name}: {cell.source.splitlines()[0]!r} -> {wrong}"


@pytest.mark.parametrize("topic", TOPICS)
def test_every_checker_is_answered_and_asked(topic):
    answered = asked = set()
    module = f"exercises import {topic} as check"
    for path in ANSWERS:
        text = path.read_text()
        if module in text:
            answered = answered | set(CALL.findall(text))
    for path in NOTEBOOKS.glob("*.ipynb"):
        text = path.read_text()
        if module in text:
            asked = asked | set(CALL.findall(text))
    assert checkers(topic), f"{topic} has no checkers"
    assert checkers(topic) <= answered, f"not answered: {sorted(checkers(topic) - answered)}"
    assert checkers(topic) <= asked, f"in no lesson: {sorted(checkers(topic) - asked)}"


def test_an_unanswered_exercise_says_so_and_is_not_right(capsys):
    @exercises.checker("replace ... with a number")
    def bytes_sent(answer):
        return exercises.verdict(answer == 4, "4 bytes a float32")

    assert not bytes_sent(...)
    assert capsys.readouterr().out == "not answered yet: replace ... with a number\n"
    assert not bytes_sent(3)
    assert capsys.readouterr().out == "not quite: 4 bytes a float32\n"
    assert bytes_sent(4)
    assert capsys.readouterr().out == "right: 4 bytes a float32\n"


def test_a_verdict_is_said_once_in_a_notebook_and_is_true_or_false_as_a_bool(shell, capsys):
    shell.run_cell(
        "from monarch_nb.examples.exercises import checker, verdict\n"
        "@checker('replace ... with a number')\n"
        "def four(answer):\n"
        "    return verdict(answer == 4, '4 bytes a float32')\n"
        "ok = four(4)",
        store_history=False,
    )
    assert capsys.readouterr().out == "right: 4 bytes a float32\n"
    ok = shell.user_ns["ok"]
    assert ok and ok == True and not exercises.Verdict(False)  # noqa: E712
    assert shell.display_formatter.format(ok) == ({}, {})  # nothing shown under the line
