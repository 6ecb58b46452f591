"""Reading files with one-line errors: what went wrong with which file, and what to do."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import BinaryIO

from ..errors import VjpsplitError
from ..terminal import printable

# What an OS error means for the user, and what to do; "{doing}" is what was being done.
_OS_ERRORS = {
    errno.ENOSPC: "no space left on the device while {doing}; free some space or write it elsewhere",
    getattr(errno, "EDQUOT", -1): "disk quota exceeded while {doing}; free some space or write it elsewhere",
    errno.EFBIG: "file too large for the file system or the file-size limit (ulimit -f) while {doing}; "
    "raise the limit or write it elsewhere",
    errno.EACCES: "permission denied while {doing}; check the permissions of the file and its directory",
    errno.EPERM: "permission denied while {doing}; check the permissions of the file and its directory",
    errno.EROFS: "the file system is read-only; write it elsewhere",
    errno.ENOENT: "no such file or directory while {doing}; check the path",
    errno.ENOTDIR: "a part of the path is not a directory; check the path",
    errno.EISDIR: "is a directory; give a file name",
    errno.ENAMETOOLONG: "the file name is too long; use a shorter one",
    errno.ELOOP: "too many levels of symbolic links; fix the link",
    errno.EIO: "input/output error while {doing} (the disk or network file system failed); check it and retry",
    errno.ENOMEM: "out of memory while {doing}; free memory and retry",
}


def os_error_message(path: str | os.PathLike, e: OSError, doing: str) -> str:
    """One line for an OS error on ``path`` while ``doing`` (e.g. "writing it"): what happened and what to do."""
    known = _OS_ERRORS.get(e.errno)
    what = (
        known.format(doing=doing)
        if known
        else f"{printable(e.strerror or e)} while {doing}; check the path and the device"
    )
    return f"{printable(path)}: {what}"


def open_for_read(path: str | os.PathLike, what: str, named: str | None = None) -> BinaryIO:
    """Open a file for reading, turning every OS-level failure into one clear VjpsplitError.

    ``named``: how the message names the file (an option and its value, ``--shapes x=a.npz``); its path by default.
    """
    path = Path(path)
    where = str(path) if named is None else named
    try:
        return open(path, "rb")
    except FileNotFoundError as e:
        raise VjpsplitError(f"{where}: no such {what} file; check the path") from e
    except IsADirectoryError as e:
        raise VjpsplitError(f"{where}: is a directory, expected {_article(what)} {what} file") from e
    except PermissionError as e:
        raise VjpsplitError(f"{where}: permission denied reading the {what} file; check its permissions") from e
    except OSError as e:
        raise VjpsplitError(f"{where}: cannot read the {what} file ({e.strerror or e})") from e


def read_bytes(path: str | os.PathLike, what: str) -> bytes:
    """Read a whole file; failures as in ``open_for_read``."""
    with open_for_read(path, what) as f:
        try:
            return f.read()
        except OSError as e:
            raise VjpsplitError(f"{path}: cannot read the {what} file ({e.strerror or e})") from e


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"
