"""A worker process's own session: out of the kernel's process group, and a keeper that ends
what the worker started once the worker is gone.

JupyterLab's stop button sends SIGINT to the kernel's whole process group. A worker process
the kernel started (``%monarch up``, a LocalCluster made in the notebook) is in that group, and
a KeyboardInterrupt on a Dask worker's event loop ends it. So such a worker starts a session of
its own (``leave_group``); the controller interrupts cells itself. Until it gets there (while
Python starts and imports Dask) it is still in the group, so ``up`` starts its workers from a
thread that blocks SIGINT (``block_interrupts``): a child process inherits the signal mask, the
worker runs with SIGINT blocked, and only the engine's thread, which runs cells and starts
their processes, unblocks it (``unblock_interrupts``), so that an interrupt still reaches what
a cell waits on. Restarted workers come from the same thread, and are covered too.

Leaving the group also takes the worker's descendants (a cell's ``subprocess.Popen``, a shell
command it put in the background) out of reach of the kernel's own clean-up, which kills the
kernel's group when the kernel is restarted or shut down. So each such worker gets a keeper: a
small process in the worker's session that waits for the worker to go (``%monarch down``, a
restart, the kernel's exit or death, a crash) and then ends every process left in the session,
SIGTERM first and SIGKILL 2 s later.

Some libraries' threads poll: gloo's network loop (the process group of CPU workers) waits in
``epoll_wait`` for at most 10 ms, a hundred wake-ups a second for as long as the group lives,
about half of an idle worker's CPU. A wider timer slack lets the kernel end such a thread's
timeouts later and fold them into other wake-ups; what it waits for (a socket, a lock) still
wakes it at once. A thread inherits the slack of the thread that starts it
(``coarse_timers``, 20 ms), and a process allowed to may set another thread's
(``quiet_pollers``, 100 ms). Gloo waits for its loop's wake-ups as it connects and closes: the
group forms about 25 ms slower with the first, and is destroyed about 80 ms slower.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading


def block_interrupts() -> None:
    """Block SIGINT in the calling thread (and the threads and processes it starts)."""
    if hasattr(signal, "pthread_sigmask"):
        # multiprocessing's resource tracker, started with the first child process, unblocks
        # SIGINT in the thread that starts it once it is running: start it first.
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def unblock_interrupts() -> None:
    """Unblock SIGINT in the calling thread (and the threads and processes it starts)."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


# Run with ``python -S``: only the standard library's os, select, signal and time. It waits on
# a pidfd (Linux 5.3), which is readable once the worker has exited, and polls only for the
# moments until the worker is reaped, or where there is no pidfd.
_KEEPER = """
import os, select, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
worker, me = int(sys.argv[1]), os.getpid()

def gone():
    try:
        return os.getsid(worker) != worker  # a reused pid is in another session
    except OSError:
        return True

try:
    exited = os.pidfd_open(worker)
except (AttributeError, OSError):
    exited = None
if exited is not None and not gone():  # gone() after opening: the pidfd is the worker's
    select.select([exited], [], [])

def left():
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in (me, worker):
            try:
                if os.getsid(int(name)) == worker:
                    pids.append(int(name))
            except OSError:
                pass
    return pids

while not gone():
    time.sleep(0.2)
for sig in (signal.SIGTERM, signal.SIGKILL):
    for pid in left():
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    end = time.monotonic() + 2
    while left() and time.monotonic() < end:
        time.sleep(0.05)
"""


def interrupt_group() -> None:
    """SIGINT to this worker's process group, as Jupyter's stop button sends it to a kernel's:
    what a cell started and waits on (``subprocess.run``, ``os.system``) stops too. The worker
    itself and its keeper ignore it. Only in a worker that left the kernel's group (which
    gave SIGINT its own handler): elsewhere the group is not the worker's alone."""
    if signal.getsignal(signal.SIGINT) is _ignore:
        with contextlib.suppress(OSError):
            os.killpg(os.getpid(), signal.SIGINT)


def leave_group(worker, controller: tuple[str, int, int] | list | None) -> bool:
    """Move this worker process to a session of its own, with a keeper, if it shares the
    process group of ``controller`` (host, process group, pid); whether it moved. Only a worker
    in a process of its own (a nanny's) on the controller's host moves; never the controller's
    own process."""
    if not controller or getattr(worker, "nanny", None) is None:
        return False
    host, group, pid = controller
    if host != socket.gethostname() or os.getpid() == pid or os.getpgid(0) != group:
        return False
    try:
        os.setsid()
    except OSError:  # already a group's leader: nothing shares its group
        return False
    if threading.current_thread() is threading.main_thread():
        # A handler, not SIG_IGN: the processes the worker starts get SIGINT's default back.
        signal.signal(signal.SIGINT, _ignore)
    _start_keeper()
    return True


def _ignore(signum, frame) -> None:
    pass


_keeper: subprocess.Popen | None = None


def _start_keeper() -> None:
    global _keeper
    with contextlib.suppress(OSError):  # no keeper: processes may outlive the worker, no more
        _keeper = subprocess.Popen(
            [sys.executable, "-S", "-c", _KEEPER, str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )


POLLERS = ("gloo_tcp_loop",)  # thread names (as the kernel has them) of threads that poll
POLLER_SLACK_NS = 100_000_000
INHERITED_SLACK_NS = 20_000_000
_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30


def _prctl(option: int, value: int = 0) -> int | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, ctypes.c_ulong(value), 0, 0, 0)
    except (AttributeError, OSError):  # not Linux
        return None


@contextlib.contextmanager
def coarse_timers(slack_ns: int = INHERITED_SLACK_NS):
    """Threads started inside start with a timer slack of ``slack_ns``; the calling thread has
    its own back on leaving."""
    own = _prctl(_PR_GET_TIMERSLACK)
    if own is None or own < 0:
        yield
        return
    _prctl(_PR_SET_TIMERSLACK, slack_ns)
    try:
        yield
    finally:
        _prctl(_PR_SET_TIMERSLACK, own)


def quiet_pollers(slack_ns: int | None = POLLER_SLACK_NS) -> int:
    """Set the timer slack of this process's POLLERS threads to ``slack_ns`` (None: the
    calling thread's own, as before ``coarse_timers``); how many were set. Only a process
    allowed to (CAP_SYS_NICE, as root in a container is) may set another thread's: elsewhere
    they keep what they have. Set once the group has formed, taken back before it is
    destroyed."""
    if slack_ns is None:
        slack_ns = _prctl(_PR_GET_TIMERSLACK) or 0  # 0: the thread's default
    count = 0
    with contextlib.suppress(OSError):
        tids = os.listdir("/proc/self/task")
        for tid in tids:
            with contextlib.suppress(OSError):
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() not in POLLERS:
                        continue
                # per thread: only under /proc/<tid>, not /proc/self/task/<tid>
                with open(f"/proc/{tid}/timerslack_ns", "w") as f:
                    f.write(str(slack_ns))
                count += 1
    return count
