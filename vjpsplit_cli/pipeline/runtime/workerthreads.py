"""The threads a timed step runs on, one per worker, started once and kept across steps.

Owns ``WorkerThreads`` (a Trainer keeps one for its lifetime: the timed steps' threads,
and the one its untimed steps are dispatched from), the ``Job`` each thread hands
back per step (its event set when it is over, ``error`` what escaped it) and
``wait_for``, which waits in short slices so Ctrl-C reaches the main thread.

A thread left behind in an operation (``abandon``) is waited for at the interpreter's
exit, up to ``EXIT_WAIT`` seconds: CPython ends a daemon thread that wakes during
finalization where it stands, and one that stands inside XLA (a host callback that
returned, a wait for an operation's results) then aborts the whole process
("terminate called after throwing an instance of ''", status 134). Given the time, it
drains its step and ends first; one still stuck is left to the exit. ``timed`` and
``untimed`` build on it.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from typing import Callable, Sequence, TypeAlias

EXIT_WAIT = 2.0  # seconds the interpreter's exit waits, in all, for threads left behind in an operation
_left: list[threading.Thread] = []  # threads left behind (``abandon``) that may still be running


class Job:
    """One job handed to a worker thread: ``event`` set when it is over, ``error`` what escaped it."""

    __slots__ = ("event", "error")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: BaseException | None = None


# A worker thread's jobs, each with what says it is over; None ends the thread.
JobQueue: TypeAlias = "queue.SimpleQueue[tuple[Callable[[], None], Job] | None]"


class WorkerThreads:
    """One thread per worker, started once and reused by every step until ``close`` (a Trainer's lifetime).

    A pool dropped without ``close`` ends its threads when it is collected (``weakref.finalize``: the
    threads hold their queues, never the pool), so a Trainer nobody closed leaves no thread behind.
    A job that raises never ends its thread: its error is the job's (``Job.error``). ``name``: the threads'
    names' prefix (``<name>-<w>``).
    """

    def __init__(self, n: int, name: str = "vjpsplit-worker"):
        self.queues: list[JobQueue] = [queue.SimpleQueue() for _ in range(n)]
        self.threads = [
            threading.Thread(target=_serve, args=(q,), name=f"{name}-{w}", daemon=True)
            for w, q in enumerate(self.queues)
        ]
        for t in self.threads:
            t.start()
        self._stop = weakref.finalize(self, _stop_threads, self.queues)

    def start(self, jobs: Sequence[Callable[[], None]]) -> list[Job]:
        """Run ``jobs[w]`` in thread ``w``; each returned job's event is set when it is done."""
        if not self.threads:
            raise RuntimeError("these worker threads are closed")
        done = [Job() for _ in jobs]
        for q, job, d in zip(self.queues, jobs, done):
            q.put((job, d))
        return done

    def close(self) -> None:
        """End the threads (after the jobs they hold)."""
        self._stop()
        for t in self.threads:
            t.join()
        self.threads = []

    def abandon(self) -> None:
        """Tell the threads to end after their jobs, waiting for none: one is stuck in an operation.

        The interpreter's exit waits for them (``EXIT_WAIT``): its hook is registered again here, after any
        of jax's (``atexit`` runs the last registered first), so they end before jax clears its backends."""
        self._stop()
        _left[:] = [t for t in _left if t.is_alive()] + self.threads
        atexit.unregister(_join_left)
        atexit.register(_join_left)
        self.threads = []

    def __enter__(self) -> WorkerThreads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _join_left() -> None:
    """At the interpreter's exit: wait up to ``EXIT_WAIT`` seconds for the threads left behind to end."""
    end = time.monotonic() + EXIT_WAIT
    for t in _left:
        t.join(max(end - time.monotonic(), 0.0))


def _stop_threads(queues: Sequence[JobQueue]) -> None:
    for q in queues:
        q.put(None)


def _serve(jobs: JobQueue) -> None:
    while (item := jobs.get()) is not None:
        job, done = item
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - the step's error (run checks it); the thread serves on
            done.error = e
        finally:
            done.event.set()
            del job, item, done  # hold nothing of a step between steps


def wait_for(event: threading.Event, deadline: float | None, tick: Callable[[], None] | None = None) -> bool:
    """``event.wait`` until ``deadline`` (None: for good) in short slices: Ctrl-C reaches the main thread
    between them even where the signal lands on another thread. ``tick()`` runs after each slice that ends
    without the event."""
    while True:
        left = 0.25 if deadline is None else min(deadline - time.monotonic(), 0.25)
        if event.wait(max(left, 0.0)):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
        if tick is not None:
            tick()
