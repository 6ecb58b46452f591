"""Sockets between a Ray runner's actors: a step's values sent actor to actor without a Ray call each.

A Ray actor call from one actor to another takes 0.5-1.7 ms on one host here (a
plain TCP send and a thread's wake-up about 0.03-0.09 ms: benchmarks/results/2026-history-ray-training-steps.md), and
a 1F1B step is a chain of such deliveries. So each actor listens on a TCP port of
its node (``Listener``) and keeps one connection to each other worker
(``Links``); what ``lists.Sender`` delivers goes down them as ``wire`` frames
(``read_frame`` reads one), and each connection, once it shows the token, is handed
to the actor's inbox, whose waiting thread reads it (``inbox``). Ray still starts the
actors, hands out the addresses and carries every call of the driver.

A connection opens with a 32-byte token the driver made for the pipeline (handed
to each actor in a Ray call): a peer that does not send it is closed before any
frame is read. A send that cannot go (a dead peer) raises ``OSError`` to the
sender, which reports it as a step's error; a frame that does not decode is
reported the same way by its reader and its connection dropped.
"""

from __future__ import annotations

import hmac
import socket
import threading
from typing import Callable, Sequence

from . import wire

MAGIC = b"vjpsplt1"  # a connection's first bytes, then the token
TOKEN_BYTES = 32
HANDSHAKE_SECONDS = 10.0  # a connection that has not sent its token by then is closed
SEND_SECONDS = 120.0  # a send blocked this long (a peer that reads nothing) fails
IOV_AT_MOST = 512  # buffers per sendmsg, well under every platform's IOV_MAX
Address = tuple[str, int]


def node_address() -> str:
    """The address this process's Ray node is reached at (what the other actors connect to)."""
    import ray

    return str(ray.util.get_node_ip_address())


class Listener:
    """A listening socket that hands each connection to ``on_connection`` once it shows the token (from a thread
    of its own per connection, which then ends); a connection that does not show it is closed unread."""

    def __init__(self, token: bytes, on_connection: Callable[[socket.socket], None], host: str):
        self.token, self.on_connection = token, on_connection
        self.sock = socket.create_server((host, 0))
        self.address: Address = (host, self.sock.getsockname()[1])
        threading.Thread(target=self._accept, name="vjpsplit-listener", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), name="vjpsplit-peer", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(HANDSHAKE_SECONDS)
        try:
            shown = _read_exactly(conn, len(MAGIC) + TOKEN_BYTES)
        except (OSError, EOFError):
            conn.close()
            return
        if not hmac.compare_digest(shown, MAGIC + self.token):
            conn.close()  # not one of this pipeline's actors: nothing it sent is read
            return
        self.on_connection(conn)  # still under the handshake's timeout: its new owner sets the one it reads with

    def close(self) -> None:
        """Stop accepting connections (those open end with their peers)."""
        self.sock.close()


class Links:
    """One connection to each other worker's ``Listener``, by worker index; ``send`` is thread-safe per peer."""

    def __init__(self, addresses: Sequence[Address | None], token: bytes, me: int):
        self.socks: dict[int, socket.socket] = {}
        self.locks: dict[int, threading.Lock] = {}
        try:
            for w, address in enumerate(addresses):
                if w == me or address is None:
                    continue
                sock = socket.create_connection((str(address[0]), int(address[1])), timeout=HANDSHAKE_SECONDS)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(SEND_SECONDS)
                sock.sendall(MAGIC + token)
                self.socks[w], self.locks[w] = sock, threading.Lock()
        except BaseException:
            self.close()
            raise

    def send(self, worker: int, step: int, items: Sequence[wire.Item]) -> None:
        """``items`` of step ``step`` to ``worker``, in one frame.

        Raises:
            wire.Unencodable: If a value is not one a frame carries (nothing was sent).
            OSError: If the connection is gone or the send timed out.
        """
        bufs = wire.encode(step, items)
        with self.locks[worker]:
            _send_all(self.socks[worker], bufs)

    def close(self) -> None:
        """Close every connection (the peers' reading threads end)."""
        for sock in self.socks.values():
            try:
                sock.close()
            except OSError:
                pass
        self.socks.clear()


def _send_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    views = [b.cast("B") for b in bufs]
    while views:
        sent = sock.sendmsg(views[:IOV_AT_MOST])
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


def read_frame(conn: socket.socket) -> tuple[int, list[wire.Item]]:
    """The next frame on ``conn`` (blocking until all of it is here): its step and items.

    Raises:
        EOFError: If the peer closed the connection between frames.
        wire.BadFrame: If the frame is not one ``wire.encode`` writes.
        OSError: If the connection fails.
    """
    return wire.decode(lambda n: _read_exactly(conn, n), lambda v: _read_into(conn, v))


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _read_into(conn, memoryview(buf))
    return bytes(buf)


def _read_into(conn: socket.socket, view: memoryview) -> None:
    view = view.cast("B")
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise EOFError("the peer closed the connection")
        got += n
