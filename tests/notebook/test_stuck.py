"""The live panel of a quiet cell offers ``%monarch stacks``, and says which collective the ranks
wait in when their counts differ: a real 2-rank gloo cluster, rank 1 late to an all_reduce."""

from __future__ import annotations

from _wait import wait_for

from monarch_nb.notebook.stuck import StuckWatch
from monarch_nb.notebook.widgets import LivePanel


def test_a_quiet_cell_s_panel_names_the_collective_the_ranks_wait_in(clean, monkeypatch):
    # The real thresholds are 30 s and 10 s: shortened so that the test takes seconds.
    monkeypatch.setattr(StuckWatch, "quiet_after", 1.0)
    monkeypatch.setattr(StuckWatch, "every", 0.3)
    panel = LivePanel(clean, title="a quiet cell")
    try:
        handle = clean.run(
            "import time, torch, torch.distributed as dist\n"
            "if rank == 1:\n"
            "    time.sleep(4)\n"
            "dist.all_reduce(torch.ones(1))\n",
            block=False,
        )
        panel.track(handle._req)

        def noted() -> bool:
            panel.stuck.poll(panel.request)
            return "rank 1 is at #" in panel.stuck.note(panel.request)

        assert wait_for(noted, 30), panel.stuck.note(panel.request)
        note = panel.stuck.note(panel.request)
        assert note.startswith("no output for ")
        assert "%monarch stacks shows what each rank is doing; rank 0 waits in all_reduce #" in note
        panel.refresh()
        assert "%monarch stacks shows what each rank is doing" in panel.html()
        handle.result(timeout=60)
        panel.stuck.poll(panel.request)
        assert panel.stuck.note(panel.request) == ""  # done: the offer goes
    finally:
        panel.close()


def test_a_cell_that_prints_gets_no_offer(clean, monkeypatch):
    monkeypatch.setattr(StuckWatch, "quiet_after", 1.5)
    monkeypatch.setattr(StuckWatch, "every", 0.3)
    panel = LivePanel(clean, title="a chatty cell")
    try:
        handle = clean.run(
            "import time\nfor i in range(12):\n    print(i, flush=True)\n    time.sleep(0.25)",
            block=False,
        )
        panel.track(handle._req)
        offered = []
        while not handle.done():
            panel.stuck.poll(panel.request)
            offered.append(panel.stuck.note(panel.request))
            handle.wait(0.2)
        handle.result(timeout=60)
        assert not any(offered), offered
    finally:
        panel.close()
