"""A Ray worker's inbox: what the other workers sent it for a step, read from their sockets by the thread that waits.

Values arrive two ways: as frames on the other workers' connections (``peers``),
and as Ray calls of the actor's ``deliver`` (a value a frame does not carry).
Connections are ``attach``-ed once their token is checked; no thread reads them
on its own. The thread waiting in ``take`` for a value that is not here reads
every frame that has come on any connection until its value is among them: a
value sent to a waiting worker then wakes one thread, the one that runs it, and
not a reading thread and then the waiting one (measured on the mid GPT on Ray:
benchmarks/results/2026-history-ray-training-steps.md). What arrives while nobody waits stays in the connection
until the next ``take``; a sender blocked on a full connection is released by
that ``take``, which every value sent has (its receiver's list waits for it).
"""

from __future__ import annotations

import select
import socket
import threading
from typing import Callable, Sequence

from . import peers

Key = tuple[str, int, int]  # an operation as (kind, microbatch, stage): what a delivery is keyed by
OnError = Callable[[BaseException], None]


class Inbox:
    """What other workers sent this one for a step, by the sending operation; every method thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._values: dict[tuple[int, Key], object] = {}
        self._step = -1
        self._aborted = -1  # every step up to this one is aborted
        self._conns: dict[int, tuple[socket.socket, OnError]] = {}  # by file descriptor
        self._reader: int | None = None  # the thread in take that reads the connections now
        # A byte here wakes the reading thread from its poll: a value put by a Ray call, an abort, a new connection.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    def attach(self, conn: socket.socket, on_error: OnError) -> None:
        """Read frames of step values from ``conn`` (an authenticated peer connection) from now on; ``on_error``
        is called with what ends it abnormally (a frame that does not decode, a reset), not for a peer that closes
        between frames."""
        conn.settimeout(None)
        with self._cond:
            self._conns[conn.fileno()] = (conn, on_error)
            self._cond.notify_all()  # a thread waiting with no connection to read starts reading this one
            self._wake()

    def begin(self, step: int) -> None:
        """Step ``step`` starts here: forget what older steps left."""
        with self._cond:
            self._step = step
            self._values = {k: v for k, v in self._values.items() if k[0] >= step}

    def put(self, step: int, items: Sequence[tuple[Key, object]]) -> None:
        """``items`` for step ``step`` (dropped when that step is over here)."""
        with self._cond:
            if step >= self._step:
                for (kind, mb, stage), value in items:
                    self._values[(step, (str(kind), int(mb), int(stage)))] = value
                self._cond.notify_all()
                self._wake()

    def take(self, step: int, key: Key) -> object:
        """The value sent for ``key`` in step ``step``, once it is here; None when the step was aborted.

        While it is not here, this thread reads what the connections bring (one thread at a time; another
        waits for what it reads)."""
        with self._cond:
            while True:
                if (step, key) in self._values:
                    return self._values.pop((step, key))
                if step <= self._aborted:
                    return None
                if self._reader is not None or not self._conns:
                    self._cond.wait()
                    continue
                self._reader = threading.get_ident()
                conns = dict(self._conns)
                self._cond.release()
                try:
                    self._read_some(conns)
                finally:
                    self._cond.acquire()
                    self._reader = None
                    self._cond.notify_all()

    def abort(self, step: int) -> None:
        """Release every wait of step ``step`` (and older): a worker is gone."""
        with self._cond:
            self._aborted = max(self._aborted, step)
            self._cond.notify_all()
            self._wake()

    def close(self) -> None:
        """Close every connection attached (their peers' sends fail from then on)."""
        with self._cond:
            conns, self._conns = list(self._conns.values()), {}
        for conn, _ in conns:
            _close(conn)

    def _wake(self) -> None:
        """Wake the thread reading in ``take``, unless it is this one (called with the lock held)."""
        if self._reader is not None and self._reader != threading.get_ident():
            try:
                self._wake_w.send(b"\0")
            except OSError:  # full: a wake-up is already waiting to be read
                pass

    def _read_some(self, conns: dict[int, tuple[socket.socket, OnError]]) -> None:
        """Wait until a connection has a frame (or a wake-up comes), then read one frame from each that has."""
        poll = select.poll()
        for fd in conns:
            poll.register(fd, select.POLLIN)
        poll.register(self._wake_r.fileno(), select.POLLIN)
        for fd, _ in poll.poll():
            if fd == self._wake_r.fileno():
                try:
                    while self._wake_r.recv(4096):
                        pass
                except OSError:  # drained
                    pass
                continue
            conn, on_error = conns[fd]
            try:
                got = peers.read_frame(conn)
            except EOFError:
                got = None
            except (OSError, peers.wire.BadFrame) as e:
                on_error(e)
                got = None
            if got is None:
                with self._cond:
                    self._conns.pop(fd, None)
                _close(conn)
            else:
                self.put(*got)


def _close(conn: socket.socket) -> None:
    try:
        conn.close()
    except OSError:
        pass
