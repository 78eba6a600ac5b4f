"""A rank's telemetry: the ``Sample`` schema, the Monitor that reads one from the rank's device
probe (probes.py) and its process, and the Sampler thread that reads ``hz`` times a second while
its rank is busy and every IDLE_EVERY seconds while it is not.

Every probe produces part of the same ``Sample``; a field a library cannot give is ``None``, and
a library that is missing, fails to start or fails on a query degrades to fewer fields, never
to an error. Which physical device a rank's GPU is: devices.py.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypedDict

from monarch_nb.telemetry.probes import HostProbe, open_device_probe

logger = logging.getLogger(__name__)

DEFAULT_HZ = 2.0
MAX_HZ = 50.0
# s between readings of a rank that is not busy: at 2 Hz, the readings (psutil, the GPU's
# library) and their messages to the scheduler were a third of an idle worker's CPU
IDLE_EVERY = 5.0
HZ_ENV = "MONARCH_NB_TELEMETRY_HZ"


class Sample(TypedDict):
    """One reading of one rank. Units: bytes, watts, degrees C; ``util`` and ``cpu`` in %.

    On a CPU worker the "device" is the host: ``mem_used`` is the process's RSS and
    ``mem_total`` the host's memory; ``util``, ``power`` and ``temp`` are None. ``cpu`` is the
    worker process's CPU % (100 = one core busy) and ``rss`` its resident memory, on every kind.
    """

    rank: int | None
    host: str
    time: float
    device: str | None
    kind: str
    util: float | None
    mem_used: int | None
    mem_total: int | None
    power: float | None
    temp: float | None
    cpu: float | None
    rss: int | None


FIELDS = tuple(Sample.__annotations__)
DEVICE_FIELDS = ("device", "util", "mem_used", "mem_total", "power", "temp")


def resolve_hz(hz: float | None = None, env: Mapping[str, str] | None = None) -> float:
    """Sampling rate: ``hz`` if given, else ``$MONARCH_NB_TELEMETRY_HZ``, else 2 Hz; 0 = off.
    A bad ``hz`` is a ValueError; a bad variable is logged and the default used (it is read
    on the workers, where an error would only lose the telemetry)."""
    if hz is not None:
        if hz != hz or hz < 0:
            raise ValueError(f"telemetry rate must be >= 0 Hz, got {hz}")
        return min(float(hz), MAX_HZ)
    text = (os.environ if env is None else env).get(HZ_ENV, "").strip()
    if not text:
        return DEFAULT_HZ
    try:
        return resolve_hz(float(text))
    except ValueError:
        logger.warning("%s=%r is not a rate >= 0; sampling at %g Hz", HZ_ENV, text, DEFAULT_HZ)
        return DEFAULT_HZ


# -- one rank's monitor ----------------------------------------------------------------------
def _device_index(device_info: Mapping[str, Any]) -> int:
    torch_name = str(device_info.get("torch", "cuda:0"))
    _, _, index = torch_name.partition(":")
    return int(index) if index.isdigit() else 0


class Monitor:
    """Reads one Sample of a rank: its device probe (if any) plus its process."""

    def __init__(
        self,
        device_info: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        root: str | Path = "/",
    ):
        info = dict(device_info or detect_device())
        self.kind = str(info.get("kind", "cpu"))
        self.host = socket.gethostname()
        self.device = None
        if self.kind != "cpu":
            self.device = open_device_probe(self.kind, _device_index(info), env, root)
        self.process = HostProbe(info.get("name"))
        self.name = getattr(self.device, "name", None) or info.get("name")

    def read(self, rank: int | None) -> Sample:
        sample: dict[str, Any] = dict.fromkeys(FIELDS)
        sample.update(rank=rank, host=self.host, time=time.time(), device=self.name)
        sample["kind"] = self.kind
        if self.device is not None:
            sample.update(self.device.read())
        sample.update(self.process.read())
        if self.kind == "cpu":
            sample["mem_used"], sample["mem_total"] = sample["rss"], self.process.total
        return sample  # type: ignore[return-value]

    def close(self) -> None:
        if self.device is not None:
            self.device.close()


def detect_device() -> dict[str, Any]:
    """Where no engine says what the worker's device is: cuda:0 if torch sees a GPU, else CPU."""
    try:
        import torch

        if torch.cuda.is_available():
            return {
                "kind": "rocm" if torch.version.hip else "cuda",
                "torch": "cuda:0",
                "name": torch.cuda.get_device_name(0),
            }
    except Exception:
        pass
    import platform

    return {"kind": "cpu", "torch": "cpu", "name": platform.processor() or platform.machine()}


class Sampler:
    """A daemon thread calling ``sink(read())`` ``hz`` times a second until ``stop()``; with
    ``busy``, only while ``busy()`` says so, and every ``idle_every`` seconds otherwise.

    ``busy()`` is asked ``hz`` times a second, so a cell that starts is sampled within one
    interval, as before; it must be cheap (no I/O). ``cpu_seconds`` is the CPU time the thread
    itself has used (``time.thread_time``), which is what the overhead budget (1% of a core) is
    measured against.
    """

    def __init__(
        self,
        read: Callable[[], Any],
        sink: Callable[[Any], None],
        hz: float,
        busy: Callable[[], bool] | None = None,
        idle_every: float = IDLE_EVERY,
    ):
        self.read, self.sink, self.busy = read, sink, busy
        self.interval = 1.0 / hz if hz > 0 else None
        self.idle_every = idle_every
        self.cpu_seconds = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="monarch-telemetry", daemon=True)
        self._failed = False

    def start(self) -> Sampler:
        if self.interval is not None:
            self._thread.start()
        return self

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _due(self, now: float, last: float | None) -> bool:
        if last is None or now - last >= self.idle_every - self.interval / 2:
            return True
        return self.busy is None or bool(self.busy())

    def _run(self) -> None:
        start = time.thread_time()
        due = time.monotonic()
        last = None
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            try:
                now = time.monotonic()
                if self._due(now, last) and (value := self.read()) is not None:
                    last = now  # None: nothing to read yet (a rank without its identity)
                    self.sink(value)
                    self.samples += 1
            except Exception:
                if not self._failed:  # once: a broken sink would otherwise log twice a second
                    logger.exception("telemetry: sampling failed")
                    self._failed = True
            due += self.interval
            now = time.monotonic()
            if due < now:  # fell behind (suspended, overloaded): skip, don't burst
                due = now + self.interval
            self.cpu_seconds = time.thread_time() - start
