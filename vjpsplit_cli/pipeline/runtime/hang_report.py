"""What every worker is doing now and did last: the ring of recent operations, and a stuck step's report.

Each ``StageWorker`` keeps its last ``RING`` operations (kind, microbatch, start,
end on this process's ``time.monotonic``; an untimed step's end is when its dispatch
returned, which the report does not pass off as the operation's end) in a bounded ring, timed step or not
(a ``deque`` append per operation: measured in ``benchmarks/train.py --ring``).
A timed step's worker thread (or Ray actor) also says what it is doing in one
``Now`` tuple: waiting for its next operation, waiting for the value another
stage sends it, running an operation, finishing its stages (the reductions and
the optimizer update), or done. An untimed step's ``Now`` is read off what its
driver dispatched (``untimed.Dispatched``; on Ray, what each actor's list did): the
operation whose dispatch has not returned, else each worker's first dispatched
operation whose outputs are not ready (``jax.Array.is_ready``). A worker whose thread is inside JAX's compiler as the
step stops is said to be compiling (``compile_aware``: its first call for these inputs;
a first step's timeout is often that). When a step passes ``step_timeout`` or is
interrupted, ``hang_message`` turns each worker's ``Now`` into one clause
(``worker 1: B stage 1 mb 3 waits for the cotangent from stage 2 (worker 2 has
not sent it)``) and ``write_hang_report`` writes every worker's ring as JSON (each operation a ``RingRow``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import BinaryIO, Mapping, Sequence, TypedDict

from ...errors import VjpsplitError
from ...safeio.outputs import atomic_write
from ..schedules.ops import Kind, Op, OpKey

RING = 256  # operations each stage worker keeps: several steps of a tiny pipeline, a bounded few KiB

# One operation of a stage worker's ring: kind, microbatch, start, end (time.monotonic), and whether it was waited
# for (a timed step's); an untimed step's operation is not: its "end" is when its dispatch returned.
RingOp = tuple[str, int, float, float, bool]

# What a worker does now, as its thread (or actor) last set it: (state, op or None, the value's source or
# None, since when on time.monotonic). States: NEXT (its next operation is not handed to it yet), WAITS
# (for a value another stage sends), RUNS, FINISH (its stages' reductions and update), DONE.
NEXT, WAITS, RUNS, FINISH, DONE = "next", "waits", "runs", "finish", "done"
# An untimed step's workers, read off what the driver dispatched: DISPATCHING (the driver's thread is inside
# this operation's dispatch: on CPU a host callback runs there), PENDING (dispatched, its outputs not ready;
# with a source: the value it reads is not ready either), FINISHED (every operation of its list finished).
DISPATCHING, PENDING, FINISHED = "dispatching", "pending", "finished"
# RUNS or DISPATCHING, its thread inside JAX's compiler (``compile_aware``).
COMPILING = "compiling"
# A step run as one compiled program (``program.StepProgram``): every worker's operations are in that one call, not
# finished (its op: the worker's first one of the step).
PROGRAM = "program"
Now = tuple[str, "Op | OpKey | None", "OpKey | None", float]
_COMPILER = os.path.join("jax", "_src", "compiler.py")  # where JAX hands a program to XLA to compile


class StepInterrupted(VjpsplitError, KeyboardInterrupt):
    """A step stopped by Ctrl-C: one line naming what each worker was doing (also a ``KeyboardInterrupt``,
    so code that stops on Ctrl-C still does)."""


def idle() -> Now:
    """The ``Now`` of a worker before its first operation of a step."""
    return (NEXT, None, None, time.monotonic())


def compiling(thread: int | None) -> bool:
    """Whether the thread ``thread`` (its ``threading.get_ident()``) is inside JAX's compiler now: its Python
    stack passes through ``jax/_src/compiler.py``, where a call is compiled the first time it runs for its
    inputs' shapes. Read off the thread's stack as it stands (``sys._current_frames``): nothing is noted per call."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    while frame is not None:
        if frame.f_code.co_filename.endswith(_COMPILER):
            return True
        frame = frame.f_back
    return False


def compile_aware(now: Now, thread: int | None) -> Now:
    """``now``, made COMPILING where it runs (or dispatches) an operation and ``thread`` (the worker's) is inside
    JAX's compiler (``compiling``)."""
    state, op, src, since = now
    if state in (RUNS, DISPATCHING) and op is not None and compiling(thread):
        return (COMPILING, op, src, since)
    return now


def what(kind: str) -> str:
    """The value an operation of ``kind`` waits for from another stage."""
    return "the activation" if kind == Kind.F else "the cotangent"


def _op(op: Op | OpKey) -> str:
    return f"{op.kind} stage {op.stage} mb {op.mb}"


