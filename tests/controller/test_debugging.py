"""input(), getpass, post-mortem pdb and breakpoints on ranks, answered from the notebook's
input box: a real ipykernel driven through jupyter_client (answering its stdin requests, as
JupyterLab does) with a real 2-rank cluster."""

from __future__ import annotations

import time

import pytest
from _kernel import KernelProcess

import monarch_nb


class Kernel(KernelProcess):
    """A kernel with a 2-rank cluster; ``run`` answers its prompts from a script."""

    def run(self, code: str, answers=(), timeout: float = 120, ok: bool = True, allow_stdin=True):
        """(everything the cell printed, its errors' tracebacks included; the prompts asked).
        ``answers``: typed at the prompts in turn; a callable gets the prompt and answers."""
        texts: list[str] = []
        prompts: list[dict] = []
        todo = list(answers)
        self.sent: list[tuple] = []  # (when the kernel sent it, text): the channels' own order

        def out(msg):
            content = msg["content"]
            if msg["msg_type"] == "stream":
                texts.append(content["text"])
                self.sent.append((msg["header"]["date"], content["text"]))
            elif msg["msg_type"] == "execute_result":
                texts.append(content["data"]["text/plain"])
            elif msg["msg_type"] == "error":
                texts.append("\n".join(content["traceback"]))

        def stdin(msg):
            prompts.append(msg["content"])
            self.sent.append((msg["header"]["date"], f"<PROMPT {msg['content']['prompt']}>"))
            texts.append(f"<PROMPT {msg['content']['prompt']}>")
            assert todo, f"an unexpected prompt {msg['content']!r}: {''.join(texts)}"
            answer = todo.pop(0)
            self.kc.input(answer(msg["content"]) if callable(answer) else answer)

        reply = self.kc.execute_interactive(
            code, timeout=timeout, output_hook=out, stdin_hook=stdin, allow_stdin=allow_stdin
        )
        text = "".join(texts)
        if ok:
            assert reply["content"]["status"] == "ok", text
        assert not todo, f"answers left over {todo}: {text}"
        return text, prompts


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    k = Kernel(tmp_path_factory.mktemp("debug-kernel"))
    k.run("%load_ext monarch_nb\n%monarch up --workers 2 --cpu --no-dist")
    yield k
    k.run("%monarch down")
    k.close()


def test_debug_before_any_cell_failed_says_so(kernel):
    text, _ = kernel.run("%monarch debug", ok=False)
    assert "no %%monarch cell has failed on this cluster yet" in text


def test_input_on_rank_0_prompts_naming_the_rank(kernel):
    text, prompts = kernel.run(
        "%%monarch --targets 0\nprint('before')\nname = input('name? ')\nprint('got', name)",
        answers=["Ada"],
    )
    assert [p["prompt"] for p in prompts] == ["[rank 0] name? "]
    assert not prompts[0]["password"]
    # what the rank printed before asking shows above the prompt, the answer reaches it
    # (iopub and stdin are separate sockets: the kernel's send times give the order)
    in_order = "".join(t for _, t in sorted(kernel.sent, key=lambda x: x[0]))
    assert in_order.index("[rank 0] before") < in_order.index("<PROMPT")
    assert "[rank 0] got Ada" in text


def test_getpass_on_a_rank_asks_for_a_password(kernel):
    text, prompts = kernel.run(
        "%%monarch --targets 1\nimport getpass\nsecret = getpass.getpass()\nlen(secret)",
        answers=["hunter2"],
    )
    assert prompts == [{"prompt": "[rank 1] Password: ", "password": True}]
    assert "7" in text


def test_input_on_two_ranks_asks_one_at_a_time(kernel):
    text, prompts = kernel.run(
        "%%monarch\nx = input(f'x{rank}? ')\nprint('x is', x)",
        answers=[lambda p: p["prompt"][-4:-2], lambda p: p["prompt"][-4:-2]],
    )
    assert sorted(p["prompt"] for p in prompts) == ["[rank 0] x0? ", "[rank 1] x1? "]
    assert "[rank 0] x is x0" in text and "[rank 1] x is x1" in text


def test_input_where_the_front_end_takes_none_says_so(kernel):
    # nbclient and other front ends without an input box execute with allow_stdin off
    text, prompts = kernel.run(
        "%%monarch --targets 0\n"
        "try:\n    input('x? ')\nexcept EOFError as e:\n    print('EOF:', e)",
        allow_stdin=False,
    )
    assert not prompts
    assert "[rank 0] EOF:" in text and "allow_stdin is off" in text


def test_input_in_a_noblock_cell_says_to_run_it_blocking(kernel):
    kernel.run(
        "%%monarch --noblock --targets 0\ntry:\n    input('?')\nexcept EOFError as e:\n"
        "    why = str(e)"
    )
    deadline = time.monotonic() + 60
    while True:
        text, _ = kernel.run("%%monarch --targets 0\nprint(repr(globals().get('why')))")
        if "None" not in text or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert "run it without --noblock" in text


