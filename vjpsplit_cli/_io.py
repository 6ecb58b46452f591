"""File helpers: crash-safe writes, outputs committed together, reads with one-line errors.

Writing is safe in four ways, for the CLI and the Python API alike:

* ``check_outputs`` refuses, before any work, an output that is also an input, two
  outputs that are one file, and targets that are not regular writable files.
* ``atomic_write`` writes a temp file beside the target (fsynced when asked: artifacts,
  ``--fsync``, ``VJPSPLIT_FSYNC=1``) and swaps it into place; a symlinked target is
  written through (the link stays).
* ``StagedOutputs`` writes several outputs to temp files and renames them all at
  the end, so a failed command changes none of them.
* While a write is under way, SIGINT, SIGTERM and SIGHUP remove this process's
  temp files before the signal takes its usual effect. A temp file left by a writer
  that could not clean up (SIGKILL, a crash) names its writer's process, and the next
  write into that directory removes it once that process is gone (``remove_stale_temps``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import socket
import signal
import stat
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator, Mapping

from .errors import VjpsplitError


class UsageError(VjpsplitError):
    """A mistake in the command line or the call itself (the CLI exits 2 for these)."""


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived while outputs were being written.

    A BaseException, so ``except Exception`` in a caller does not swallow it. By the
    time it is raised this process's temp files are gone; when the guard that raised
    it exits, the signal is delivered again to the handler that was there before.
    """

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


# ---------------------------------------------------------------------------- printing


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text) -> str:
    """``text`` with control, format and separator characters escaped, so it prints as one safe line.

    A newline becomes ``\\n``, an escape code ``\\x1b``, a bidi override ``\\u202e``,
    and a byte of a file name that was not UTF-8 (a surrogate escape) ``\\xNN``.
    """
    text = str(text)
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable() or ch == " ":
            out.append(ch)
        elif ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif 0xDC80 <= ord(ch) <= 0xDCFF:  # os.fsdecode's stand-in for an undecodable byte
            out.append(f"\\x{ord(ch) - 0xDC00:02x}")
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return "".join(out)


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


def os_error_message(path, e: OSError, doing: str) -> str:
    """One line for an OS error on ``path`` while ``doing`` (e.g. "writing it"): what happened and what to do."""
    known = _OS_ERRORS.get(e.errno)
    what = known.format(doing=doing) if known else f"{printable(e.strerror or e)} while {doing}; check the path and the device"
    return f"{printable(path)}: {what}"


# ---------------------------------------------------------------------------- temp files and signals

# Temp files this process is writing right now; a termination signal removes them.
_LIVE: set[str] = set()
# Temp files that StagedOutputs hands to writers: atomic_write fills them in place.
_STAGED: set[str] = set()
# Staged temp files written with fsync=True: their rename is synced too.
_DURABLE: set[str] = set()
_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


class _Guard:
    """State of ``cleanup_on_signals`` (one per process: signal handlers are too)."""

    depth = 0
    defer = 0
    pending: int | None = None
    raised = False
    previous: dict = {}
    committed = False  # some StagedOutputs committed since the outermost guard began


def outputs_committed() -> bool:
    """Whether outputs were committed under the current (or last) signal guard.

    A signal that arrives during the renames is held until they finish, so an
    interrupt can follow a complete commit: messages must not say nothing was written.
    """
    return _Guard.committed


def _remove_live_temps() -> None:
    for tmp in list(_LIVE):
        try:
            os.unlink(tmp)
        except OSError:
            pass
        _LIVE.discard(tmp)
        _STAGED.discard(os.path.abspath(tmp))


def _on_signal(signum, frame) -> None:
    if _Guard.pending is None:
        _Guard.pending = signum
    if _Guard.defer or _Guard.raised:
        return  # committing, or already unwinding: the guard delivers it again at the end
    _Guard.raised = True
    _remove_live_temps()
    raise Interrupted(signum)