def clause(
    worker: int,
    now: Now,
    t0: float,
    worker_of: Mapping[int, int],
    sent: Mapping[OpKey, float] | None = None,
    after: int = 0,
) -> str:
    """Worker ``worker``'s ``now`` in words, times in ms since ``t0`` (the step's start).

    ``sent``: when each value was sent (Ray: a value can be sent and not yet received); without it a value
    waited for is one its sender has not sent. ``after``: how many of its operations were dispatched after
    a PENDING one and have not finished either (they wait behind it).
    """
    state, op, src, since = now
    at = f"{(since - t0) * 1e3:.1f} ms"
    if state == COMPILING and op is not None:
        return (
            f"worker {worker}: compiling {_op(op)} since {at} (its first call for these inputs: XLA compiles "
            "it before it runs; a first step may need a longer step_timeout)"
        )
    if state == DISPATCHING and op is not None:
        return f"worker {worker}: running {_op(op)} since {at} (in its dispatch, which has not returned)"
    if state == PROGRAM and op is not None:
        return (
            f"worker {worker}: in the step's program since {at} (its operations from {_op(op)} on, with every "
            "other stage's, in one compiled call on one device; not finished)"
        )
    if state == PENDING and op is not None:
        more = f"; {after} dispatched after it wait" if after else ""
        if src is not None:
            by = worker_of.get(src.stage, src.stage)
            return (
                f"worker {worker}: {_op(op)} waits for {what(op.kind)} from stage {src.stage} "
                f"(worker {by} has not finished it; dispatched at {at}{more})"
            )
        return f"worker {worker}: running or waiting: {_op(op)} (dispatched at {at}, not finished{more})"
    if state == FINISHED:
        return f"worker {worker}: all its operations finished"
    if state == RUNS and op is not None:
        return f"worker {worker}: running {_op(op)} since {at}"
    if state == WAITS and op is not None and src is not None:
        by = worker_of.get(src.stage, src.stage)
        if sent is not None and src in sent:
            how = f"sent by worker {by} at {(sent[src] - t0) * 1e3:.1f} ms, never received"
        else:
            how = f"worker {by} has not sent it"
        return f"worker {worker}: {_op(op)} waits for {what(op.kind)} from stage {src.stage} ({how}) since {at}"
    if state == FINISH:
        return f"worker {worker}: in its stages' reductions and optimizer update (waits for the other workers there) since {at}"
    if state == DONE:
        return f"worker {worker}: done at {at}"
    nxt = f" ({_op(op)})" if op is not None else ""
    return f"worker {worker}: waits to be handed its next operation{nxt} since {at}"


def hang_message(
    reason: str,
    nows: Sequence[Now],
    t0: float,
    worker_of: Mapping[int, int],
    path: str | None,
    hint: str = "",
    sent: Mapping[OpKey, float] | None = None,
    after: Sequence[int] | None = None,
) -> str:
    """One line: ``reason``, every worker's clause, where the last operations were written, then ``hint``
    (``after``: per worker, ``clause``'s)."""
    parts = [clause(w, now, t0, worker_of, sent, after[w] if after else 0) for w, now in enumerate(nows)]
    where = f"; the last operations of every worker: {path}" if path else ""
    return f"{reason}; " + "; ".join(parts) + where + hint


class RingRow(TypedDict):
    """One operation of a stage worker's ring, as a hang report's JSON row (times in ms since the step began).

    ``end_ms``: when it ended, for an operation waited for (a timed step's); None for an untimed step's, whose
    end nobody waited for. ``dispatched_ms``: when an untimed operation's dispatch returned (None when timed).
    """

    kind: str
    stage: int
    mb: int
    start_ms: float
    end_ms: float | None
    dispatched_ms: float | None


def ring_rows(ring: Sequence[RingOp], stage: int, t0: float) -> list[RingRow]:
    """A stage worker's ring as JSON rows, times in ms since ``t0``."""
    return [
        {
            "kind": str(k),
            "stage": stage,
            "mb": int(mb),
            "start_ms": (s - t0) * 1e3,
            "end_ms": (e - t0) * 1e3 if waited else None,
            "dispatched_ms": None if waited else (e - t0) * 1e3,
        }
        for k, mb, s, e, waited in ring
    ]


def default_path() -> str:
    """Where a hang's report goes when neither ``hang_report`` nor a checkpoint directory names a place."""
    return os.path.join(tempfile.gettempdir(), f"vjpsplit-hang-{os.getpid()}.json")


def write_hang_report(
    path: str | os.PathLike[str],
    message: str,
    workers: Sequence[Mapping[str, object]],
) -> str | None:
    """Write ``{"message", "workers": [...]}`` to ``path`` (whole or not at all); the path written, or None
    when it could not be written (the step's error says so rather than hiding what hung behind a write error).

    Each worker's dict: ``worker``, ``now`` (its clause) and ``ops`` (``ring_rows``, oldest first).
    """
    body = json.dumps({"message": message, "workers": list(workers)}, indent=1).encode()

    def write(f: BinaryIO) -> None:
        f.write(body)

    try:
        atomic_write(path, write)
    except (OSError, VjpsplitError):
        return None
    return os.fspath(path)
