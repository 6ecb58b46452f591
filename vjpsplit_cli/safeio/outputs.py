"""Writing outputs safely: crash-safe writes, several outputs committed together, checked before any work.

Writing is safe in four ways, for the CLI and the Python API alike:

* ``check_outputs`` refuses, before any work, an output that is also an input, two
  outputs that are one file, and targets that are not regular writable files;
  ``check_directory_option`` a directory option that is a file or under one, and
  ``check_apart`` two directory options that overlap.
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
import os
import stat
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Callable, Iterable, Literal, Mapping

from .. import config
from ..errors import UsageError, VjpsplitError  # noqa: F401 - UsageError: writers refuse with it
from ..terminal import printable
from .filesystem import finish_removals, fsync_dir, fsync_file, keep_mode, preallocated, replace_file
from .reading import os_error_message
from .signals import (
    cleanup_on_signals,
    forget,
    is_durable,
    is_staged,
    mark_committed,
    signals_deferred,
    stage,
    unstage,
)
from .temps import new_temp


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True when ``a`` and ``b`` are one file: the same path after resolving links, or the same inode."""
    try:
        if os.path.realpath(a) == os.path.realpath(b):
            return True
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


_KINDS = [
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
]


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
                raise VjpsplitError(
                    f"{shown}: is {kind}, not a regular file; vjpsplit only replaces regular files, so give a file name"
                )
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
        raise VjpsplitError(
            f"{shown}: cannot create files in directory {where} (permission denied); "
            "check its permissions or write elsewhere"
        )
    return target


def _paths(value: str | os.PathLike | Iterable | None) -> list:
    if value is None:
        return []
    if isinstance(value, (str, bytes, os.PathLike)):
        return [value]
    return [v for v in value if v is not None]


def check_outputs(
    outputs: Mapping[str, str | os.PathLike | None],
    inputs: Mapping[str, str | os.PathLike | Iterable | None] | None = None,
) -> dict[str, str]:
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
                    raise UsageError(
                        f"{label} {printable(os.fspath(p))} is the same file as {in_label}{other}, "
                        "which the command reads; write the output to another file"
                    )
    labels = list(given)
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            if same_file(given[a], given[b]):
                raise UsageError(
                    f"{a} and {b} both name {printable(os.fspath(given[a]))}; give each output its own file"
                )
    return {label: write_target(p, label) for label, p in given.items()}


def check_directory_option(label: str, directory: str | os.PathLike) -> None:
    """Refuse, when the option is given, a directory that can never be one: a file, or a path under a file.

    A directory that does not exist yet passes (it is created when first written to). Nothing is touched.

    Args:
        label: the option, as the message names it (``Observe(trace_dir=...)``).
        directory: its value.

    Raises:
        VjpsplitError: ``directory`` is a file (or anything but a directory), or a part of its path is.
    """
    shown = f"{label}: {printable(os.fspath(directory))}"
    path = os.path.abspath(os.fspath(directory))
    if os.path.lexists(path) and not os.path.isdir(path):
        raise VjpsplitError(f"{shown} is a file, not a directory; give a directory (it is created if absent)")
    parent = os.path.dirname(path)
    while not os.path.lexists(parent) and parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise VjpsplitError(
            f"{shown} is under {printable(parent)}, which is a file, not a directory; give a directory elsewhere"
        )


def check_apart(directories: Mapping[str, str | os.PathLike | None]) -> None:
    """Refuse two directory options that overlap: the same directory, or one inside the other (links resolved).

    Args:
        directories: each option's label (used in messages) and its directory, or None (not given).

    Raises:
        VjpsplitError: the first two that overlap, naming both options.
    """
    given = [(label, os.fspath(d), os.path.realpath(d)) for label, d in directories.items() if d is not None]
    for i, (a, shown_a, real_a) in enumerate(given):
        for b, shown_b, real_b in given[i + 1 :]:
            if real_a == real_b:
                how = "are the same directory"
            elif os.path.commonpath([real_a, real_b]) in (real_a, real_b):
                how = "overlap: one is inside the other"
            else:
                continue
            raise VjpsplitError(
                f"{a} {printable(shown_a)} and {b} {printable(shown_b)} {how}; give each its own directory, "
                "neither inside the other"
            )


