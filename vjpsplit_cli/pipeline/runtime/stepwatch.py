"""How a step is watched, timed or not: its timeout, Ctrl-C and, once stopped, the one-line report.

Owns ``Watch`` (a step's ``step_timeout``, where a stuck step's report goes, what to append
to its error; filled in with the driver's phases and the workers left behind), ``GRACE``
(how long a stopped step's workers get to drain) and the report itself (``stop_report``:
every worker's clause, its last operations written with ``hang_report.write_hang_report``).
``timed`` and ``untimed`` build on it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Sequence, TypeAlias

from ..schedules.ops import Op
from ..schedules.timeline import Phase
from .hang_report import Now, RingOp, clause, default_path, hang_message, ring_rows, write_hang_report

if TYPE_CHECKING:
    from .stageops import RunsOps

# A stage worker's last operations (kind, mb, start, end), oldest first.
Ring: TypeAlias = "list[RingOp]"

GRACE = 1.0  # seconds the workers get to drain a stopped step before their threads are left behind


@dataclasses.dataclass
class Watch:
    """How a timed step is watched: ``step_timeout`` (None: no limit), where a stuck step's report goes
    (``report_path``; None: ``hang_report.default_path``), ``hint`` (what to do when a thread stays stuck, appended to
    the error), ``on_stop``
    (releases waits outside the operations, e.g. a barrier). Filled in: ``phases`` (the driver's) and
    ``stuck`` (after a stop, the workers whose threads were left behind, each in words), ``applied`` (an
    untimed step stopped once its updates had begun)."""

    step_timeout: float | None = None
    report_path: str | None = None
    hint: str = ""
    on_stop: Callable[[], None] | None = None
    phases: list[Phase] = dataclasses.field(default_factory=list)
    stuck: list[str] = dataclasses.field(default_factory=list)
    applied: bool = False  # an untimed step stopped after its first update began: its stages may be half-updated


def worker_rings(plans: Sequence[Sequence[Op]], workers: Sequence[RunsOps]) -> list[list[tuple[int, Ring]]]:
    """Per worker, each of its stages' ring as it is now (stage, operations)."""
    return [[(s, list(workers[s].ring)) for s in sorted({o.stage for o in ops})] for ops in plans]


def stop_report(
    reason: str,
    nows: Sequence[Now],
    rings: Sequence[Sequence[tuple[int, Ring]]],
    t0: float,
    worker_of: dict[int, int],
    watch: Watch,
    left: str,
    after: Sequence[int] | None = None,
) -> str:
    """A stopped step's one-line error, timed or not: every worker's clause, its last operations written to
    ``watch.report_path`` (``hang_report.write_hang_report``; the line says so, or that it could not be written)."""
    rows = []
    for w, held in enumerate(rings):
        ops = sorted((r for s, ring in held for r in ring_rows(ring, s, t0)), key=lambda r: r["start_ms"])
        now = clause(w, nows[w], t0, worker_of, None, after[w] if after else 0)
        rows.append({"worker": w, "now": now, "ops": ops})
    path = watch.report_path or default_path()
    message = hang_message(reason, nows, t0, worker_of, path, left, after=after)
    if write_hang_report(path, message, rows) is None:
        message = hang_message(reason, nows, t0, worker_of, None, f" (could not write {path}){left}", after=after)
    return message
