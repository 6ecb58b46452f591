"""An untimed step's report sent to the driver on a socket rather than returned through Ray.

A Ray actor call's result reached the driver 1.3-2.0 ms after the actor returned it in a
training step on the 2-core host of benchmarks/results/2026-history-ray-training-steps.md (0.24 ms for a bare call). So
the driver listens on a socket of its node (``ReportDesk``, a ``peers.Listener`` that
opens to the pipeline's token) and each actor keeps one connection to it: an
untimed step whose report holds only numbers (its losses, aux leaves and squared
norms, no error, no timings) goes down it as one ``wire`` frame (``as_frame``) and the actor's
call returns ``SENT``. Anything else (a timed step's events, an error) still
returns through Ray, and so does everything when a frame cannot go. The driver
reads each connection on a thread of its own and waits for the step's frames
(``take``); what the Ray call says of the actor (done, failed) decides the rest.
"""

from __future__ import annotations

import socket
import threading
from typing import Any, Collection, Mapping

import numpy as np

from . import peers, wire

SENT = "sent on the driver's socket"  # what an actor's call returns when its report went as a frame
KIND = "report"  # a frame item's kind


def as_frame(worker: int, report: Mapping[str, Any]) -> list[wire.Item] | None:
    """``report`` (a ``TrainActor.train_step`` result) as a frame's items; None where it holds more than numbers
    (an error, events, a sum that is None)."""
    if report.get("error") is not None or report.get("events"):
        return None
    sums = report.get("sums", {})
    if any(v is None for v in sums.values()):
        return None
    tree = {
        "losses": {int(m): np.asarray(float(v)) for m, v in report["losses"].items()},
        "aux": {int(m): [np.asarray(a) for a in leaves] for m, leaves in report.get("aux", {}).items()},
        "sums": {int(s): np.asarray(float(v)) for s, v in sums.items()},
    }
    return [((KIND, 0, worker), tree)]


def from_frame(tree: Any) -> dict[str, Any]:
    """A report from a frame's tree (``as_frame``): floats back, no events, phases or error."""
    return {
        "losses": {int(m): float(v) for m, v in tree["losses"].items()},
        "aux": {int(m): [np.asarray(a) for a in leaves] for m, leaves in tree["aux"].items()},
        "sums": {int(s): float(v) for s, v in tree["sums"].items()},
        "events": [],
        "phases": [],
        "error": None,
    }


class ReportDesk:
    """The driver's socket for reports: ``address`` for the actors, the frames read so far by (step, worker)."""

    def __init__(self, token: bytes, host: str):
        self._frames: dict[tuple[int, int], dict[str, Any]] = {}
        self._arrived = threading.Condition()
        self._listener = peers.Listener(token, self._attach, host)
        self.address = self._listener.address
        self.received = 0  # reports taken from frames: what tests count

    def _attach(self, conn: socket.socket) -> None:
        conn.settimeout(None)  # a connection waits for reports as long as the pipeline lives
        threading.Thread(target=self._read, args=(conn,), name="vjpsplit-reports", daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        try:
            while True:
                step, items = peers.read_frame(conn)
                with self._arrived:
                    for (kind, _, worker), tree in items:
                        if kind == KIND:
                            self._frames[(step, worker)] = from_frame(tree)
                    self._arrived.notify_all()
        except (OSError, EOFError, wire.BadFrame, KeyError, TypeError, ValueError):
            conn.close()  # a peer gone or a frame not a report: its step's Ray call tells the driver the rest

    def take(self, step: int, worker: int) -> dict[str, Any] | None:
        """Worker ``worker``'s report of step ``step`` if its frame came (frames of earlier steps dropped)."""
        with self._arrived:
            for key in [k for k in self._frames if k[0] < step]:
                del self._frames[key]
            got = self._frames.pop((step, worker), None)
        if got is not None:
            self.received += 1
        return got

    def wait(self, step: int, workers: Collection[int], timeout: float) -> None:
        """Until a frame of step ``step`` from one of ``workers`` is here (at once if one already is) or
        ``timeout`` seconds pass; checked under the lock the readers notify with, so no frame is missed."""
        with self._arrived:
            self._arrived.wait_for(lambda: any((step, w) in self._frames for w in workers), timeout)

    def close(self) -> None:
        """Stop listening (open connections end with their actors)."""
        self._listener.close()
