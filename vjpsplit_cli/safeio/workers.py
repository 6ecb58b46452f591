"""A few daemon threads for array file I/O: several arrays read and checked at once, CRC-32s
computed beside a write, replaced files deleted off the caller's thread.

Copies from the page cache, checksums and deletions release the GIL (``os.preadv``;
zlib, zlib-ng and ISA-L's ``crc32``; ``os.unlink``), so a second core does a share of
the work. Measured on the 41.5 MiB benchmark set (2 cores): see docs/performance.md.
Small jobs stay on the calling thread: handing a task to a thread costs tens of
microseconds.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")

MIN_PARALLEL_BYTES = 4 * 2**20  # below this, threads cost more than they save; tests lower it
MAX_WORKERS = 4  # memory bandwidth, not cores, bounds copies beyond a few threads

_lock = threading.Lock()
_pool: tuple[int, "_Pool"] | None = None  # (pid that made it, pool)


class _Pool:
    """Daemon threads taking ``(future, fn, args)`` from one queue.

    Not ``ThreadPoolExecutor``: its threads are not daemons, so the interpreter joins
    them on exit, and a signal that interrupts the creation of one (the CLI turns
    SIGINT, SIGTERM and SIGHUP into an exception while it writes) leaves a thread the
    executor never registered, which the exit then waits for for ever. Daemon threads
    are not waited for; callers that need their work done wait on its futures
    (``filesystem`` does so at exit for the deletions it handed over).
    """

    def __init__(self, n: int):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(n):
            threading.Thread(target=self._work, name=f"vjpsplit-io-{i}", daemon=True).start()

    def _work(self) -> None:
        while True:
            future, fn, args = self.queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on the future
                future.set_exception(e)

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        future: Future[T] = Future()
        self.queue.put((future, fn, args))
        return future


def count() -> int:
    """How many threads array I/O uses here: the CPUs this process may run on, at most ``MAX_WORKERS``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cpus))


def _executor() -> _Pool:
    global _pool
    with _lock:
        # A forked child inherits the pool object but not its threads: make its own.
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), _Pool(count()))
        return _pool[1]


def parallel(nbytes: int) -> bool:
    """Whether a job over ``nbytes`` is worth spreading over threads here."""
    return nbytes >= MIN_PARALLEL_BYTES and count() > 1


def submit_all(fn: Callable[..., T], jobs: Iterable[tuple]) -> list[Future]:
    """Start ``fn(*job)`` for every job on the I/O threads; the futures come back in job order."""
    pool = _executor()
    return [pool.submit(fn, *job) for job in jobs]


def run_all(fn: Callable[..., T], jobs: list[tuple], nbytes: int) -> list[T]:
    """``[fn(*job) for job in jobs]``, on the I/O threads when ``nbytes`` makes it worth it.

    Every job finishes before this returns; then the first exception in job order is
    raised, so which error a caller sees does not depend on thread timing.
    """
    if not parallel(nbytes) or len(jobs) < 2:
        return [fn(*job) for job in jobs]
    futures = submit_all(fn, jobs)
    errors = [f.exception() for f in futures]  # waits for each
    for e in errors:
        if e is not None:
            raise e
    return [f.result() for f in futures]