@contextlib.contextmanager
def cleanup_on_signals() -> Iterator[None]:
    """While active, SIGINT/SIGTERM/SIGHUP remove this process's temp files, then act as before.

    The signal first raises ``Interrupted`` (so ``finally`` blocks run); on leaving
    the outermost guard the previous handlers come back and the signal is delivered
    again to them: by default SIGTERM and SIGHUP then end the process and SIGINT
    raises KeyboardInterrupt. Signals set to be ignored stay ignored. Nests; does
    nothing outside the main thread (Python runs signal handlers only there).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer = _Guard.depth == 0
    _Guard.depth += 1
    try:
        if outer:  # inside the try: a signal during the installs still restores what was installed
            _Guard.pending, _Guard.raised, _Guard.previous, _Guard.committed = None, False, {}, False
            for s in _SIGNALS:
                previous = signal.getsignal(s)
                if previous in (signal.SIG_IGN, None):  # e.g. under nohup: the user asked to ignore it
                    continue
                _Guard.previous[s] = previous
                signal.signal(s, _on_signal)
        yield
    finally:
        _Guard.depth -= 1
        if outer:
            with _signals_deferred():  # a signal now must not cut the restores short
                for s, previous in _Guard.previous.items():
                    signal.signal(s, previous)
            pending = _Guard.pending
            _Guard.pending, _Guard.raised, _Guard.previous = None, False, {}
            if pending is not None:
                _remove_live_temps()
                signal.raise_signal(pending)


@contextlib.contextmanager
def signals_end_process() -> Iterator[bool]:
    """While XLA runs a module: SIGINT, SIGTERM and SIGHUP end the process at once (yields whether they do).

    Python runs signal handlers only between bytecodes, and a module can run in C++
    for ever (a forged never-ending loop): ``cleanup_on_signals``'s handler would
    wait for it. So, under that guard and while this process has no temp file to
    remove, the default actions come back for the duration: the process ends, and
    there is no output to tidy. Signals the user set to be ignored stay ignored.
    """
    if (threading.current_thread() is not threading.main_thread() or _Guard.depth == 0 or _LIVE
            or _Guard.defer or _Guard.pending is not None):
        yield False
        return
    installed = {}
    try:
        for s in _Guard.previous:
            installed[s] = signal.signal(s, signal.SIG_DFL)
        yield True
    finally:
        for s, handler in installed.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def time_limit(seconds: float | None, message: str) -> Iterator[None]:
    """Past ``seconds`` inside, print ``error: <message>`` and end the process with exit code 1.

    A module can run in C++ for ever, where no Python exception reaches it, so only
    ending the process stops it. This process's temp files are removed first; wrap
    only work that commits no output (the CLI's loads and module runs).
    """
    if not seconds:
        yield
        return

    def expire() -> None:
        _remove_live_temps()
        sys.stderr.write(f"error: {printable(message)}\n")
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Inside, a termination signal is only recorded, so a commit of several renames is not cut short."""
    _Guard.defer += 1
    try:
        yield
    finally:
        _Guard.defer -= 1


def _new_temp(directory: str, name: str, suffix: str = ".tmp") -> tuple[int, str]:
    """Create a fresh temp file for ``name`` in ``directory``: ``(fd, path)``, registered as live first.

    The name says which process writes it (``_WRITER``), so that if this process dies
    without cleaning up, a later write can tell the file is stale. The first temp a
    process makes in a directory first removes such stale ones there.
    """
    remove_stale_temps(directory, once=True)
    stem = name[:80]  # so that a 255-byte target name still gives a legal temp name
    while True:
        tmp = os.path.join(directory, f".{stem}.{secrets.token_hex(4)}.{_writer_tag()}{suffix}")
        _LIVE.add(tmp)  # before it exists, so a signal in between cannot leak it
        try:
            # 0o666 under the umask: the mode a plain open() gives a new file.
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), tmp
        except FileExistsError:
            _LIVE.discard(tmp)
        except BaseException:
            _LIVE.discard(tmp)
            raise


# ---------------------------------------------------------------------------- stale temp files
#
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
_TAG: list[str] = []


def private_dir(path: str | os.PathLike) -> bool:
    """True if ``path`` is a directory owned by this user that no one else can write.

    The rule for every cache whose entries become programs this process runs.
    """
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


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
        return int(line[line.rindex(b")") + 2:].split()[19])  # field 22 of proc(5), "starttime"
    except (OSError, ValueError, IndexError):  # no /proc (macOS, BSD), or it just exited
        return 0


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


def _writer_tag() -> str:
    """``vjps<pid>-<start>-<host>`` for this process (recomputed after a fork: the pid changed)."""
    pid = os.getpid()
    if not _TAG or not _TAG[0].startswith(f"vjps{pid}-"):
        _TAG[:] = [f"vjps{pid}-{_start_ticks(pid) or 0}-{_host_tag()}"]
    return _TAG[0]


def _writer_alive(pid: int, start: int, host: str) -> bool | None:
    """Whether the writer named in a temp file still runs; None where this process cannot tell."""
    if host != _writer_tag().rsplit("-", 1)[1]:
        return None
    now = _start_ticks(pid)
    if now is None:
        return False
    return not (start and now and now != start)  # same pid, other start time: the pid was reused


