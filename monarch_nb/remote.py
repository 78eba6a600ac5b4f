"""Functions the controller sends to run on a rank's engine, in the rank's own thread."""

from __future__ import annotations

from typing import Any

import cloudpickle


def push(engine, payload: dict[str, bytes]) -> None:
    for name, blob in payload.items():
        engine.namespace[name] = cloudpickle.loads(blob)


def pull(engine, names: list[str]) -> list[Any]:
    missing = [n for n in names if n not in engine.namespace]
    if missing:
        raise NameError(f"name {missing[0]!r} is not defined")
    return [engine.namespace[n] for n in names]


def reset(engine) -> int:
    count = len([k for k in engine.namespace if not k.startswith("_")])
    engine.reset_namespace()
    return count
