"""Widgets and progress from ranks, in a real ipykernel driven through jupyter_client as a
browser drives it, with a real local cluster: a rank's widget opens its twin comm in the
kernel, the browser's messages reach the rank while a cell runs, the rank's changes reach the
browser, tqdm.notebook gives a bar per rank, carriage-return progress updates live, a dead
rank's widgets say so without hanging anything, and at down every rank's widget stays on the
page as a picture of its last state."""

from __future__ import annotations

import os
import signal
import uuid

import pytest
from _kernel import CellKernel, summary

pytest.importorskip("ipywidgets")
pytest.importorskip("tqdm")


class Kernel(CellKernel):
    """A kernel with a 2-rank cluster, to which the browser's widget messages are sent."""

    def comm_msg(self, comm_id: str, data: dict) -> None:
        """What the browser sends to a widget's comm."""
        msg = self.kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data})
        self.kc.shell_channel.send(msg)


def text(msgs: list[dict]) -> str:
    return "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream")


def of_type(msgs: list[dict], kind: str) -> list[dict]:
    return [m for m in msgs if m["msg_type"] == kind]


def opened(msgs: list[dict], model: str) -> list[dict]:
    """The contents of the comm_opens of widgets of ``model`` (``IntSliderModel``)."""
    return [
        m["content"]
        for m in of_type(msgs, "comm_open")
        if m["content"]["data"]["state"].get("_model_name") == model
    ]


def updates(msgs: list[dict], comm_id: str) -> list[dict]:
    """The state updates the kernel sent for ``comm_id``."""
    return [
        m["content"]["data"]["state"]
        for m in of_type(msgs, "comm_msg")
        if m["content"]["comm_id"] == comm_id and m["content"]["data"].get("method") == "update"
    ]


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    runtime = tmp_path_factory.mktemp("runtime")
    old = os.environ.get("JUPYTER_RUNTIME_DIR")
    os.environ["JUPYTER_RUNTIME_DIR"] = str(runtime)
    k = Kernel(runtime)
    try:
        k.run("%load_ext monarch_nb\n%monarch up --workers 2 --cpu --no-dist")
        yield k
    finally:
        k.close()
        if old is None:
            os.environ.pop("JUPYTER_RUNTIME_DIR", None)
        else:
            os.environ["JUPYTER_RUNTIME_DIR"] = old


def slider(kernel: Kernel, rank: int, name: str = "s", value: int = 3) -> str:
    """Display an IntSlider on ``rank``; its comm id."""
    msgs = kernel.run(
        f"%%monarch --targets {rank}\nfrom ipywidgets import IntSlider\n"
        f"{name} = IntSlider(value={value})\ndisplay({name})"
    )
    opens = opened(msgs, "IntSliderModel")
    assert len(opens) == 1, summary(msgs)
    return opens[0]["comm_id"]


def test_a_widget_on_a_rank_opens_its_comm_in_the_kernel_before_its_display(kernel):
    msgs = kernel.run(
        "%%monarch --targets 0\nfrom ipywidgets import IntSlider\ndisplay(IntSlider(3))"
    )
    kinds = [m["msg_type"] for m in msgs]
    assert "comm_open" in kinds and "display_data" in kinds, summary(msgs)
    last_open = max(i for i, kind in enumerate(kinds) if kind == "comm_open")
    assert last_open < kinds.index("display_data")
    content = opened(msgs, "IntSliderModel")[0]
    assert content["target_name"] == "jupyter.widget"
    state = content["data"]["state"]
    assert (state["_model_name"], state["value"]) == ("IntSliderModel", 3)
    view = of_type(msgs, "display_data")[0]["content"]["data"]
    assert view["application/vnd.jupyter.widget-view+json"]["model_id"] == content["comm_id"]
    assert "[rank 0]" in text(msgs)  # the display is tagged with its rank