def test_requests_that_arrive_during_input_run_after_the_cell_in_order(clean, monkeypatch):
    """The rank's thread reads its requests itself: one that arrives while its input() waits
    for the answer is kept, and run after the cell, in order."""
    later = []

    def typed(prompt):
        later.append(clean.run("order.append('second')", targets=0, block=False))
        later.append(clean.run("order.append('third')", targets=0, block=False))
        time.sleep(0.5)  # both reach the rank while it waits
        return f"{prompt}first"

    monkeypatch.setattr("builtins.input", typed)
    clean.run("order = [input('a? ')]", targets=0)
    for handle in later:
        handle.result(timeout=30)
    assert clean.run("order", targets=0).item() == ["[rank 0] a? first", "second", "third"]


def test_interrupt_at_a_prompt_interrupts_the_cell(kernel):
    def interrupt(prompt):
        kernel.km.interrupt_kernel()
        time.sleep(1)
        return "late"

    text, _ = kernel.run(
        "%%monarch --targets 0\ntry:\n    input('go? ')\nexcept KeyboardInterrupt:\n"
        "    print('rank saw the interrupt')\n    raise",
        answers=[interrupt],
        ok=False,
    )
    assert "rank saw the interrupt" in text
    # the rank is free again, its namespace kept
    text, _ = kernel.run("%%monarch --targets 0\nrank + 40")
    assert "40" in text


FAILING = """%%monarch
def scale(v):
    x = v * 10
    return x / (rank - 1)
total = scale(rank + 3)
"""


def test_post_mortem_on_rank_1_prints_a_local_of_a_called_function(kernel):
    text, _ = kernel.run(FAILING, ok=False)
    assert "ZeroDivisionError" in text
    typed = ["p x", "p nothing", "interact", "x + 2", "exit()", "up", "p rank", "!y = 5", "q"]
    text, prompts = kernel.run("%monarch debug", answers=typed)
    assert [p["prompt"] for p in prompts] == ["(Pdb rank 1) "] * 3 + ["[rank 1] >>> "] * 2 + [
        "(Pdb rank 1) "
    ] * 4
    assert "[rank 1] 40" in text  # x in scale(), on rank 1: (1 + 3) * 10
    assert "[rank 1] *** NameError: name 'nothing' is not defined" in text
    assert "[rank 1] 42" in text  # interact sees the frame; exit() goes back to pdb
    assert "[rank 1] (back in pdb)" in text
    assert "[rank 1] 1" in text  # rank, one frame up: the cell's
    # q ended it; the rank is usable and kept its namespace, with what pdb assigned
    text, _ = kernel.run("%%monarch --targets 1\nprint(y, rank)")
    assert "[rank 1] 5 1" in text


def test_plain_debug_after_a_failed_cell_says_to_use_monarch_debug(kernel):
    kernel.run(FAILING, ok=False)
    text, prompts = kernel.run("%debug")
    assert "%monarch debug [--rank R]" in text
    assert not prompts  # no pdb on the notebook's own frames


def test_debug_of_a_rank_that_did_not_fail_says_which_did(kernel):
    kernel.run(FAILING, ok=False)
    text, _ = kernel.run("%monarch debug --rank 0", ok=False)
    assert "rank 0 did not fail in that cell; rank 1 did" in text


def test_a_second_debugger_while_one_is_open_is_refused(clean, monkeypatch):
    with pytest.raises(monarch_nb.CellError) as failed:
        clean.run("def f():\n    z = 3\n    1 / 0\nf()", targets=1)
    said = []

    def typed(prompt):
        if not said:
            with pytest.raises(monarch_nb.ClusterError) as again:
                failed.value.debug(1)
            said.append(str(again.value))
            return "p z"
        return "q"

    monkeypatch.setattr("builtins.input", typed)
    failed.value.debug()
    assert said == ["a debugger is already open on rank 1; end it (q) first"]


def test_debug_after_the_rank_was_restarted_says_the_traceback_is_gone(kernel):
    kernel.run(FAILING, ok=False)
    kernel.run("%monarch restart")
    text, _ = kernel.run("%monarch debug", ok=False)
    assert "rank 1 was restarted since that cell failed" in text


BREAKING = """%%monarch
def step(v):
    w = v + 100
    breakpoint()
    return w
out = step(rank)
print('went on', out)
"""


