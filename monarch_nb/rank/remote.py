"""Functions the controller sends to run on a rank's engine, in the rank's own thread, and
how what they bring back is joined."""

from __future__ import annotations

from typing import Any

import cloudpickle


def push(engine, payload: dict[str, bytes]) -> None:
    for name, blob in payload.items():
        engine.namespace[name] = cloudpickle.loads(blob)


def pull(engine, names: list[str]) -> list[bytes | str]:
    """Each value pickled on its own, or why it cannot be: the controller can then name the value
    that cannot travel, where one pickling error for them all would not say which."""
    missing = [n for n in names if n not in engine.namespace]
    if missing:
        raise NameError(f"name {missing[0]!r} is not defined")
    out: list[bytes | str] = []
    for name in names:
        value = engine.namespace[name]
        try:
            out.append(cloudpickle.dumps(value, protocol=5))
        except Exception as e:
            out.append(f"{type(value).__name__} cannot be pickled ({e})")
    return out


def reset(engine) -> int:
    count = len([k for k in engine.namespace if not k.startswith("_")])
    engine.reset_namespace()
    return count


def concat(values: list[Any]) -> Any:
    """Values pulled from the ranks joined in rank order: lists, tuples, strings, tensors and
    arrays are concatenated; anything else comes back as a list."""
    if not values:
        return []
    first = values[0]
    if isinstance(first, list | tuple):
        out = [x for v in values for x in v]
        return tuple(out) if isinstance(first, tuple) else out
    if isinstance(first, str):
        return "".join(values)
    mod = type(first).__module__.split(".")[0]
    if mod == "torch":  # 0-d values (a loss, say) are stacked: there is no axis to join along
        import torch

        return torch.stack(values) if first.dim() == 0 else torch.cat(values)
    if mod == "numpy":  # numpy scalars (np.float64) are 0-d as well
        import numpy

        return numpy.stack(values) if numpy.ndim(first) == 0 else numpy.concatenate(values)
    return list(values)