def test_the_browser_moves_a_slider_on_a_rank_while_a_cell_loops_on_it(kernel):
    comm_id = slider(kernel, 0)
    msg_id = kernel.start(
        "%%monarch --targets 0\nimport time\nt0 = time.time()\nprint('looping')\n"
        "while s.value != 7 and time.time() - t0 < 60:\n    time.sleep(0.02)\n"
        "print('saw', s.value, 'after', round(time.time() - t0))"
    )
    kernel.messages(msg_id, until=lambda m: "looping" in m["content"].get("text", ""))
    kernel.comm_msg(comm_id, {"method": "update", "state": {"value": 7}, "buffer_paths": []})
    msgs = kernel.messages(msg_id, timeout=90)
    assert "[rank 0] saw 7 after" in text(msgs), summary(msgs)
    after = int(text(msgs).split("after ")[1].split()[0])
    assert after < 30  # moved while the cell ran, not once it had given up


def test_a_value_set_on_the_rank_moves_the_widget_in_the_browser(kernel):
    comm_id = slider(kernel, 1, "t")
    msgs = kernel.run("%%monarch --targets 1\nt.value = 42")
    assert {"value": 42} in updates(msgs, comm_id), summary(msgs)


def test_a_rank_setting_a_value_in_a_tight_loop_is_throttled_and_ends_right(kernel):
    comm_id = slider(kernel, 0, "f")
    msgs = kernel.run(
        "%%monarch --targets 0\nf.max = 10**9\nfor i in range(20_000):\n    f.value = i\n"
        "print('done')"
    )
    values = [u["value"] for u in updates(msgs, comm_id) if "value" in u]
    assert values[-1] == 19_999, values[-5:]  # the last state, before the cell's end
    assert len(values) < 500, len(values)
    assert "[rank 0] done" in text(msgs)


def test_interact_on_a_rank_shows_its_output_under_its_controls_and_follows_them(kernel):
    msgs = kernel.run(
        "%%monarch --targets 0\nfrom ipywidgets import interact\n"
        "def f(x):\n    print('x is', x)\n"
        "w = interact(f, x=5)"
    )
    opens = {m["content"]["data"]["state"]["_model_name"]: m for m in of_type(msgs, "comm_open")}
    assert {"IntSliderModel", "OutputModel", "VBoxModel"} <= set(opens), summary(msgs)
    out_id = opens["OutputModel"]["content"]["comm_id"]
    shown = [o for u in updates(msgs, out_id) for o in u.get("outputs", ())]
    assert {"output_type": "stream", "name": "stdout", "text": "x is 5\n"} in shown
    assert "x is 5" not in text(msgs)  # in the widget, not the cell
    kernel.comm_msg(
        opens["IntSliderModel"]["content"]["comm_id"],
        {"method": "update", "state": {"value": 6}, "buffer_paths": []},
    )

    def shows_6(m):
        return m["msg_type"] == "comm_msg" and "x is 6" in str(m["content"]["data"])

    kernel.messages("", timeout=30, until=shows_6)


def test_tqdm_notebook_on_two_ranks_gives_a_live_bar_per_rank(kernel):
    msgs = kernel.run(
        "%%monarch\nimport time\nfrom tqdm.notebook import tqdm\n"
        "for _ in tqdm(range(20), desc=f'rank {rank}'):\n    time.sleep(0.02)"
    )
    bars = [
        m["content"]["comm_id"]
        for m in of_type(msgs, "comm_open")
        if m["content"]["data"]["state"]["_model_name"] == "FloatProgressModel"
    ]
    assert len(bars) == 2, summary(msgs)
    for bar in bars:
        values = [u["value"] for u in updates(msgs, bar) if "value" in u]
        assert len(set(values)) >= 2 and values[-1] == 20, values  # live, and it ends full
        styles = [u["bar_style"] for u in updates(msgs, bar) if "bar_style" in u]
        assert styles[-1:] == ["success"], styles
    # Each bar is shown under its rank's tag, as every display from a rank is.
    shown = [m for m in msgs if m["msg_type"] in ("stream", "display_data")]
    tags = [
        shown[i - 1]["content"]["text"].splitlines()[-1]
        for i, m in enumerate(shown)
        if m["msg_type"] == "display_data"
        and "application/vnd.jupyter.widget-view+json" in m["content"]["data"]
    ]
    assert sorted(tags) == ["[rank 0]", "[rank 1]"], summary(msgs)