def remove_stale_temps(directory: str | os.PathLike, *, once: bool = False) -> list[str]:
    """Remove vjpsplit temp files in ``directory`` whose writer is gone; return their paths.

    A temp file is vjpsplit's only if its name has vjpsplit's pattern (``.<target>.
    <random>.vjps<pid>-<start>-<host>.tmp``); it is stale when that process no longer
    runs on this host (or the pid now belongs to a later process), or, for a writer on
    another host or boot, when it has not been modified for a day. Other files, and
    temps of live writers, are never touched. Errors are ignored: this is tidying.
    ``once=True`` sweeps each directory at most once per process (every write calls it).
    """
    directory = os.path.abspath(os.fspath(directory))
    if once:
        if directory in _SWEPT:
            return []
        _SWEPT.add(directory)
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP_NAME.match(entry.name)
        if m is None or entry.path in _LIVE:
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
        if alive:
            continue
        try:
            if entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                removed.append(entry.path)
        except OSError:
            pass
    return removed


def _forget(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    _LIVE.discard(tmp)
    _STAGED.discard(os.path.abspath(tmp))
    _DURABLE.discard(os.path.abspath(tmp))


def _fsync_dir(directory: str) -> None:
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


def _fsync_file(path: str) -> None:
    """Flush a file this process wrote (and closed) to disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _keep_mode(tmp: str, target: str) -> None:
    """Give ``tmp`` the permission bits of the file it replaces, as overwriting that file would keep them."""
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        return
    try:
        os.chmod(tmp, mode)
    except OSError:
        pass


def _replace(tmp: str, target: str) -> None:
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
    exchange = _renameat2()
    if exchange is not None and exchange(tmp, target):
        try:
            os.unlink(tmp)  # the old file now
        except OSError:
            pass
        _LIVE.discard(tmp)
        return
    os.replace(tmp, target)
    _LIVE.discard(tmp)


_RENAMEAT2: list = []  # [function or None], resolved on first use


def _renameat2():
    """``exchange(a, b) -> bool`` swapping two paths with renameat2(RENAME_EXCHANGE); None where unavailable.

    Python has no API for renameat2 (os.rename/os.replace take no flags), so it is
    glibc's wrapper (2.28 and later) through ctypes. False from ``exchange`` means the
    call failed and changed nothing.
    """
    if not _RENAMEAT2:
        exchange = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).renameat2
                fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                fn.restype = ctypes.c_int
                at_fdcwd, rename_exchange = -100, 2  # <fcntl.h> AT_FDCWD, <linux/fs.h> RENAME_EXCHANGE

                def exchange(a: str, b: str) -> bool:
                    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
            except (ImportError, OSError, AttributeError):
                exchange = None
        _RENAMEAT2.append(exchange)
    return _RENAMEAT2[0]


# ---------------------------------------------------------------------------- checking outputs


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True when ``a`` and ``b`` are one file: the same path after resolving links, or the same inode."""
    try:
        if os.path.realpath(a) == os.path.realpath(b):
            return True
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


_KINDS = [(stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")]


def _read_only_fs(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def write_target(path: str | os.PathLike, label: str = "") -> str:
    """Check that ``path`` can be replaced by a new regular file; return the file to replace.

    A symlink resolves to its target (written through; the link stays). Refused,
    with one line naming ``label`` and the path: ``-``; an existing target that is
    not a regular file (directory, device, FIFO, socket) or that ``open(path, 'wb')``
    would refuse (read-only); a directory that is missing or where no file can be
    created. Nothing is created or changed.
    """
    text = os.fspath(path)
    shown = f"{label} {printable(text)}" if label else printable(text)
    if text == "-":
        raise UsageError(f"{label or 'output'} -: writing to standard output is not supported; give a file name")
    if not text:
        raise UsageError(f"{label or 'output'}: the file name is empty; give a file name")
    if text.endswith(("/", os.sep)):
        raise UsageError(f"{shown}: ends with '/', so it names a directory; give a file name")
    target = os.path.realpath(text)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise VjpsplitError(os_error_message(shown, e, "checking it")) from e
    if st is not None:
        for is_kind, kind in _KINDS:
            if is_kind(st.st_mode):
                raise VjpsplitError(f"{shown}: is {kind}, not a regular file; vjpsplit only replaces regular files, "
                                    "so give a file name")
        if not os.access(target, os.W_OK):
            if _read_only_fs(target):
                raise VjpsplitError(f"{shown}: the file system is read-only; write it elsewhere")
            raise VjpsplitError(f"{shown}: the file is read-only; make it writable (chmod u+w) or write elsewhere")
    directory = os.path.dirname(target) or "."
    # Name the directory as the user wrote it, unless a link took us elsewhere.
    as_written = os.path.dirname(text) or "."
    where = printable(as_written if os.path.abspath(as_written) == directory else directory)
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise VjpsplitError(f"{shown}: directory {where} {what}; create it first")
    if not os.access(directory, os.W_OK | os.X_OK):
        if _read_only_fs(directory):
            raise VjpsplitError(f"{shown}: the file system is read-only; write it elsewhere")
        raise VjpsplitError(f"{shown}: cannot create files in directory {where} (permission denied); "
                            "check its permissions or write elsewhere")
    return target


def _paths(value) -> list:
    if value is None:
        return []
    if isinstance(value, (str, bytes, os.PathLike)):
        return [value]
    return [v for v in value if v is not None]


def check_outputs(outputs: Mapping[str, str | os.PathLike | None],
                  inputs: Mapping[str, str | os.PathLike | Iterable | None] | None = None) -> dict[str, str]:
    """Check every output before any work; return ``{label: file to replace}`` for the outputs given.

    ``outputs`` and ``inputs`` map a label (an option name such as ``--grads``, used
    in messages) to a path or None (not given); an input may also map to a list of
    paths. An output that is the same file as an input, or two outputs that are one
    file, is a ``UsageError``; ``write_target`` says what else is refused. Nothing
    is touched.
    """
    inputs = inputs or {}
    given = {label: p for label, p in outputs.items() if p is not None}
    for label, p in given.items():
        for in_label, value in inputs.items():
            for q in _paths(value):
                if same_file(p, q):
                    other = "" if os.fspath(p) == os.fspath(q) else f" {printable(os.fspath(q))}"
                    raise UsageError(f"{label} {printable(os.fspath(p))} is the same file as {in_label}{other}, "
                                     "which the command reads; write the output to another file")
    labels = list(given)
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            if same_file(given[a], given[b]):
                raise UsageError(f"{a} and {b} both name {printable(os.fspath(given[a]))}; "
                                 "give each output its own file")
    return {label: write_target(p, label) for label, p in given.items()}


# ---------------------------------------------------------------------------- writing


def fsync_requested(fsync: bool = False) -> bool:
    """``fsync``, or true when the environment asks for every write to be flushed (``VJPSPLIT_FSYNC=1``)."""
    return bool(fsync) or os.environ.get("VJPSPLIT_FSYNC", "").strip().lower() in ("1", "true", "yes", "on")


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None], *, fsync: bool = False) -> None:
    """Call ``write(f)`` on a fresh temp file next to ``path``, then rename it into place.

    Readers see either no file, the previous complete one, or the new complete one,
    never a partial one, even if the process dies mid-write. The temp name is unique
    per call, so concurrent writers into one directory never share a temp file.
    A symlinked ``path`` is written through to its target (the link stays), and
    targets that are not regular writable files are refused (``write_target``).
    OS errors (full disk, file-size limit, permissions) become one-line
    ``VjpsplitError``s naming ``path``. ``fsync=True`` (or ``VJPSPLIT_FSYNC=1`` in the
    environment) also flushes the file (and its directory) to disk before returning,
    so it survives a power loss (artifacts); without it a machine crash can leave the
    previous file, or an empty or torn new one, which size checks and checksums catch.
    """
    text = os.fspath(path)
    fsync = fsync or fsync_requested()
    if os.path.abspath(text) in _STAGED:
        _write_in_place(text, write, fsync)
        return
    target = write_target(text)
    directory = os.path.dirname(target) or "."
    with cleanup_on_signals():
        try:
            fd, tmp = _new_temp(directory, os.path.basename(target))
        except OSError as e:
            raise VjpsplitError(os_error_message(text, e, f"creating a file in {printable(directory)}")) from e
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
            _keep_mode(tmp, target)
            with _signals_deferred():  # a signal after the swap must not report the old file as kept
                _replace(tmp, target)
        except OSError as e:
            _forget(tmp)
            raise VjpsplitError(os_error_message(text, e, "writing it")) from e
        except BaseException:
            _forget(tmp)
            raise
        if fsync:
            _fsync_dir(directory)


def _write_in_place(tmp: str, write: Callable[[BinaryIO], None], fsync: bool = False) -> None:
    """Fill a temp file that StagedOutputs made (it renames the file later, syncing the rename if asked)."""
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
                _DURABLE.add(os.path.abspath(tmp))
    except OSError as e:
        raise VjpsplitError(os_error_message(tmp, e, "writing it")) from e


class StagedOutputs:
    """Write a command's outputs to temp files, then replace all of them at once, or none.

    ::

        with StagedOutputs({"--residuals": "r.npz", "--outputs": "o.npz"},
                           inputs={"--inputs": "in.npz"}) as out:   # checked here, before any work
            out.write("--residuals", lambda tmp: save_residuals(tmp, res))
            out.write("--outputs", lambda tmp: save_arrays(tmp, outs))
        # Leaving the block normally renames both into place. An exception, or
        # SIGINT/SIGTERM/SIGHUP, removes the temp files and changes no previous file.

    The constructor runs ``check_outputs``. A writer gets a temp path beside the
    target with the output's extension (so ``save_arrays`` picks the same format);
    the errors it raises name the output, not the temp file. ``fsync=True`` (or
    ``VJPSPLIT_FSYNC=1``) flushes every output and the renames to disk, whatever the
    writer did, so the outputs survive a power loss (``--fsync``).
    """

    def __init__(self, outputs: Mapping[str, str | os.PathLike | None],
                 inputs: Mapping[str, str | os.PathLike | Iterable | None] | None = None, *, fsync: bool = False):
        self.fsync = fsync_requested(fsync)
        self.targets = check_outputs(outputs, inputs)
        self.paths = {label: os.fspath(outputs[label]) for label in self.targets}
        self._temps: dict[str, str] = {}
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> "StagedOutputs":
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(cleanup_on_signals())
        return self

    def write(self, label: str, writer: Callable[[str], object]) -> None:
        """Call ``writer(temp_path)`` to produce the output ``label``; it is committed when the block ends."""
        if label not in self.targets:
            raise KeyError(f"{label!r} is not one of the outputs {', '.join(self.targets)}")
        path, target = self.paths[label], self.targets[label]
        directory = os.path.dirname(target) or "."
        old = self._temps.pop(label, None)
        if old is not None:
            _forget(old)
        try:
            fd, tmp = _new_temp(directory, os.path.basename(target), ".tmp" + Path(path).suffix[:16])
        except OSError as e:
            raise VjpsplitError(os_error_message(path, e, f"creating a file in {printable(directory)}")) from e
        os.close(fd)
        self._temps[label] = tmp
        _STAGED.add(os.path.abspath(tmp))
        try:
            writer(tmp)
        except VjpsplitError as e:
            raise _renamed(e, tmp, path) from e
        except OSError as e:
            raise VjpsplitError(os_error_message(path, e, "writing it")) from e
        except MemoryError as e:
            raise VjpsplitError(f"{printable(path)}: out of memory while writing it; free memory or write less") from e

    def __exit__(self, etype, exc, tb) -> bool:
        try:
            if etype is None:
                self._commit()
            else:
                self._discard()
        finally:
            stack, self._stack = self._stack, None
            if stack is not None:
                stack.close()
        return False

    def _discard(self) -> None:
        for tmp in self._temps.values():
            _forget(tmp)
        self._temps.clear()

    def _commit(self) -> None:
        if self.fsync:  # before the renames, and still interruptible: syncing can take seconds
            for label, tmp in self._temps.items():
                if os.path.abspath(tmp) not in _DURABLE:
                    try:
                        _fsync_file(tmp)
                    except OSError as e:
                        self._discard()
                        raise VjpsplitError(os_error_message(self.paths[label], e, "flushing it to disk")) from e
                    _DURABLE.add(os.path.abspath(tmp))
        with _signals_deferred():
            try:
                done = set()
                for label, tmp in list(self._temps.items()):
                    target = self.targets[label]
                    _keep_mode(tmp, target)
                    try:
                        _replace(tmp, target)
                    except OSError as e:
                        raise VjpsplitError(os_error_message(self.paths[label], e, "renaming it into place")) from e
                    del self._temps[label]  # renamed: nothing of it is left to remove
                    _STAGED.discard(os.path.abspath(tmp))
                    if os.path.abspath(tmp) in _DURABLE:
                        _DURABLE.discard(os.path.abspath(tmp))
                        done.add(os.path.dirname(target) or ".")
                for directory in done:
                    _fsync_dir(directory)
                _Guard.committed = True
            finally:
                self._discard()


def _renamed(e: VjpsplitError, tmp: str, path: str) -> VjpsplitError:
    """``e`` with the temp file's name replaced by the output's, as the user wrote it; always naming it."""
    text = str(e).replace(tmp, path).replace(os.path.basename(tmp), os.path.basename(path))
    if os.path.basename(path) not in text:
        text = f"{path}: {text}"
    try:
        return type(e)(text)
    except Exception:
        return VjpsplitError(text)


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
