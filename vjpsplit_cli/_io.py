"""Crash-safe file writing: a temp file in the target's directory, fsynced, then renamed."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from .errors import VjpsplitError


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(f)`` on a fresh temp file next to ``path``, then rename it into place.

    Readers see either no file, the previous complete one, or the new complete one,
    never a partial one, even if the process dies mid-write. The temp name is unique
    per call, so concurrent writers into one directory never share a temp file.
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
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


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


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"