def test_tqdm_auto_on_ranks_gives_bars_where_the_notebook_shows_widgets(kernel):
    msgs = kernel.run(
        "%%monarch\nimport warnings\nwarnings.simplefilter('ignore')\n"
        "from tqdm.auto import tqdm\nfor _ in tqdm(range(5)):\n    pass"
    )
    assert len(opened(msgs, "FloatProgressModel")) == 2, summary(msgs)


def test_carriage_return_progress_updates_live_per_rank(kernel):
    msgs = kernel.run(
        "%%monarch\nimport sys, time\nfor i in range(40):\n"
        "    sys.stdout.write(f'\\rstep {i}'); sys.stdout.flush(); time.sleep(0.05)\nprint()"
    )
    live = [
        m["content"]["data"]["text/plain"]
        for m in msgs
        if m["msg_type"] in ("display_data", "update_display_data")
    ]
    steps = {line for shown in live for line in shown.splitlines() if line.startswith("[rank")}
    assert len({s for s in steps if s.startswith("[rank 0] step")}) >= 3, live
    assert len({s for s in steps if s.startswith("[rank 1] step")}) >= 3, live
    assert "step 39" in text(msgs)


def test_a_flood_of_carriage_returns_is_throttled_and_nothing_else_is_lost(kernel):
    msgs = kernel.run(
        "%%monarch\nimport sys\nprint('before', rank)\n"
        "for i in range(100_000):\n    sys.stdout.write(f'\\r{i}')\n"
        "print()\nprint('after', rank)"
    )
    out = text(msgs)
    for rank in (0, 1):
        assert f"[rank {rank}] before {rank}" in out and f"[rank {rank}] after {rank}" in out
    assert "99999" in out  # the last state
    assert len(msgs) < 200, len(msgs)


def states_told(kernel: Kernel) -> dict:
    """What a page that loads the notebook is told of every widget: the answer to
    ``request_states`` on ipywidgets' control comm, as a browser opens it."""
    control = f"control-{uuid.uuid4().hex}"
    kernel.kc.shell_channel.send(
        kernel.kc.session.msg(
            "comm_open",
            {"comm_id": control, "target_name": "jupyter.widget.control", "data": {}},
            metadata={"version": "1.0.0"},
        )
    )
    kernel.comm_msg(control, {"method": "request_states"})
    answers = kernel.messages(
        "", timeout=30, until=lambda m: m["content"].get("comm_id") == control
    )
    assert answers[-1]["content"]["data"]["method"] == "update_states", summary(answers)
    return answers[-1]


def test_a_reloaded_page_is_told_of_the_ranks_widgets_as_they_are_now(kernel):
    """A page that loads (or reloads) the notebook asks for every widget's state at once on
    ipywidgets' control comm, and builds only the models it is told of: the answer has the
    ranks' widgets, with what was set on the rank and in the browser since, and their bytes."""
    comm_id = slider(kernel, 0, "r", value=1)
    kernel.comm_msg(comm_id, {"method": "update", "state": {"value": 2}, "buffer_paths": []})
    msgs = kernel.run(
        "%%monarch --targets 0\nr.max = 50\nfrom ipywidgets import Image\n"
        "img = Image(value=b'first')\ndisplay(img)\nimg.value = b'second'"
    )
    image = opened(msgs, "ImageModel")[0]["comm_id"]
    own = text(kernel.run("import ipywidgets\nown = ipywidgets.IntText(5)\nprint(own.model_id)"))
    own = own.split()[-1]
    answer = states_told(kernel)
    data = answer["content"]["data"]
    states = data["states"]
    assert states[comm_id]["model_name"] == "IntSliderModel"
    assert states[comm_id]["state"]["value"] == 2  # moved in the browser
    assert states[comm_id]["state"]["max"] == 50  # set on the rank
    layout = states[comm_id]["state"]["layout"].removeprefix("IPY_MODEL_")
    assert states[layout]["model_name"] == "LayoutModel"  # the models it refers to too
    where = data["buffer_paths"].index([image, "state", "value"])
    assert bytes(answer["buffers"][where]) == b"second"
    assert states[own]["state"]["value"] == 5  # and the kernel's own, as before


