"""File helpers: crash-safe writes, outputs committed together, positioned reads.

Writing is safe in four ways, for the CLI and the Python API alike:

* ``check_outputs`` refuses, before any work, an output that is also an input, two
  outputs that are one file, and targets that are not regular writable files.
* ``atomic_write`` writes a temp file beside the target (fsynced when asked: artifacts,
  ``--fsync``) and renames it into place; a symlinked target is written through (the link stays).
* ``StagedOutputs`` writes several outputs to temp files and renames them all at
  the end, so a failed command changes none of them.
* While a write is under way, SIGINT, SIGTERM and SIGHUP remove this process's
  temp files before the signal takes its usual effect.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import signal
import stat
import sys
import threading
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


def os_error_message(path, e: OSError, doing: str) -> str:
    """One line for an OS error on ``path`` while ``doing`` (e.g. "writing it"): what happened and what to do."""
    shown = printable(path)
    code = e.errno
    if code == errno.ENOSPC:
        return f"{shown}: no space left on the device while {doing}; free some space or write it elsewhere"
    if code == getattr(errno, "EDQUOT", None):
        return f"{shown}: disk quota exceeded while {doing}; free some space or write it elsewhere"
    if code == errno.EFBIG:
        return (f"{shown}: file too large for the file system or the file-size limit (ulimit -f) while {doing}; "
                "raise the limit or write it elsewhere")
    if code in (errno.EACCES, errno.EPERM):
        return f"{shown}: permission denied while {doing}; check the permissions of the file and its directory"
    if code == errno.EROFS:
        return f"{shown}: the file system is read-only; write it elsewhere"
    if code == errno.ENOENT:
        return f"{shown}: no such file or directory while {doing}; check the path"
    if code == errno.ENOTDIR:
        return f"{shown}: a part of the path is not a directory; check the path"
    if code == errno.EISDIR:
        return f"{shown}: is a directory; give a file name"
    if code == errno.ENAMETOOLONG:
        return f"{shown}: the file name is too long; use a shorter one"
    if code == errno.ELOOP:
        return f"{shown}: too many levels of symbolic links; fix the link"
    if code == errno.EIO:
        return f"{shown}: input/output error while {doing} (the disk or network file system failed); check it and retry"
    if code == errno.ENOMEM:
        return f"{shown}: out of memory while {doing}; free memory and retry"
    reason = printable(e.strerror or e)
    return f"{shown}: {reason} while {doing}; check the path and the device"


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
            _Guard.pending, _Guard.raised, _Guard.previous = None, False, {}
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
def _signals_deferred() -> Iterator[None]:
    """Inside, a termination signal is only recorded, so a commit of several renames is not cut short."""
    _Guard.defer += 1
    try:
        yield
    finally:
        _Guard.defer -= 1


def _new_temp(directory: str, name: str, suffix: str = ".tmp") -> tuple[int, str]:
    """Create a fresh temp file for ``name`` in ``directory``: ``(fd, path)``, registered as live first."""
    stem = name[:80]  # so that a 255-byte target name still gives a legal temp name
    while True:
        tmp = os.path.join(directory, f".{stem}.{secrets.token_hex(4)}{suffix}")
        _LIVE.add(tmp)  # before it exists, so a signal in between cannot leak it
        try:
            # 0o666 under the umask: the mode a plain open() gives a new file.
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), tmp
        except FileExistsError:
            _LIVE.discard(tmp)
        except BaseException:
            _LIVE.discard(tmp)
            raise


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


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None], *, fsync: bool = False) -> None:
    """Call ``write(f)`` on a fresh temp file next to ``path``, then rename it into place.

    Readers see either no file, the previous complete one, or the new complete one,
    never a partial one, even if the process dies mid-write. The temp name is unique
    per call, so concurrent writers into one directory never share a temp file.
    A symlinked ``path`` is written through to its target (the link stays), and
    targets that are not regular writable files are refused (``write_target``).
    OS errors (full disk, file-size limit, permissions) become one-line
    ``VjpsplitError``s naming ``path``. ``fsync=True`` also flushes the file (and its
    directory) to disk before returning, so it survives a power loss (artifacts);
    without it a machine crash can leave the previous file or a torn new one, which
    checksums then catch.
    """
    text = os.fspath(path)
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
            os.replace(tmp, target)
            _LIVE.discard(tmp)
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
    the errors it raises name the output, not the temp file.
    """

    def __init__(self, outputs: Mapping[str, str | os.PathLike | None],
                 inputs: Mapping[str, str | os.PathLike | Iterable | None] | None = None):
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
            fd, tmp = _new_temp(directory, os.path.basename(target), ".tmp" + Path(path).suffix)
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
        with _signals_deferred():
            try:
                done = set()
                for label, tmp in list(self._temps.items()):
                    target = self.targets[label]
                    _keep_mode(tmp, target)
                    try:
                        os.replace(tmp, target)
                    except OSError as e:
                        raise VjpsplitError(os_error_message(self.paths[label], e, "renaming it into place")) from e
                    del self._temps[label]  # renamed: nothing of it is left to remove
                    _LIVE.discard(tmp)
                    _STAGED.discard(os.path.abspath(tmp))
                    if os.path.abspath(tmp) in _DURABLE:
                        _DURABLE.discard(os.path.abspath(tmp))
                        done.add(os.path.dirname(target) or ".")
                for directory in done:
                    _fsync_dir(directory)
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
