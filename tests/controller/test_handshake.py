"""What our Dask comms read before their handshake is bounded (issue 47, handshake.py): a
stranger on a scheduler's port (an SSH client's banner, a length that claims 4 GiB) is hung up
on at once, with nothing allocated for it and no traceback logged, by the kernel's own scheduler
and by a kept cluster's host; attaching to a kept cluster whose host does not answer (stopped)
ends within ATTACH_TIMEOUT, in one line."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import tracemalloc

import pytest
from _peers import CLAIMS_4_GIB, SSH_BANNER
from _wait import wait_for

import monarch_nb
from monarch_nb import kept
from monarch_nb.controller import start
from monarch_nb.errors import ClusterError

NAME = "handshake-test"


def hung_up_on(address: str, data: bytes, within: float = 10) -> bool:
    """Whether the listener at ``address``, sent ``data`` first, closes the connection within
    ``within`` seconds (after its own handshake: a Dask listener speaks first)."""
    host, port = address.split("://", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=within) as sock:
        sock.sendall(data)
        deadline = time.monotonic() + within
        try:
            while sock.recv(65536):
                sock.settimeout(max(0.01, deadline - time.monotonic()))
        except TimeoutError:
            return False
    return True


def test_the_kernels_scheduler_hangs_up_on_a_stranger_at_once(clean):
    # Dask allocated what the first 8 bytes claim and waited for them: 4 GiB here
    tracemalloc.start()
    try:
        assert hung_up_on(clean.client.scheduler.address, CLAIMS_4_GIB + b"x" * 1000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**28, peak
    assert clean.run("rank").values() == [0, 1]


@pytest.fixture(scope="module")
def held(runtime):
    """A kept 1-rank cluster; ``held["ctl"]`` is the controller that holds it now."""
    ctl = monarch_nb.up(workers=1, cpu=True, dist=False, keep="10m", name=NAME, current=False)
    box = {"ctl": ctl, "entry": ctl.kept}
    yield box
    if not box["ctl"].closed:
        box["ctl"].down()
    kept.stop_host(ctl.kept)  # what a failure left detached


def test_a_kept_host_logs_no_traceback_for_an_ssh_banner(held):
    # its first 8 bytes claim 2.82 EiB: numpy refused them, with a traceback in the host's log
    entry = held["entry"]
    assert hung_up_on(entry["scheduler_address"], SSH_BANNER)
    log = kept.log_path(entry["id"])
    assert not wait_for(lambda: "Traceback" in log.read_text(), timeout=3), log.read_text()
    assert "MemoryError" not in log.read_text()
    assert held["ctl"].run("rank").values() == [0]


def test_a_kept_host_hangs_up_on_a_claim_of_4_gib(held):
    # which it allocated, and waited for
    assert hung_up_on(held["entry"]["scheduler_address"], CLAIMS_4_GIB + b"x" * 1000)
    assert held["ctl"].run("rank").values() == [0]


def test_attaching_to_a_stopped_kept_host_ends_within_its_timeout(held, monkeypatch):
    # A stopped host takes connections (its kernel does) and never answers: attach waited for
    # as long as it stayed stopped (here until the timer sends SIGCONT, without the fix).
    monkeypatch.setattr(start, "ATTACH_TIMEOUT", 2)  # 8 s: the bound is the same at any value
    address, pid = held["entry"]["scheduler_address"], held["entry"]["pid"]
    held["ctl"].detach()
    os.kill(pid, signal.SIGSTOP)
    go_on = threading.Timer(60, os.kill, (pid, signal.SIGCONT))
    go_on.start()
    try:
        began = time.monotonic()
        with pytest.raises(ClusterError) as caught:
            held["ctl"] = monarch_nb.attach(NAME, current=False)
        took = time.monotonic() - began
    finally:
        go_on.cancel()
        os.kill(pid, signal.SIGCONT)
    assert took < start.ATTACH_TIMEOUT + 20, took
    assert str(caught.value) == (
        f"cannot attach to kept cluster {NAME}: {address} took the connection but sent no "
        f"Dask handshake within {start.ATTACH_TIMEOUT} s (a scheduler stopped or too busy to "
        "answer, or no scheduler at all)"
    )
    monkeypatch.undo()
    held["ctl"] = monarch_nb.attach(NAME, current=False)  # once it goes on, as it was
    assert held["ctl"].run("rank").values() == [0]
