"""Temp files beside their targets, named after their writer, and the sweep of those a dead writer left.

A temp file left by a writer that could not clean up (SIGKILL, a crash) names its
writer's process, and the next write into that directory removes it once that
process is gone (``remove_stale_temps``); temp directories (``new_temp_dir``) are
named the same way and swept by a caller that says which files its writer makes.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import secrets
import socket
import time
from typing import Callable

from .signals import discard_live, live_temps, register_live

# A temp file is named ".<target>.<random>.vjps<pid>-<start>-<host>.tmp[.ext]": <pid> is
# the writer's process id, <start> its start time in clock ticks since boot (Linux's
# /proc/<pid>/stat; 0 where unknown), so a reused pid is not taken for the writer, and
# <host> 8 hex digits naming the boot and pid namespace (another host on a shared file
# system, another container, or a boot before a reboot gives another value; there the
# pid says nothing).

_TEMP_NAME = re.compile(r"\.[^/]*\.[0-9a-f]{8}\.vjps(\d+)-(\d+)-([0-9a-f]{8})\.tmp(\.[^.]*)?\Z")
# A temp of another boot or host cannot be judged by its pid; one untouched this long is
# abandoned (a live writer touches it at least when it writes, which takes seconds).
_FOREIGN_STALE_S = 24 * 3600
_SWEPT: set[str] = set()  # directories this process has swept already


def _start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (0 where unknown); None if no such process."""
    if pid <= 0 or os.name == "nt":  # on Windows os.kill(pid, 0) would terminate the process
        return 0
    try:
        os.kill(pid, 0)  # signal 0 only checks; unlike /proc it also sees processes hidden by hidepid
    except ProcessLookupError:
        return None
    except OSError:
        pass  # EPERM: it runs, as another user
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            line = f.read()
        # The command name (field 2) may hold spaces and parentheses: count from its closing ')'.
        return int(line[line.rindex(b")") + 2 :].split()[19])  # field 22 of proc(5), "starttime"
    except (OSError, ValueError, IndexError):  # no /proc (macOS, BSD), or it just exited
        return 0


@functools.cache
def _host_tag() -> str:
    """8 hex digits naming this boot and pid namespace (the host name where /proc has neither)."""
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        pass
    if not parts:
        parts.append(socket.gethostname())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def writer_tag() -> str:
    """``vjps<pid>-<start>-<host>`` for this process (another after a fork: the pid changed)."""
    return _tag_of(os.getpid())


@functools.cache
def _tag_of(pid: int) -> str:
    return f"vjps{pid}-{_start_ticks(pid) or 0}-{_host_tag()}"


def _writer_alive(pid: int, start: int, host: str) -> bool | None:
    """Whether the writer named in a temp file still runs; None where this process cannot tell."""
    if host != writer_tag().rsplit("-", 1)[1]:
        return None
    now = _start_ticks(pid)
    if now is None:
        return False
    return not (start and now and now != start)  # same pid, other start time: the pid was reused


def stale_temps(directory: str | os.PathLike) -> list[os.DirEntry[str]]:
    """The vjpsplit temp files and directories in ``directory`` whose writer is gone (see ``remove_stale_temps``)."""
    try:
        entries = list(os.scandir(os.path.abspath(os.fspath(directory))))
    except OSError:
        return []
    stale = []
    for entry in entries:
        m = _TEMP_NAME.match(entry.name)
        if m is None or entry.path in live_temps():
            continue
        try:
            alive = _writer_alive(int(m.group(1)), int(m.group(2)), m.group(3))
        except (OverflowError, ValueError):  # a pid no process can have: not a name we wrote, leave it
            continue
        if alive is None:
            try:
                alive = time.time() - entry.stat(follow_symlinks=False).st_mtime < _FOREIGN_STALE_S
            except OSError:
                continue
        if not alive:
            stale.append(entry)
    return stale


def remove_stale_temps(
    directory: str | os.PathLike, *, once: bool = False, owned: Callable[[str], bool] | None = None
) -> list[str]:
    """Remove vjpsplit temp files in ``directory`` whose writer is gone; return their paths.

    A temp file is vjpsplit's only if its name has vjpsplit's pattern (``.<target>.
    <random>.vjps<pid>-<start>-<host>.tmp``); it is stale when that process no longer
    runs on this host (or the pid now belongs to a later process), or, for a writer on
    another host or boot, when it has not been modified for a day. Other files, and
    temps of live writers, are never touched. Errors are ignored: this is tidying.
    ``once=True`` sweeps each directory at most once per process (every write calls it).

    A stale temp *directory* (``new_temp_dir``'s) is swept only where the caller says
    which of its entries its writer makes (``owned(name)``): those, and vjpsplit temp
    files in it, are removed, then the directory if nothing else is left in it; a
    directory holding anything else is left whole.
    """
    directory = os.path.abspath(os.fspath(directory))
    if once:
        if directory in _SWEPT:
            return []
        _SWEPT.add(directory)
    removed: list[str] = []
    for entry in stale_temps(directory):
        try:
            if entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                removed.append(entry.path)
            elif owned is not None and entry.is_dir(follow_symlinks=False) and clear_temp_dir(entry.path, owned):
                removed.append(entry.path)
        except OSError:
            pass
    return removed


def clear_temp_dir(path: str, owned: Callable[[str], bool]) -> bool:
    """Remove the files in the temp directory ``path`` that ``owned`` claims (and vjpsplit temps), then ``path``
    if it is empty; whether it was removed. Anything else in it (and so the directory) stays, and a symlink is
    not followed (a swap may have put a user's link to a directory there). Errors are ignored."""
    if os.path.islink(path):
        return False
    try:
        entries = list(os.scandir(path))
    except OSError:
        return False
    for entry in entries:
        if (owned(entry.name) or _TEMP_NAME.match(entry.name)) and entry.is_file(follow_symlinks=False):
            try:
                os.unlink(entry.path)
            except OSError:
                pass
    try:
        os.rmdir(path)
    except OSError:
        return False
    return True


def new_temp_dir(directory: str, name: str) -> str:
    """Create a fresh temp directory for ``name`` in ``directory`` (named as ``new_temp`` names files); its path.

    Raises:
        OSError: the directory cannot be created.
    """
    stem = name[:80]
    while True:
        tmp = os.path.join(directory, f".{stem}.{secrets.token_hex(4)}.{writer_tag()}.tmp")
        try:
            os.mkdir(tmp, 0o777)
            return tmp
        except FileExistsError:
            continue


def new_temp(directory: str, name: str, suffix: str = ".tmp") -> tuple[int, str]:
    """Create a fresh temp file for ``name`` in ``directory``: ``(fd, path)``, registered as live first.

    The name says which process writes it (``writer_tag``), so that if this process dies
    without cleaning up, a later write can tell the file is stale. The first temp a
    process makes in a directory first removes such stale ones there.
    """
    remove_stale_temps(directory, once=True)
    stem = name[:80]  # so that a 255-byte target name still gives a legal temp name
    while True:
        tmp = os.path.join(directory, f".{stem}.{secrets.token_hex(4)}.{writer_tag()}{suffix}")
        register_live(tmp)  # before it exists, so a signal in between cannot leak it
        try:
            # 0o666 under the umask: the mode a plain open() gives a new file.
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), tmp
        except FileExistsError:
            discard_live(tmp)
        except BaseException:
            discard_live(tmp)
            raise