def test_breakpoint_on_two_ranks_is_continued_one_at_a_time(kernel):
    def slowly(answer):
        def typed(prompt):
            time.sleep(1.5)  # the other rank reaches its breakpoint meanwhile
            return answer

        return typed

    text, prompts = kernel.run(BREAKING, answers=[slowly("p w"), "c", "p w", "c"])
    first, second = prompts[0]["prompt"], prompts[2]["prompt"]
    assert {first, second} == {"(Pdb rank 0) ", "(Pdb rank 1) "}
    assert [p["prompt"] for p in prompts] == [first, first, second, second]
    a, b = int(first[10]), int(second[10])
    # one prompt at a time, naming the rank that waits for its turn
    assert f"(rank {b} waits to be answered next)" in text
    assert f"[rank {a}] {a + 100}" in text and f"[rank {b}] {b + 100}" in text
    assert f"[rank {a}] went on {a + 100}" in text and f"[rank {b}] went on {b + 100}" in text
    assert text.index(f"[rank {a}] went on") < text.index(f"[rank {b}] {b + 100}")


def test_interrupt_at_a_breakpoint_ends_debugging_and_the_cell(kernel):
    def interrupt(prompt):
        kernel.km.interrupt_kernel()
        time.sleep(1)
        return "p w"

    text, _ = kernel.run(BREAKING, answers=[interrupt], ok=False)
    assert "went on" not in text
    assert "KeyboardInterrupt" in text
    # no rank is left in the debugger: both run the next cell
    text, _ = kernel.run("%%monarch\nrank + 10")
    assert "10" in text and "11" in text


def test_breakpoint_in_a_noblock_cell_waits_until_the_notebook_attaches(kernel):
    kernel.run(
        "%%monarch --noblock --targets 0\nw = 41\nbreakpoint()\nleft = w + 1\nprint('left', left)"
    )
    kernel.run("handle = _")
    deadline = time.monotonic() + 60
    while "waiting in the debugger" not in (shown := kernel.run("handle")[0]):
        assert time.monotonic() < deadline, shown
        time.sleep(0.2)
    assert "rank 0 waiting in the debugger (%monarch debug --rank R)" in shown
    text, _ = kernel.run("print(*handle.output, sep='')")
    assert "[rank 0] waits in the debugger: %monarch debug --rank 0 attaches to it" in text
    # the rank waits: nothing ran past the breakpoint, however long nobody answers
    time.sleep(1)
    assert kernel.run("handle.done()")[0].strip() == "False"
    text, prompts = kernel.run("%monarch debug", answers=["p w", "c"])
    assert [p["prompt"] for p in prompts] == ["(Pdb rank 0) "] * 2
    assert "<monarch cell" in text  # where pdb stopped, shown on attaching
    assert "[rank 0] 41" in text
    text, _ = kernel.run("handle.wait(60)\nprint(*handle.output, sep='')")
    assert "[rank 0] left 42" in text
    assert "waiting in the debugger" not in kernel.run("handle")[0]


def test_input_in_a_noblock_cell_and_a_parked_debugger_interrupted(kernel):
    kernel.run("%%monarch --noblock --targets 1\nbreakpoint()\nleft = 'no'")
    kernel.run("handle = _")
    deadline = time.monotonic() + 60
    while "waiting in the debugger" not in kernel.run("handle")[0]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    kernel.run("handle.interrupt()\nhandle.wait(60)")
    text, _ = kernel.run("%%monarch --targets 1\nprint(globals().get('left'))")
    assert "[rank 1] None" in text  # the interrupt ended pdb and the cell; the rank goes on
    text, _ = kernel.run("%monarch debug --rank 0", ok=False)
    assert "waits in the debugger" not in text


ACTOR = """from monarch_nb import Actor, current_rank, endpoint, proc_mesh

def ratio(v):
    top = v * 10
    return top / (v - 1)

class Ratio(Actor):
    @endpoint
    def at(self):
        here = current_rank().rank
        return ratio(here)

ratios = proc_mesh().spawn("ratios", Ratio)
try:
    ratios.at.call().get()
except Exception as e:
    err = e
print(type(err).__name__, err.rank)
"""


def test_post_mortem_on_an_actor_error_prints_a_local_of_a_called_function(kernel):
    text, _ = kernel.run(ACTOR)
    assert "ActorError 1" in text
    text, prompts = kernel.run("err.debug()", answers=["p top", "up", "p here", "q"])
    assert [p["prompt"] for p in prompts] == ["(Pdb rank 1) "] * 4
    assert "[rank 1] ZeroDivisionError: division by zero" in text
    assert "[rank 1] 10" in text  # top in ratio(), on rank 1
    assert "[rank 1] 1" in text  # here, one frame up: the endpoint's
    # %monarch debug right after an ActorError opens the same; %debug points there
    kernel.run("raise err", ok=False)
    text, prompts = kernel.run("%monarch debug", answers=["p top", "q"])
    assert "[rank 1] 10" in text
    kernel.run("raise err", ok=False)
    text, prompts = kernel.run("%debug")
    assert "%monarch debug" in text and not prompts
    # the actor goes on answering
    text, _ = kernel.run("ratios.slice(gpus=0).at.call_one().get()")
    assert "-0.0" in text


