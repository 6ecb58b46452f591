"""How a finished file takes an old one's place, fast: Linux file system calls Python lacks.

``replace_file`` swaps a temp file into place with ``renameat2`` and deletes the old
file (a big one on an I/O thread); ``preallocated`` reserves a big file's blocks
before it is written (``fallocate``). Both fall back to what Python has where the
system lacks them. ``outputs`` builds its safe writes on these.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import stat
import sys
import threading
from concurrent.futures import Future
from typing import BinaryIO, Callable, Iterator

from . import workers
from .signals import discard_live


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable; where directories cannot be synced, leave it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    """Flush a file this process wrote (and closed) to disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def keep_mode(tmp: str, target: str) -> None:
    """Give ``tmp`` the permission bits of the file it replaces, as overwriting that file would keep them."""
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        return
    try:
        os.chmod(tmp, mode)
    except OSError:
        pass


def replace_file(tmp: str, target: str) -> None:
    """Put the file ``tmp`` in place of ``target`` atomically, as ``os.replace`` does.

    Where ``target`` exists, the two names are swapped (``renameat2`` with
    ``RENAME_EXCHANGE``) and then the old file, now under ``tmp``'s name, is removed.
    Why: ext4 treats a rename over an existing file as "replace a config file" and
    starts writing the new file to disk at once (``auto_da_alloc``); the next
    replacement of it then waits for that I/O. Measured (benchmarks/io.py, ext4,
    2 shared cores, medians): write + ``os.replace`` 42 ms for 40 MiB and 1.23 s for
    1 GiB; write + swap + unlink 16 ms and 0.68 s; ``np.save`` over the old file
    15 ms and 0.46 s. A swapped-in file that is replaced or deleted before the
    kernel's own writeback starts (residuals) never reaches the disk.
    The target exists throughout, holding the old or the new file; after a
    successful swap it holds the new one, whatever happens to the unlink (a temp
    left behind names this process and is swept as stale once it exits).
    Where the swap fails (no ``renameat2`` in libc, a kernel before 3.15, a file
    system that does not support it, no target yet) it changed nothing, and
    ``os.replace`` does the work and raises its usual errors.
    """
    exchange = renameat2()
    if exchange is not None and exchange(tmp, target):
        discard_live(tmp)
        _remove_replaced(tmp)  # the old file now
        return
    os.replace(tmp, target)
    discard_live(tmp)


_removals: list[Future] = []
_removals_lock = threading.Lock()
MIN_PREALLOCATE = 2**20  # below this, reserving blocks first saves nothing measurable


@contextlib.contextmanager
def preallocated(f: BinaryIO, size: int | None) -> Iterator[None]:
    """Inside, ``f`` (empty, written in order) has ``size`` bytes of blocks reserved; on leaving, it is
    flushed and cut at what was written.

    Why: ext4 reserves a growing file's blocks page by page as the writes arrive, and
    updates its size with each; one ``fallocate(2)`` first does it in one step. Measured
    writing the 41.5 MiB benchmark set into a new file and deleting it (ext4, 2 cores,
    medians of 25): 15.0 ms as is, 11.7 ms with the blocks reserved first. Where
    ``fallocate`` is missing or the file system refuses it, nothing changes (glibc's
    ``posix_fallocate`` would instead emulate it by writing every block: never used).
    """
    reserved = size is not None and size >= MIN_PREALLOCATE and _fallocate(f, size)
    yield
    f.flush()
    if reserved and size is not None and f.tell() < size:
        os.ftruncate(f.fileno(), f.tell())  # the size was an estimate: drop the unwritten tail


def _fallocate(f: BinaryIO, size: int) -> bool:
    fn = _libc_fallocate()
    if fn is None:
        return False
    try:
        return fn(f.fileno(), 0, 0, size) == 0
    except (OSError, ValueError, AttributeError):
        return False


def _libc(name: str, *argtypes: str) -> Callable[..., int] | None:
    """glibc's function ``name`` through ctypes (argument types named as ctypes spells them); None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
        fn.argtypes = [getattr(ctypes, t) for t in argtypes]
        fn.restype = ctypes.c_int
    except (ImportError, OSError, AttributeError):
        return None
    return fn


@functools.cache
def _libc_fallocate() -> Callable[..., int] | None:
    """glibc's ``fallocate`` (Linux); None elsewhere. Python has only ``posix_fallocate``."""
    return _libc("fallocate", "c_int", "c_int", "c_longlong", "c_longlong")


def _remove_replaced(old: str) -> None:
    """Delete the file a swap put under a temp name; a big one on an I/O thread.

    Why: deleting a file frees its page-cache pages, ~2.3 ms for 40 MiB (measured in
    benchmarks/io.py), which ``np.save``'s in-place truncation pays too but which need
    not hold up the caller once the new file is in place. The next write waits for it
    (``finish_removals``) before making its temp file, so the disk never holds more old
    files than before, and an exit waits for it too (the I/O threads are daemons: see
    the ``atexit`` line below); a removal cut short by a crash or a fatal signal leaves
    a temp named after this process, swept as stale once it is gone.
    """
    try:
        size = os.lstat(old).st_size
    except OSError:
        return
    if not workers.parallel(size):
        _unlink_quietly(old)
        return
    with _removals_lock:  # writers may run on several threads (an in-process pipeline's stages)
        _removals[:] = [f for f in _removals if not f.done()]
        _removals.extend(workers.submit_all(_unlink_quietly, [(old,)]))


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def finish_removals() -> None:
    """Wait until every replaced file this process handed to an I/O thread is deleted (before each write)."""
    with _removals_lock:
        pending, _removals[:] = list(_removals), []
    for future in pending:
        future.result()


@functools.cache
def renameat2() -> Callable[[str, str], bool] | None:
    """``exchange(a, b) -> bool`` swapping two paths with renameat2(RENAME_EXCHANGE); None where unavailable.

    Python has no API for renameat2 (os.rename/os.replace take no flags), so it is
    glibc's wrapper (2.28 and later) through ctypes. False from ``exchange`` means the
    call failed and changed nothing.
    """
    fn = _libc("renameat2", "c_int", "c_char_p", "c_int", "c_char_p", "c_uint")
    if fn is None:
        return None
    at_fdcwd, rename_exchange = -100, 2  # <fcntl.h> AT_FDCWD, <linux/fs.h> RENAME_EXCHANGE

    def exchange(a: str, b: str) -> bool:
        return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0

    return exchange


# The I/O threads are daemons, which exit does not wait for: the deletions handed to
# them are finished here (a process killed by a signal leaves them to the stale sweep).
atexit.register(finish_removals)
