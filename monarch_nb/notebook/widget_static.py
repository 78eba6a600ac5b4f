"""A rank's widget as a static picture: what its output shows once the cluster is down.

A browser removes a widget's view when its comm closes, and a saved notebook reopened without
the widget state saved has no model to draw. So when the twins close (comm_relay.py), each
output that showed a rank's widget is replaced in place by this: HTML drawn from the widget's
last state (a container's children from theirs), controls shown disabled, progress bars as they
ended, plus a text form (a tqdm bar reads as tqdm prints it). The page needs no widget manager
to show it, so a notebook saved and reopened, or read where widgets never run, shows it too.

``render(model_id, states)`` draws one model; ``states(model_id)`` is any model's last state.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from typing import Any

States = Callable[[str], "dict[str, Any] | None"]

REF = "IPY_MODEL_"
BAR = 10  # characters of a progress bar's text form, as tqdm draws it
MAX_DEPTH = 20  # containers in containers; a cycle of references stops here
BAR_COLORS = {
    "success": "var(--jp-success-color1, #4caf50)",
    "info": "var(--jp-info-color1, #0288d1)",
    "warning": "var(--jp-warn-color1, #f57c00)",
    "danger": "var(--jp-error-color1, #d32f2f)",
}
DEFAULT_BAR = "var(--jp-brand-color1, #1976d2)"
DIM = "color: var(--jp-ui-font-color2, #757575)"
FIELD = (
    "display:inline-block; min-width:8em; padding:1px 6px; border:1px solid "
    "var(--jp-border-color1, #bdbdbd); border-radius:2px; "
    "background: var(--jp-layout-color2, #eee); " + DIM
)
TAGS = re.compile(r"<[^>]*>")


def bundle(model_id: str, states: States) -> dict[str, str]:
    """The display bundle that stands for the widget ``model_id``: HTML and plain text."""
    shown, text = render(model_id, states)
    box = '<div class="monarch-widget-static" style="margin: 2px 0">' + shown + "</div>"
    return {"text/html": box, "text/plain": text}


def render(model_id: str, states: States, depth: int = 0) -> tuple[str, str]:
    """(HTML, text) of one model, its children drawn inside it."""
    state = states(model_id) if depth <= MAX_DEPTH else None
    if not state or _hidden(states(_ref(state.get("layout")))):
        return "", ""
    return _DRAW.get(_kind(state), _other)(state, states, depth)


def _kind(state: dict) -> str:
    return str(state.get("_model_name", "")).removesuffix("Model")


def _ref(value) -> str:
    return value[len(REF) :] if isinstance(value, str) and value.startswith(REF) else ""


def _hidden(layout: dict | None) -> bool:
    return bool(layout) and (
        layout.get("display") == "none" or layout.get("visibility") == "hidden"
    )


def _labelled(state: dict, control: str, text: str) -> tuple[str, str]:
    """A control with its description to the left, as ipywidgets lays it out."""
    description = str(state.get("description") or "")
    if not description:
        return control, text
    label = f'<span style="min-width:4em; margin-right:6px">{html.escape(description)}</span>'
    row = f'<div style="display:flex; align-items:center">{label}{control}</div>'
    return row, f"{description} {text}"


def _number(value, fmt: str = "") -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if fmt:
        try:
            return format(value, fmt)
        except ValueError:  # "d" for a float, say
            pass
    return f"{value:g}" if isinstance(value, float) else str(value)


def _fraction(value, low, high) -> float:
    try:
        span = float(high) - float(low)
        return min(1.0, max(0.0, (float(value) - float(low)) / span)) if span else 0.0
    except (TypeError, ValueError):
        return 0.0


# -- the widgets ------------------------------------------------------------------------------
def _box(state: dict, states: States, depth: int) -> tuple[str, str]:
    row = _kind(state) in ("HBox", "Box", "GridBox")
    shown, texts = [], []
    for child in state.get("children") or ():
        drawn, text = render(_ref(child), states, depth + 1)
        if not (drawn or text):
            continue
        shown.append(f"<div>{drawn}</div>")
        texts.append(text)
    flow = "row wrap; align-items:center; gap:4px" if row else "column; gap:2px"
    inner = "".join(shown)
    return f'<div style="display:flex; flex-flow:{flow}">{inner}</div>', ("" if row else "\n").join(
        texts
    )


def _html(state: dict, states: States, depth: int) -> tuple[str, str]:
    value = str(state.get("value") or "")
    text = html.unescape(TAGS.sub("", value)).replace("\u2007", " ")  # tqdm's figure spaces
    return _labelled(state, f"<span>{value}</span>", text)


def _label(state: dict, states: States, depth: int) -> tuple[str, str]:
    value = str(state.get("value") or "")
    return _labelled(state, f"<span>{html.escape(value)}</span>", value)


def _progress(state: dict, states: States, depth: int) -> tuple[str, str]:
    part = _fraction(state.get("value", 0), state.get("min", 0), state.get("max", 100))
    style = states(_ref(state.get("style"))) or {}
    color = style.get("bar_color") or BAR_COLORS.get(state.get("bar_style") or "", DEFAULT_BAR)
    bar = (
        '<div class="monarch-bar" style="width:300px; max-width:100%; height:14px; '
        f'background: var(--jp-layout-color3, #e0e0e0)"><div style="width:{100 * part:.1f}%; '
        f'height:100%; background:{html.escape(str(color))}"></div></div>'
    )
    filled = round(BAR * part)
    return _labelled(state, bar, "|" + "█" * filled + " " * (BAR - filled) + "|")


def _slider(state: dict, states: States, depth: int) -> tuple[str, str]:
    value, low, high = state.get("value"), state.get("min", 0), state.get("max", 100)
    ends = value if isinstance(value, list | tuple) and len(value) == 2 else [value, value]
    start, end = (_fraction(v, low, high) for v in ends)
    fmt = str(state.get("readout_format") or "")
    shown = " – ".join(dict.fromkeys(_number(v, fmt) for v in ends))
    track = (
        '<div style="position:relative; width:180px; height:4px; margin:0 8px; '
        f'background: var(--jp-layout-color3, #e0e0e0)"><div style="position:absolute; '
        f"left:{100 * start:.1f}%; width:{100 * (end - start):.1f}%; height:100%; "
        'background: var(--jp-layout-color4, #9e9e9e)"></div>'
        + "".join(
            f'<div style="position:absolute; left:calc({100 * f:.1f}% - 6px); top:-5px; '
            "width:12px; height:12px; border-radius:6px; "
            'background: var(--jp-layout-color4, #9e9e9e)"></div>'
            for f in dict.fromkeys((start, end))
        )
        + "</div>"
    )
    control = (
        f'<div style="display:flex; align-items:center">{track}'
        f'<span style="{DIM}">{html.escape(shown)}</span></div>'
    )
    return _labelled(state, control, shown)


def _field(state: dict, states: States, depth: int) -> tuple[str, str]:
    value = state.get("value")
    if state.get("_model_name") == "PasswordModel":
        value = "•" * 8 if value else ""
    shown = _number(value) if value is not None else ""
    return _labelled(state, f'<span style="{FIELD}">{html.escape(shown)}</span>', shown)


def _check(state: dict, states: States, depth: int) -> tuple[str, str]:
    mark = "☑" if state.get("value") else "☐"
    description = html.escape(str(state.get("description") or ""))
    return f'<span style="{DIM}">{mark} {description}</span>', f"{mark} {description}".strip()


def _button(state: dict, states: States, depth: int) -> tuple[str, str]:
    pressed = state.get("_model_name") == "ToggleButtonModel" and state.get("value")
    description = str(state.get("description") or "")
    background = "var(--jp-layout-color3, #e0e0e0)" if pressed else "var(--jp-layout-color2, #eee)"
    button = (
        f'<span style="{FIELD}; text-align:center; background:{background}">'
        f"{html.escape(description)}</span>"
    )
    return button, f"[{description}]"


def _choice(state: dict, states: States, depth: int) -> tuple[str, str]:
    labels = list(state.get("_options_labels") or ())
    index = state.get("index")
    chosen = [index] if isinstance(index, int) else list(index or ())
    shown = ", ".join(str(labels[i]) for i in chosen if isinstance(i, int) and 0 <= i < len(labels))
    return _labelled(state, f'<span style="{FIELD}">{html.escape(shown)}</span>', shown)


def _output(state: dict, states: States, depth: int) -> tuple[str, str]:
    shown, texts = [], []
    for out in state.get("outputs") or ():
        data = out.get("data") or {}
        if out.get("output_type") == "stream":
            text = str(out.get("text", ""))
            shown.append(f'<pre style="margin:0">{html.escape(text)}</pre>')
            texts.append(text)
        elif "text/html" in data:
            shown.append(f"<div>{data['text/html']}</div>")
            texts.append(str(data.get("text/plain", "")))
        elif "image/png" in data:
            shown.append(f'<img src="data:image/png;base64,{data["image/png"]}">')
            texts.append(str(data.get("text/plain", "")))
        elif "text/plain" in data:
            shown.append(f'<pre style="margin:0">{html.escape(str(data["text/plain"]))}</pre>')
            texts.append(str(data["text/plain"]))
    return "".join(shown), "".join(texts)


def _other(state: dict, states: States, depth: int) -> tuple[str, str]:
    """A widget without a drawing here: its kind, and its value where it has one."""
    kind = str(state.get("_model_name", "widget")).removesuffix("Model")
    value = state.get("value")
    text = kind if value is None or isinstance(value, dict | list) else f"{kind}: {value}"
    return _labelled(state, f'<span style="{DIM}">{html.escape(text)}</span>', text)


_DRAW = {
    **dict.fromkeys(("HBox", "VBox", "Box", "GridBox", "Accordion", "Tab", "Stack"), _box),
    **dict.fromkeys(("HTML", "HTMLMath"), _html),
    "Label": _label,
    **dict.fromkeys(("FloatProgress", "IntProgress"), _progress),
    **dict.fromkeys(
        ("IntSlider", "FloatSlider", "FloatLogSlider", "IntRangeSlider", "FloatRangeSlider"),
        _slider,
    ),
    **dict.fromkeys(
        (
            "Text",
            "Textarea",
            "Password",
            "IntText",
            "FloatText",
            "BoundedIntText",
            "BoundedFloatText",
            "Combobox",
            "DatePicker",
            "ColorPicker",
        ),
        _field,
    ),
    **dict.fromkeys(("Checkbox", "Valid"), _check),
    **dict.fromkeys(("Button", "ToggleButton"), _button),
    **dict.fromkeys(
        (
            "Dropdown",
            "Select",
            "RadioButtons",
            "ToggleButtons",
            "SelectionSlider",
            "SelectMultiple",
            "SelectionRangeSlider",
        ),
        _choice,
    ),
    "Output": _output,
}
