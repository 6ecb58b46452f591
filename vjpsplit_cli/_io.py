"""File helpers: crash-safe writes (temp file, fsync, rename) and positioned reads."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from .errors import VjpsplitError


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None], *, fsync: bool = False) -> None:
    """Call ``write(f)`` on a fresh temp file next to ``path``, then rename it into place.

    Readers see either no file, the previous complete one, or the new complete one,
    never a partial one, even if the process dies mid-write. The temp name is unique
    per call, so concurrent writers into one directory never share a temp file.
    ``fsync=True`` also flushes the data to disk before the rename, so the new file
    survives a power loss too (artifacts); without it a crash of the machine can
    leave the previous file or a torn new one, which checksums then catch.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise VjpsplitError(f"{path}: directory {directory} does not exist; create it first")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as e:
        raise VjpsplitError(f"{path}: cannot write into {directory} ({e.strerror}); check permissions") from e
    try:
        # mkstemp makes the file 0600; give it the mode a plain open() would have.
        os.chmod(tmp, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def start_writeback(f: BinaryIO) -> None:
    """Ask the kernel to start writing ``f``'s dirty pages to disk now, without waiting.

    Call it every few MiB while writing a big file: the disk then works while the
    caller keeps producing data, and the final ``fsync`` has little left to wait for.
    It is only a hint and never replaces that ``fsync``. Linux only
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``); elsewhere, or where the call
    fails, it does nothing.
    """
    call = _sync_file_range()
    if call is None:
        return
    f.flush()
    call(f.fileno(), 0, 0, 2)  # offset 0, nbytes 0 = to the end; 2 = SYNC_FILE_RANGE_WRITE. Errors ignored.


_SFR: list = []  # [function or None], resolved on first use


def _sync_file_range():
    if not _SFR:
        call = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                fn.restype = ctypes.c_int
                call = fn
            except (ImportError, OSError, AttributeError):
                call = None
        _SFR.append(call)
    return _SFR[0]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def open_for_read(path: str | os.PathLike, what: str) -> BinaryIO:
    """Open a file for reading, turning every OS-level failure into one clear VjpsplitError."""
    path = Path(path)
    try:
        return open(path, "rb")
    except FileNotFoundError as e:
        raise VjpsplitError(f"{path}: no such {what} file; check the path") from e
    except IsADirectoryError as e:
        raise VjpsplitError(f"{path}: is a directory, expected {_article(what)} {what} file") from e
    except PermissionError as e:
        raise VjpsplitError(f"{path}: permission denied reading the {what} file; check its permissions") from e
    except OSError as e:
        raise VjpsplitError(f"{path}: cannot read the {what} file ({e.strerror or e})") from e


def read_bytes(path: str | os.PathLike, what: str) -> bytes:
    """Read a whole file; failures as in ``open_for_read``."""
    with open_for_read(path, what) as f:
        try:
            return f.read()
        except OSError as e:
            raise VjpsplitError(f"{path}: cannot read the {what} file ({e.strerror or e})") from e


def read_at(f: BinaryIO, offset: int, n: int) -> bytes:
    """Up to ``n`` bytes of ``f`` from ``offset`` (fewer only at the end of the file)."""
    if hasattr(os, "pread"):
        parts = []
        while n > 0:
            part = os.pread(f.fileno(), n, offset)
            if not part:
                break
            parts.append(part)
            offset += len(part)
            n -= len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)
    f.seek(offset)
    return f.read(n)


def readinto_at(f: BinaryIO, buf, offset: int) -> int:
    """Fill the writable buffer ``buf`` from ``f`` at ``offset``; the byte count read (short only at the end)."""
    view = memoryview(buf).cast("B")
    done = 0
    if hasattr(os, "preadv"):
        fd = f.fileno()
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                break
            done += got
        return done
    f.seek(offset)
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            break
        done += got
    return done


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"
