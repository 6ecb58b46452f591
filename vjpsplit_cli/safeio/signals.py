"""Termination signals while outputs are written: this process's temp files, removed before the signal acts.

While a write is under way, SIGINT, SIGTERM and SIGHUP remove this process's
temp files before the signal takes its usual effect (``cleanup_on_signals``);
a commit of several renames holds them until it is done (``signals_deferred``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, ContextManager, Iterator


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived while outputs were being written.

    A BaseException, so ``except Exception`` in a caller does not swallow it. By the
    time it is raised this process's temp files are gone; when the guard that raised
    it exits, the signal is delivered again to the handler that was there before.
    """

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


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
    hook: Any = staticmethod(sys.unraisablehook)  # the unraisable hook the outermost guard replaced


def outputs_committed() -> bool:
    """Whether outputs were committed under the current (or last) signal guard.

    A signal that arrives during the renames is held until they finish, so an
    interrupt can follow a complete commit: messages must not say nothing was written.
    """
    return _Guard.committed


def remove_live_temps() -> None:
    """Remove every temp file this process is writing (a termination signal arrived)."""
    for tmp in list(_LIVE):
        forget(tmp, quiet=True)


def _swallowed(unraisable: sys.UnraisableHookArgs) -> None:
    """``sys.unraisablehook`` under the guard: an ``Interrupted`` that Python dropped is sent again, not printed.

    Python runs a signal handler between any two bytecodes of the main thread, also
    where an exception is printed as "Exception ignored" and dropped (a ``__del__``, a
    weakref or garbage-collector callback): the write would go on. ``_on_signal``
    avoids the gc callbacks it can see; this catches the rest.
    """
    exc = unraisable.exc_value
    if isinstance(exc, Interrupted) and _Guard.depth:
        _Guard.raised = False
        _send_later(exc.signum)
        return
    _Guard.hook(unraisable)


def _send_later(signum: int) -> None:
    """Send ``signum`` to this process again in a few milliseconds, from a helper thread."""
    timer = threading.Timer(0.005, _send_again, (signum,))
    timer.daemon = True
    timer.start()


def _send_again(signum: int) -> None:
    if _Guard.depth:  # the guard may have ended meanwhile: it delivers the pending signal itself
        os.kill(os.getpid(), signum)


def _where_dropped(frame: FrameType | None) -> bool:
    """Whether an exception raised at ``frame`` would be dropped: inside a gc callback (jax has one) or our hook."""
    codes = {_swallowed.__code__}
    for cb in gc.callbacks:
        code = getattr(getattr(cb, "__func__", cb), "__code__", None)
        if code is not None:
            codes.add(code)
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if _Guard.pending is None:
        _Guard.pending = signum
    if _Guard.defer or _Guard.raised:
        return  # committing, or already unwinding: the guard delivers it again at the end
    if _where_dropped(frame):
        _send_later(signum)  # raised here it would be printed and dropped: again, once out of there
        return
    _Guard.raised = True
    remove_live_temps()
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
            _Guard.hook, sys.unraisablehook = sys.unraisablehook, _swallowed
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
            with signals_deferred():  # a signal now must not cut the restores short
                for s, previous in _Guard.previous.items():
                    signal.signal(s, previous)
                if sys.unraisablehook is _swallowed:
                    sys.unraisablehook = _Guard.hook
            pending = _Guard.pending
            _Guard.pending, _Guard.raised, _Guard.previous = None, False, {}
            if pending is not None:
                remove_live_temps()
                signal.raise_signal(pending)


_NOT_ENDING = contextlib.nullcontext(False)  # reusable: most module runs are outside the guard


def signals_guarded() -> bool:
    """Whether ``cleanup_on_signals`` guards this process now (outside it ``signals_end_process`` does nothing)."""
    return _Guard.depth != 0


def signals_end_process() -> ContextManager[bool]:
    """While XLA runs a module: SIGINT, SIGTERM and SIGHUP end the process at once (gives whether they do).

    Python runs signal handlers only between bytecodes, and a module can run in C++
    for ever (a forged never-ending loop): ``cleanup_on_signals``'s handler would
    wait for it. So, under that guard and while this process has no temp file to
    remove, the default actions come back for the duration: the process ends, and
    there is no output to tidy. Signals the user set to be ignored stay ignored.
    Outside the guard (every call from Python code) it costs a few attribute reads.
    """
    if (
        _Guard.depth == 0
        or threading.current_thread() is not threading.main_thread()
        or _LIVE
        or _Guard.defer
        or _Guard.pending is not None
    ):
        return _NOT_ENDING
    return _default_actions()


@contextlib.contextmanager
def _default_actions() -> Iterator[bool]:
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
    from ..terminal import printable

    def expire() -> None:
        remove_live_temps()
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
def signals_deferred() -> Iterator[None]:
    """Inside, a termination signal is only recorded, so a commit of several renames is not cut short."""
    _Guard.defer += 1
    try:
        yield
    finally:
        _Guard.defer -= 1


def forget(tmp: str, quiet: bool = False) -> None:
    """Remove a temp file and every record of it; ``quiet`` ignores any OS error (the signal path)."""
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    except OSError:
        if not quiet:
            raise
    _LIVE.discard(tmp)
    _STAGED.discard(os.path.abspath(tmp))
    _DURABLE.discard(os.path.abspath(tmp))


def register_live(tmp: str) -> None:
    """Note a temp file this process is about to create: a termination signal removes it."""
    _LIVE.add(tmp)


def discard_live(tmp: str) -> None:
    """The temp file is renamed or removed: no longer this process's to clean up."""
    _LIVE.discard(tmp)


def live_temps() -> frozenset[str]:
    """The temp files this process is writing now (for tests and diagnostics)."""
    return frozenset(_LIVE)


def staged_temps() -> frozenset[str]:
    """The temp files ``StagedOutputs`` has handed to writers and not yet renamed or removed."""
    return frozenset(_STAGED)


def stage(tmp: str, durable: bool | None = None) -> None:
    """Record a temp file as staged (``durable=None``), or as flushed to disk (``durable=True``)."""
    if durable:
        _DURABLE.add(os.path.abspath(tmp))
    else:
        _STAGED.add(os.path.abspath(tmp))


def is_staged(path: str) -> bool:
    """Whether ``path`` is a temp file ``StagedOutputs`` handed out (writers fill it in place)."""
    return os.path.abspath(path) in _STAGED


def is_durable(tmp: str) -> bool:
    """Whether a staged temp file was flushed to disk by its writer."""
    return os.path.abspath(tmp) in _DURABLE


def unstage(tmp: str) -> None:
    """A staged temp file was renamed into place: forget its records, keep the file."""
    _STAGED.discard(os.path.abspath(tmp))
    _DURABLE.discard(os.path.abspath(tmp))


def mark_committed() -> None:
    """Outputs were committed under the current guard (an interrupt now must not say nothing was written)."""
    _Guard.committed = True
