"""A few threads for array file I/O: reads and CRC-32s of several arrays at once.

Reading a file from the page cache and checksumming it are memory copies and scans
that release the GIL (``os.preadv``; zlib, zlib-ng and ISA-L's ``crc32``), so a second
core does a second array's share. Measured on the 44 MiB benchmark set (2 cores):
see docs/performance.md. Small jobs stay on the calling thread: handing a task to a
thread costs tens of microseconds.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")

MIN_PARALLEL_BYTES = 4 * 2**20  # below this, threads cost more than they save; tests lower it
MAX_WORKERS = 4  # memory bandwidth, not cores, bounds copies beyond a few threads

_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid that made it, pool)


def count() -> int:
    """How many threads array I/O uses here: the CPUs this process may run on, at most ``MAX_WORKERS``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cpus))


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        # A forked child inherits the pool object but not its threads: make its own.
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(count(), thread_name_prefix="vjpsplit-io"))
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
