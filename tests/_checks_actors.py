"""What 05-actors.ipynb must print (tests/_notebook_checks.py)."""

from __future__ import annotations

import re

from _notebook_checks import by_first_line


def actors(cells: list[dict]) -> None:
    out = by_first_line(cells)
    assert "ValueMesh({0: 105, 1: 105})" in out["class Counter(Actor):"]
    assert "ValueMesh({0: 1105, 1: 1115})" in out["for _ in range(1000):"]
    assert (
        "'ping from gpus=0',\n 'pong from gpus=1'" in out["from monarch_nb.actors import context"]
    )
    # each counter its own value; the pings of 7 volleys, player 0 serving
    assert "ValueMesh({0: 7, 1: 7})" in out['tally = mesh.spawn("tally", Counter, 0)']
    assert out["lines = players.slice(gpus=0).volley.call_one(players, 7).get()"].strip() == "4"
    trained = out['ps = mesh.slice(gpus=0).spawn("ps", ParameterServer)']
    assert "(2 gradient dicts averaged)" in trained
    first, last = (float(x) for x in trained.split("loss ")[-1].split(" -> "))
    assert last < first / 10
    assert "ZeroDivisionError: division by zero" in out["import os"]
    assert "return 1 / x" in out["import os"]  # the cell's own source line, from the worker
    assert (
        "SupervisionError: actor mesh 'fragile' rank 1 is dead"
        in out["pids = fragile.pid.call().get()"]
    )
    # Whichever says it first names the cause: the worker's own connection closing, or the
    # scheduler removing the worker whose connection closed (a loaded machine orders them
    # either way).
    assert re.search(
        r"fragile rank 1: (the worker process is gone|the scheduler removed the worker: its "
        r"connection to the scheduler closed)",
        out["for name, rank, cause in actors.dead_actors():"],
    )
    assert "and (c) gives 0.5" in out["for name, rank, cause in actors.dead_actors():"]
    # the exercises, unanswered, say so and run on
    asked = [text for line, text in out.items() if line.startswith("answer = ...")]
    asked.append(out["from monarch_nb.examples.exercises import actors as check"])
    assert len(asked) == 5 and all(t.startswith("not answered yet: ") for t in asked), asked


CHECKS = {"05-actors.ipynb": actors}