def test_a_dead_ranks_widget_says_it_is_disconnected_and_answers(kernel):
    comm_id = slider(kernel, 1, "d")
    pid = int(text(kernel.run("%%monarch --targets 1\nimport os\nprint(os.getpid())")).split()[-1])
    os.kill(pid, signal.SIGKILL)

    def disabled(m):
        return (
            m["msg_type"] == "comm_msg"
            and m["content"]["comm_id"] == comm_id
            and m["content"]["data"].get("state", {}).get("disabled") is True
        )

    kernel.messages("", timeout=60, until=disabled)
    kernel.comm_msg(comm_id, {"method": "update", "state": {"value": 9}, "buffer_paths": []})
    kernel.messages("", timeout=10, until=disabled)  # answered, from the last state
    kernel.comm_msg(comm_id, {"method": "request_state"})
    kernel.messages("", timeout=10, until=disabled)


VIEW = "application/vnd.jupyter.widget-view+json"


def test_at_down_each_ranks_widget_stays_as_a_picture_of_its_last_state(kernel):
    """A browser removes the view of a widget whose comm closes, and a notebook reopened has
    no model to draw: at down each output that showed a rank's widget is replaced in place by
    its last state as HTML and text (what the page, and the saved notebook, keep), and the
    twins stay open, disabled, for a page loaded since, whose outputs have no display ids.
    (Last in the module: it takes the cluster down.)"""
    msgs = kernel.run(
        "%%monarch --targets 0\nimport time\nfrom tqdm.notebook import tqdm\n"
        "for _ in tqdm(range(12), desc='kept'):\n    time.sleep(0.01)\n"
        "from ipywidgets import IntSlider\nlr = IntSlider(value=4, description='lr')\n"
        "display(lr)\nlr.value = 6"
    )
    shown = {
        m["content"]["transient"]["display_id"]: m["content"]["data"][VIEW]["model_id"]
        for m in of_type(msgs, "display_data")
        if VIEW in m["content"]["data"]
    }
    assert len(shown) == 2, summary(msgs)
    lr = opened(msgs, "IntSliderModel")[0]["comm_id"]
    msgs = kernel.run("%monarch down")
    frozen = {
        m["content"]["transient"]["display_id"]: m["content"]["data"]
        for m in of_type(msgs, "update_display_data")
    }
    assert set(shown) <= set(frozen), summary(msgs)
    texts = sorted(frozen[display_id]["text/plain"] for display_id in shown)
    assert texts[0].startswith("kept: 100%|██████████| 12/12 ["), texts
    assert texts[1] == "lr 6", texts
    for display_id in shown:
        assert VIEW not in frozen[display_id] and "<div" in frozen[display_id]["text/html"]
    assert {"disabled": True} in updates(msgs, lr), summary(msgs)
    assert not of_type(msgs, "comm_close"), summary(msgs)

    # a page loaded since builds them as they ended, and moving the slider moves nothing
    told = states_told(kernel)["content"]["data"]["states"]
    assert told[lr]["state"]["value"] == 6 and told[lr]["state"]["disabled"] is True
    assert set(shown.values()) <= set(told)
    kernel.comm_msg(lr, {"method": "update", "state": {"value": 9}, "buffer_paths": []})
    answered = kernel.messages("", timeout=10, until=lambda m: m["content"].get("comm_id") == lr)
    back = answered[-1]["content"]["data"]["state"]
    assert (back["value"], back["description"]) == (6, "lr"), summary(answered)
