"""The verdict cache: clean module-check verdicts kept in this process and in a private directory.

A verdict says a module (by its bytes' SHA-256 and jaxlib's version) parsed cleanly and
what it holds, so a repeated load skips the child process (``probes``), and a symbolic
module's kernel check at a call's shapes is done once per signature (``kernelcheck``).
Only a directory private to this user is read or written: a planted verdict would let a
forged module skip the checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from typing import Any, BinaryIO

from .. import config
from ..errors import VjpsplitError
from ..safeio.outputs import atomic_write

DEFAULT = "default"  # ``cache_dir`` sentinel: the default cache location (``config.cache_dir``)
_SEEN: dict[str, dict[str, Any]] = {}  # verdict name -> verdict, for modules this process has checked already


def verdict_dir(cache_dir: str | None) -> str | None:
    """``<cache_dir>/checked`` (``DEFAULT``: under the default location) when private to this user; else None."""
    if cache_dir == DEFAULT:
        cache_dir = config.cache_dir()
    if not cache_dir:
        return None
    path = os.path.join(cache_dir, "checked")
    return path if config.ensure_private_dir(cache_dir)[0] and config.ensure_private_dir(path)[0] else None


def module_verdict_name(data: bytes) -> str:
    """The cache name of the verdict on module bytes ``data`` (with jaxlib's version: a new parser checks again)."""
    import jaxlib

    return hashlib.sha256(getattr(jaxlib, "__version__", "?").encode() + b"\0" + bytes(data)).hexdigest() + ".json"


def read_verdict(directory: str, name: str) -> dict[str, Any] | None:
    """The verdict ``name`` in ``directory``: only a regular file of this user's that no one else may write."""
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022 or st.st_size > 1 << 24:
            return None
        try:
            value = json.loads(f.read())
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def write_verdict(directory: str, name: str, value: dict[str, Any]) -> None:
    """Write a verdict into ``directory`` (best effort: a cache, the next call checks again)."""
    text = json.dumps(value).encode()

    def write(f: BinaryIO) -> None:
        f.write(text)

    try:
        atomic_write(os.path.join(directory, name), write)
    except (OSError, VjpsplitError):
        pass


def seen(name: str) -> dict[str, Any] | None:
    """The verdict ``name`` if this process holds it."""
    return _SEEN.get(name)


def remember(name: str, value: dict[str, Any]) -> None:
    """Hold verdict ``name`` in this process."""
    _SEEN[name] = value


def known_verdict(name: str, cache_dir: str | None = DEFAULT) -> bool:
    """Whether a clean verdict named ``name`` is kept, in this process or in ``cache_dir``'s private directory."""
    if name in _SEEN:
        return True
    directory = verdict_dir(cache_dir)
    value = read_verdict(directory, name) if directory else None
    if value is not None:
        _SEEN[name] = value
    return value is not None


def keep_verdict(name: str, value: dict[str, Any], cache_dir: str | None = DEFAULT) -> None:
    """Keep a clean verdict, in this process and (best effort) in ``cache_dir``'s private directory."""
    _SEEN[name] = value
    directory = verdict_dir(cache_dir)
    if directory:
        write_verdict(directory, name, value)


def forget_verdicts() -> None:
    """Forget the module verdicts this process keeps in memory (the next load reads the cache directory or probes)."""
    _SEEN.clear()