def test_debug_of_an_actor_error_replaced_by_a_later_one_says_so(kernel):
    kernel.run(ACTOR + "first = err\nratios.at.call().get()", ok=False)
    text, _ = kernel.run("first.debug()", ok=False)
    assert "an actor call failed on rank 1 since" in text


def test_debug_cell_types_its_lines_at_the_prompts_without_an_input_box(kernel):
    kernel.run(FAILING, ok=False)
    # nbclient executes with allow_stdin off: the cell form needs no input box
    text, prompts = kernel.run("%%monarch debug\np x\nup\np rank\n", allow_stdin=False)
    assert not prompts
    assert "(Pdb rank 1) p x" in text and "[rank 1] 40" in text
    assert "(Pdb rank 1) p rank" in text and "[rank 1] 1" in text
    assert "[rank 1] the cell's pdb commands ended" in text  # past the last line: pdb ends
    text, _ = kernel.run("%%monarch --targets 1\nrank + 1")
    assert "2" in text


def test_debug_opens_the_latest_failure_whichever_cell_ended_last(kernel):
    # A --noblock cell fails on rank 1 at once, then a cell sent after it fails there too and
    # ends first; the --noblock one ends (fails) on rank 0 two seconds later. Rank 1 keeps the
    # later cell's traceback: %monarch debug opened the other and said "%monarch debug opens
    # the latest", of itself.
    kernel.run(
        "%%monarch --noblock --out first\nimport time\nif rank == 0:\n    time.sleep(2)\n"
        "raise ValueError('first')"
    )
    kernel.run("%%monarch --targets 1\nraise KeyError('second')", ok=False)
    kernel.run("assert first.wait(60)")
    for line in ("%%monarch debug\nq", "%%monarch debug --rank 1\nq"):
        text, _ = kernel.run(line, allow_stdin=False)
        assert "[rank 1] KeyError: 'second'" in text, text
    text, _ = kernel.run("%%monarch debug --rank 0\nq", ok=False, allow_stdin=False)
    assert "rank 0 did not fail in that cell; rank 1 did" in text
    text, _ = kernel.run("first.result()", ok=False)
    assert "ValueError: first" in text


def test_eof_of_an_input_without_stdin_shows_only_the_users_frames(kernel):
    kernel.run("%%monarch --noblock --out asking --targets 0\nname = input('name? ')")
    kernel.run("assert asking.wait(60)")
    text, _ = kernel.run("asking.result()", ok=False)
    assert "name = input('name? ')" in text
    assert "EOFError: a rank's input() needs a blocking cell" in text
    assert "debugger.py" not in text and "monarch_nb" not in text, text


ACTOR_BREAK = """from monarch_nb import Actor, current_rank, endpoint, proc_mesh

class Stepper(Actor):
    @endpoint
    def step(self, v):
        w = v + current_rank().rank * 100
        breakpoint()
        return w

steppers = proc_mesh().spawn("steppers", Stepper)
"""


def test_breakpoint_in_an_actor_endpoint_prompts_while_the_call_waits(kernel):
    kernel.run(ACTOR_BREAK)
    text, prompts = kernel.run(
        "steppers.step.call(5).get()", answers=["p w", "c", "p w", "c"], timeout=180
    )
    assert sorted(p["prompt"] for p in prompts) == ["(Pdb rank 0) "] * 2 + ["(Pdb rank 1) "] * 2
    assert "[rank 0] 5" in text and "[rank 1] 105" in text
    assert "waits in the debugger" in text  # the endpoint's own line, tagged by its mesh
    assert "ValueMesh({0: 5, 1: 105})" in text


def test_breakpoint_in_a_broadcast_endpoint_waits_for_monarch_debug(kernel):
    kernel.run(ACTOR_BREAK + "steppers.slice(gpus=1).step.broadcast(7)")
    # the broadcast returns at once: the person types %monarch debug once the endpoint's line
    # (its rank waits in the debugger) is there
    kernel.run(
        "import time\nfrom monarch_nb.actors.stops import stops\n"
        "deadline = time.monotonic() + 60\n"
        "while 1 not in stops.ranks and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)"
    )
    text, prompts = kernel.run("%monarch debug --rank 1", answers=["p w", "c"])
    assert [p["prompt"] for p in prompts] == ["(Pdb rank 1) "] * 2
    assert "[rank 1] 7" in text  # w: the slice's one actor is its rank 0
    # c let it go: no actor thread waits on rank 1 any more
    text, _ = kernel.run(
        "%%monarch --targets 1\nfrom monarch_nb.rank import debugger\nlen(debugger._stops)"
    )
    assert "0" in text
