"""``RDMABuffer`` over the actors' own connections, as torchmonarch's TCP path does where there is
no RDMA hardware: a buffer is a small picklable reference to a 1-D contiguous tensor (or
memoryview) in the process that made it; ``read_into`` and ``write_from`` move its bytes from
any other process through that process's actor address.

The owner keeps the memory referenced until ``drop()``; nothing copies it when the reference is
made or sent. A read asks the owner for the bytes (``op: "rdma_read"``, answered on its actor
I/O thread, without waiting for any actor) and copies them into the destination; a write sends
them. As in torchmonarch, the caller keeps the memory unchanged while a transfer runs.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

from monarch_nb.actors import here
from monarch_nb.actors.mailbox import Pending
from monarch_nb.actors.wire import Future

_owned: dict[str, Any] = {}  # buffer id -> the memory this process lent
_lock = threading.Lock()


def _nbytes(data: Any) -> int:
    if isinstance(data, memoryview):
        return data.nbytes
    return data.numel() * data.element_size()


def _checked(data: Any, what: str) -> Any:
    """``data`` if it is a 1-D contiguous tensor or C-contiguous memoryview, else one line."""
    if isinstance(data, memoryview):
        if data.ndim != 1 or not data.c_contiguous:
            raise ValueError(
                f"{what} must be 1-D and contiguous (a memoryview of {data.ndim} dims)"
            )
        return data
    import torch

    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor or memoryview, not {type(data).__name__}")
    if data.dim() != 1 or not data.is_contiguous():
        raise ValueError(
            f"{what} must be 1-D and contiguous, not of shape {tuple(data.shape)}: pass "
            "tensor.view(torch.uint8).flatten() of a contiguous tensor"
        )
    return data


def _bytes_of(data: Any, n: int) -> bytes:
    if isinstance(data, memoryview):
        return data.cast("B")[:n].tobytes()
    import torch

    return data.detach().view(torch.uint8)[:n].cpu().numpy().tobytes()


def _copy_into(data: Any, blob: bytes) -> None:
    if isinstance(data, memoryview):
        data.cast("B")[: len(blob)] = blob
        return
    import torch

    src = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    data.view(torch.uint8)[: len(blob)].copy_(src)


class RDMABuffer:
    """A reference to memory in the process that made it, to read from or write to from any
    other: ``read_into(dst)``, ``write_from(src)`` (each a Future of None), ``drop()``."""

    def __init__(self, data):
        data = _checked(data, "an RDMABuffer's memory")
        size = _nbytes(data)
        if size == 0:
            raise ValueError("Cannot create RDMABuffer with size 0.")
        self._id = uuid.uuid4().hex
        self._size = size
        self._owner = _this_process()
        with _lock:
            _owned[self._id] = data

    backend = "tcp"  # the actors' connections: no RDMA hardware is used

    def size(self) -> int:
        """Its size in bytes."""
        return self._size

    @property
    def owner(self) -> str:
        """The actor address of the process whose memory it is."""
        return self._owner

    def read_into(self, dst, *, timeout: int = 60) -> Future:
        """Copy the buffer into ``dst`` (1-D, contiguous, at least ``size()`` bytes)."""
        dst = _checked(dst, "read_into's destination")
        if _nbytes(dst) < self._size:
            raise ValueError(
                f"read_into's destination holds {_nbytes(dst)} bytes, and this RDMABuffer has "
                f"{self._size}: read into a tensor of at least {self._size} bytes"
            )
        return self._transfer({"op": "rdma_read"}, lambda blob: _copy_into(dst, blob), timeout)

    def write_from(self, src, *, timeout: int = 60) -> Future:
        """Copy ``src`` (1-D, contiguous, at most ``size()`` bytes) into the buffer."""
        src = _checked(src, "write_from's source")
        if _nbytes(src) > self._size:
            raise ValueError(
                f"write_from's source holds {_nbytes(src)} bytes, more than this RDMABuffer's "
                f"{self._size}: write at most {self._size} bytes"
            )
        blob = _bytes_of(src, _nbytes(src))
        return self._transfer({"op": "rdma_write", "data": blob}, None, timeout)

    def drop(self) -> Future:
        """Let the owner release the memory; reads and writes afterwards fail."""
        return self._transfer({"op": "rdma_drop"}, None, 60)

    def _transfer(self, msg: dict, on_bytes, timeout: int) -> Future:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"timeout takes a number of seconds above 0, not {timeout!r}")
        what = f"RDMABuffer.{msg['op'].removeprefix('rdma_')}"
        fut = Future(what)
        if self._owner == _this_process():  # this process's own memory
            try:
                reply = serve({**msg, "buf": self._id})
                if not reply["ok"]:
                    raise RuntimeError(reply["e"]["evalue"])
                if on_bytes is not None:
                    on_bytes(reply["v"])
                fut._finish(raw=None)
            except BaseException as e:
                fut._finish(error=e)
            return fut
        if self._owner.startswith("inproc://"):
            raise RuntimeError(
                "this RDMABuffer's memory is in the notebook's (or script's) own process, which "
                "other processes cannot reach: make the buffer in an actor"
            )

        def on_reply(rank, reply) -> None:
            if not reply["ok"]:
                fut._finish(error=RuntimeError(f"{what} failed: {reply['e']['evalue']}"))
                return
            try:
                if on_bytes is not None:
                    on_bytes(reply["v"])
                fut._finish(raw=None)
            except BaseException as e:
                fut._finish(error=e)

        def on_lost(rank, address, cause) -> None:
            fut._finish(error=RuntimeError(f"{what}: the buffer's owner is gone: {cause}"))

        box = here.sending_mailbox()
        if box is None:
            raise RuntimeError(f"{what}: no cluster is up here to reach the buffer's owner")
        box.send(
            [(self._owner, {**msg, "buf": self._id, "r": 0})],
            Pending({0: self._owner}, on_reply, on_lost),
        )
        timer = threading.Timer(
            timeout, lambda: fut._finish(error=TimeoutError(f"{what} took over {timeout} s"))
        )
        timer.daemon = True
        timer.start()
        fut.add_done_callback(timer.cancel)
        return fut

    def __reduce__(self):
        return _rebuild, (self._id, self._size, self._owner)

    def __repr__(self) -> str:
        return f"<RDMABuffer {self._size} bytes of {self._owner}>"


def _rebuild(buf_id: str, size: int, owner: str) -> RDMABuffer:
    buf = RDMABuffer.__new__(RDMABuffer)
    buf._id, buf._size, buf._owner = buf_id, size, owner
    return buf


def _this_process() -> str:
    return here.address()


def serve(msg: dict) -> dict:
    """The owner's answer to a read, write or drop of one of its buffers."""
    with _lock:
        data = _owned.get(msg["buf"])
        if msg["op"] == "rdma_drop":
            _owned.pop(msg["buf"], None)
            return {"ok": True, "v": None}
    if data is None:
        error = "its owner dropped it (RDMABuffer.drop())"
        return {"ok": False, "e": {"ename": "RuntimeError", "evalue": error}}
    if msg["op"] == "rdma_read":
        return {"ok": True, "v": _bytes_of(data, _nbytes(data))}
    _copy_into(data, msg["data"])
    return {"ok": True, "v": None}
