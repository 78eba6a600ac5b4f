"""The relay process: forwards framed requests from the controller to the engines' sockets.

Two sockets from the controller, inherited at start (their descriptors are its arguments):

- ``frames`` (a stream): messages behind an 8-byte length, ``F`` + how many targets + their
  ids (4 bytes each) + a request already framed for the engines, written to each target as is
  (nothing is unpickled here);
- ``adds`` (a seqpacket): ``A`` + an id with the engine's connected socket passed along
  (SCM_RIGHTS), or ``D`` + an id to close.

The controller sends an add before any frame for its id, so a frame for an id not yet known
means the add waits on ``adds``: it is read then. Writes never block: what an engine's socket
does not take waits for it in order, while the others go on. The relay ends when the
controller's ``frames`` socket closes (the kernel exited or went down); it ignores SIGINT, which
JupyterLab's stop button sends to the kernel's process group.
"""

from __future__ import annotations

import collections
import os
import selectors
import signal
import socket
import struct
import sys

LENGTH = struct.Struct("!Q")
COUNT = struct.Struct("!I")
MAX_FDS = 16


class Target:
    """One engine's socket and what it has not taken yet."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.unsent: collections.deque[memoryview] = collections.deque()


class Relay:
    def __init__(self, frames: socket.socket, adds: socket.socket):
        self.frames, self.adds = frames, adds
        self.targets: dict[int, Target] = {}
        self.buf = bytearray()
        self.sel = selectors.DefaultSelector()
        self.sel.register(frames, selectors.EVENT_READ, "frames")
        self.sel.register(adds, selectors.EVENT_READ, "adds")
        self.running = True

    def run(self) -> None:
        while self.running:
            for key, events in self.sel.select():
                if key.data == "frames":
                    self.read_frames()
                elif key.data == "adds":
                    self.read_adds()
                elif events & selectors.EVENT_WRITE:
                    self.write(key.data)

    # -- from the controller -------------------------------------------------------------------
    def read_adds(self) -> None:
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(self.adds, 64, MAX_FDS)
            except (BlockingIOError, InterruptedError):
                return
            if not msg:
                self.running = False
                return
            (ident,) = COUNT.unpack_from(msg, 1)
            if msg[:1] == b"A" and fds:
                self.drop(ident)
                sock = socket.socket(fileno=fds[0])
                sock.setblocking(False)
                self.targets[ident] = Target(sock)
                for fd in fds[1:]:
                    os.close(fd)
            elif msg[:1] == b"D":
                self.drop(ident)

    def read_frames(self) -> None:
        try:
            got = self.frames.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        if not got:
            self.running = False
            return
        buf = self.buf
        buf += got
        start, end = 0, len(buf)
        view = memoryview(buf)
        while end - start >= LENGTH.size:
            (n,) = LENGTH.unpack_from(buf, start)
            if end - start - LENGTH.size < n:
                break
            body = start + LENGTH.size
            (count,) = COUNT.unpack_from(buf, body + 1)
            ids = struct.unpack_from(f"!{count}I", buf, body + 1 + COUNT.size)
            frame = bytes(view[body + 1 + COUNT.size * (count + 1) : body + n])
            for ident in ids:
                self.send(ident, frame)
            start = body + n
        view.release()
        del buf[:start]

    # -- to the engines ----------------------------------------------------------------------
    def send(self, ident: int, frame: bytes) -> None:
        target = self.targets.get(ident)
        if target is None:
            self.read_adds()  # its add was sent first: it waits there
            target = self.targets.get(ident)
            if target is None:
                return  # dropped: its rank left
        if target.unsent:
            target.unsent.append(memoryview(frame))
            return
        try:
            n = target.sock.send(frame)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:  # the engine is gone; the controller sees that on its own link
            self.drop(ident)
            return
        if n < len(frame):
            target.unsent.append(memoryview(frame)[n:])
            self.sel.register(target.sock, selectors.EVENT_WRITE, ident)

    def write(self, ident: int) -> None:
        target = self.targets.get(ident)
        if target is None:
            return
        while target.unsent:
            chunk = target.unsent[0]
            try:
                n = target.sock.send(chunk)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.drop(ident)
                return
            if n < len(chunk):
                target.unsent[0] = chunk[n:]
                return
            target.unsent.popleft()
        self.sel.unregister(target.sock)

    def drop(self, ident: int) -> None:
        target = self.targets.pop(ident, None)
        if target is None:
            return
        if target.unsent:
            self.sel.unregister(target.sock)
        target.sock.close()


def main(argv: list[str]) -> None:
    # JupyterLab's stop button signals the kernel's whole process group; Ctrl-C is the
    # controller's to deliver (its interrupt goes to the engines by paths of its own)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    frames = socket.socket(fileno=int(argv[0]))
    adds = socket.socket(fileno=int(argv[1]))
    frames.setblocking(False)
    adds.setblocking(False)  # (socket.recv_fds takes no flags before Python 3.12)
    Relay(frames, adds).run()


if __name__ == "__main__":
    main(sys.argv[1:])