def fsync_requested(fsync: bool = False) -> bool:
    """``fsync``, or true when the environment asks for every write to be flushed (``VJPSPLIT_FSYNC=1``)."""
    return bool(fsync) or config.fsync_always()


def atomic_write(
    path: str | os.PathLike, write: Callable[[BinaryIO], None], *, fsync: bool = False, size: int | None = None
) -> None:
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
    ``size``, about how many bytes ``write`` will write (in order, from the start),
    lets a big file's blocks be reserved in one step first (``preallocated``).
    """
    text = os.fspath(path)
    fsync = fsync or fsync_requested()
    if is_staged(text):
        _write_in_place(text, write, fsync, size)
        return
    target = write_target(text)
    directory = os.path.dirname(target) or "."
    with cleanup_on_signals():
        try:
            finish_removals()
            fd, tmp = new_temp(directory, os.path.basename(target))
        except OSError as e:
            raise VjpsplitError(os_error_message(text, e, f"creating a file in {printable(directory)}")) from e
        try:
            with os.fdopen(fd, "wb") as f:
                with preallocated(f, size):
                    write(f)
                if fsync:
                    os.fsync(f.fileno())
            keep_mode(tmp, target)
            with signals_deferred():  # a signal after the swap must not report the old file as kept
                replace_file(tmp, target)
        except OSError as e:
            forget(tmp)
            raise VjpsplitError(os_error_message(text, e, "writing it")) from e
        except BaseException:
            forget(tmp)
            raise
        if fsync:
            fsync_dir(directory)


def _write_in_place(tmp: str, write: Callable[[BinaryIO], None], fsync: bool = False, size: int | None = None) -> None:
    """Fill a temp file that StagedOutputs made (it renames the file later, syncing the rename if asked)."""
    try:
        with open(tmp, "wb") as f:
            with preallocated(f, size):
                write(f)
            if fsync:
                os.fsync(f.fileno())
                stage(tmp, durable=True)
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

    def __init__(
        self,
        outputs: Mapping[str, str | os.PathLike | None],
        inputs: Mapping[str, str | os.PathLike | Iterable | None] | None = None,
        *,
        fsync: bool = False,
    ):
        self.fsync = fsync_requested(fsync)
        self.targets = check_outputs(outputs, inputs)
        self.paths = {label: os.fspath(p) for label, p in outputs.items() if label in self.targets and p is not None}
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
            forget(old)
        try:
            finish_removals()
            fd, tmp = new_temp(directory, os.path.basename(target), ".tmp" + Path(path).suffix[:16])
        except OSError as e:
            raise VjpsplitError(os_error_message(path, e, f"creating a file in {printable(directory)}")) from e
        os.close(fd)
        self._temps[label] = tmp
        stage(tmp)
        try:
            writer(tmp)
        except VjpsplitError as e:
            raise _renamed(e, tmp, path) from e
        except OSError as e:
            raise VjpsplitError(os_error_message(path, e, "writing it")) from e
        except MemoryError as e:
            raise VjpsplitError(f"{printable(path)}: out of memory while writing it; free memory or write less") from e

    def __exit__(
        self, etype: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
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
            forget(tmp)
        self._temps.clear()

    def _commit(self) -> None:
        if self.fsync:  # before the renames, and still interruptible: syncing can take seconds
            for label, tmp in self._temps.items():
                if not is_durable(tmp):
                    try:
                        fsync_file(tmp)
                    except OSError as e:
                        self._discard()
                        raise VjpsplitError(os_error_message(self.paths[label], e, "flushing it to disk")) from e
                    stage(tmp, durable=True)
        with signals_deferred():
            try:
                done = set()
                for label, tmp in list(self._temps.items()):
                    target = self.targets[label]
                    keep_mode(tmp, target)
                    try:
                        replace_file(tmp, target)
                    except OSError as e:
                        raise VjpsplitError(os_error_message(self.paths[label], e, "renaming it into place")) from e
                    del self._temps[label]  # renamed: nothing of it is left to remove
                    if is_durable(tmp):
                        done.add(os.path.dirname(target) or ".")
                    unstage(tmp)
                for directory in done:
                    fsync_dir(directory)
                mark_committed()
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
