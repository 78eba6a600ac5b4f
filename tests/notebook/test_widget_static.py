"""A rank's widget drawn from its last state, as its output shows it once the cluster is down:
states as real ipywidgets models hold them (``get_state()``), children by reference."""

from __future__ import annotations

import pytest

from monarch_nb.notebook.widget_static import bundle, render

ipywidgets = pytest.importorskip("ipywidgets")


def states_of(*widgets):
    """Every model reachable from ``widgets`` (children, layouts, styles), by model id."""
    found = {}

    def walk(w):
        if w.model_id in found:
            return
        found[w.model_id] = w.get_state()
        for value in vars(w).get("_trait_values", {}).values():
            for item in value if isinstance(value, tuple | list) else (value,):
                if isinstance(item, ipywidgets.Widget):
                    walk(item)

    for w in widgets:
        walk(w)
    return found.get


def test_a_box_draws_its_children_in_order_and_leaves_out_hidden_ones():
    hidden = ipywidgets.Label("not shown", layout=ipywidgets.Layout(visibility="hidden"))
    box = ipywidgets.VBox(
        [
            ipywidgets.HTML("<b>a &lt; b</b>"),
            ipywidgets.Checkbox(True, description="ready"),
            hidden,
            ipywidgets.Dropdown(options=["sgd", "adam"], value="adam", description="opt"),
            ipywidgets.FloatRangeSlider(value=[0.25, 0.5], min=0, max=1, readout_format=".2f"),
        ]
    )
    shown, text = render(box.model_id, states_of(box))
    assert text.splitlines() == ["a < b", "☑ ready", "opt adam", "0.25 – 0.50"]
    assert "<b>a &lt; b</b>" in shown and "not shown" not in shown


def test_a_progress_bar_keeps_its_color_and_its_fill():
    bar = ipywidgets.IntProgress(value=3, max=4, bar_style="danger")
    picture = bundle(bar.model_id, states_of(bar))
    assert picture["text/plain"] == "|████████  |"
    assert "width:75.0%" in picture["text/html"] and "--jp-error-color1" in picture["text/html"]


def test_a_password_stays_hidden_and_an_unknown_widget_says_what_it_was():
    secret = ipywidgets.Password("hunter2", description="key")
    assert "hunter2" not in str(bundle(secret.model_id, states_of(secret)))
    picker = ipywidgets.Play(value=7)
    assert render(picker.model_id, states_of(picker))[1] == "Play: 7"


def test_a_box_that_holds_itself_ends():
    states = {"a": {"_model_name": "HBoxModel", "children": ["IPY_MODEL_a"]}}
    shown, _ = render("a", states.get)
    assert shown.count("<div") < 100
    assert render("missing", states.get) == ("", "")
