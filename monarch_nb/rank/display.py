"""``display()`` and ``clear_output()`` for cells on a rank: what a cell shows reaches the notebook
as the cell's output, in order with its prints."""

from __future__ import annotations

import uuid

from monarch_nb.rank.capture import current_capture

_original_display = None
_original_clear_output = None


def display(*objs, raw: bool = False, display_id=None, update: bool = False, **kwargs):
    """IPython's display() for cells on a rank: each object's mimebundle goes to the notebook.
    ``display_id=True`` returns a handle whose ``update()`` (or ``update_display``) replaces
    that output in place, as in IPython."""
    cap = current_capture()
    if cap is None:
        if _original_display is None:
            return print(*objs)
        return _original_display(*objs, raw=raw, display_id=display_id, update=update, **kwargs)
    outbox, cell_id = cap
    if display_id is True:
        display_id = f"monarch-{uuid.uuid4().hex}"
    for obj in objs:
        if raw:
            data, metadata = obj, kwargs.get("metadata") or {}
        else:
            data, metadata = _formatter().format(obj)
        ev = {"ev": "display", "id": cell_id, "data": data, "metadata": metadata}
        if display_id is not None:
            ev.update(display_id=display_id, update=update)
        outbox.emit(ev)
    if display_id is not None and not update:
        from IPython.display import DisplayHandle

        return DisplayHandle(display_id)
    return None


def clear_output(wait: bool = False) -> None:
    """IPython's clear_output() for cells on a rank: clears the cell's output in the notebook,
    as it does in a kernel (``wait=True``: once the next output arrives). Where several ranks
    clear together, the notebook clears once."""
    cap = current_capture()
    if cap is None:
        if _original_clear_output is not None:
            _original_clear_output(wait=wait)
        return
    outbox, cell_id = cap
    outbox.emit({"ev": "clear", "id": cell_id, "wait": bool(wait)})


_fmt = None


def _formatter():
    global _fmt
    if _fmt is None:
        from IPython.core.formatters import DisplayFormatter

        _fmt = DisplayFormatter()
        _fmt.formatters["image/png"].for_type_by_name("matplotlib.figure", "Figure", _png)
    return _fmt


def _png(fig) -> bytes | None:
    from IPython.core.pylabtools import print_figure

    return print_figure(fig, "png")


def install_display() -> None:
    """Make ``from IPython.display import display, clear_output`` in a cell reach the notebook
    too."""
    global _original_display, _original_clear_output
    import IPython.core.display_functions as functions
    import IPython.display

    if functions.display is not display:
        _original_display = functions.display
        functions.display = display
        IPython.display.display = display
    if functions.clear_output is not clear_output:
        _original_clear_output = functions.clear_output
        functions.clear_output = clear_output
        IPython.display.clear_output = clear_output
