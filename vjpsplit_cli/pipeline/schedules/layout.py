"""Layouts: which worker runs which stages (the one word for it; "ownership" is which stage holds which leaf).

A ``Layout`` is, per worker, the stage indices it holds, each stage on exactly
one worker. The built-in schedules need one of three: one stage per worker
(``"stage"``), ZB-V's and DualPipeV's V (``"v"``: worker ``w`` of ``p`` holds
stages ``w`` and ``2p-1-w``), or interleaved 1F1B's round robin
(``"interleaved"``: stage ``s`` on worker ``s mod p``). Plans read from a file
imply their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...errors import VjpsplitError
from .catalog import CHUNKS, V_SHAPED, check_schedule
from .ops import Op

KINDS = {"stage": "1f1b", "v": "zbv", "interleaved": "interleaved1f1b"}  # a layout kind: a schedule using it


def layout_kind(name: str) -> str:
    """How a schedule lays stages on workers: ``"v"``, ``"interleaved"`` or ``"stage"``.

    ``"v"``: two per worker (ZB-V, DualPipeV); ``"interleaved"``: ``CHUNKS`` per
    worker, round robin; ``"stage"``: one each.

    Args:
        name: The schedule, one of ``SCHEDULES``.

    Returns:
        The layout kind's name.

    Raises:
        VjpsplitError: If the schedule is unknown.
    """
    check_schedule(name, 2)
    if name in V_SHAPED:
        return "v"
    return "interleaved" if name == "interleaved1f1b" else "stage"


def worker_stages(name: str, num_stages: int, chunks: int = CHUNKS) -> list[tuple[int, ...]]:
    """The stages each worker holds under schedule ``name``.

    ``(s,)`` each; the V ``(w, 2p-1-w)`` for ZB-V and DualPipeV; ``(w, w+p, ...)``
    (``chunks`` of them) for interleaved 1F1B.

    Args:
        name: The schedule, one of ``SCHEDULES``.
        num_stages: The pipeline's stage count.
        chunks: Interleaved 1F1B's stages per worker (by default 2).

    Returns:
        One tuple of stage indices per worker.

    Raises:
        VjpsplitError: If the schedule is unknown or cannot run ``num_stages`` stages
            (an odd count for a V, not a multiple of ``chunks`` for interleaved 1F1B).
    """
    check_schedule(name, num_stages, chunks=chunks)
    if name in V_SHAPED:
        p = num_stages // 2
        return [(w, 2 * p - 1 - w) for w in range(p)]
    if name == "interleaved1f1b":
        p = num_stages // chunks
        return [tuple(range(w, num_stages, p)) for w in range(p)]
    return [(s,) for s in range(num_stages)]


@dataclass(frozen=True)
class Layout:
    """Which worker runs which stages: ``workers[w]`` is the stage indices worker ``w`` holds."""

    workers: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, spec: str | Sequence[Sequence[int]], num_stages: int) -> Layout:
        """A layout kind (``"stage"``, ``"v"``, ``"interleaved"``) or one sequence of stages per worker, checked."""
        if isinstance(spec, str):
            if spec not in KINDS:
                raise VjpsplitError(
                    f"unknown layout {spec!r}; use stage, v, interleaved or one list of stages per worker"
                )
            return cls.of_schedule(KINDS[spec], num_stages)
        workers = tuple(tuple(int(s) for s in stages) for stages in spec)
        if sorted(s for stages in workers for s in stages) != list(range(num_stages)) or not all(workers):
            raise VjpsplitError(
                f"layout {list(workers)} must put each of the {num_stages} stages on exactly one worker, "
                "and give every worker one"
            )
        return cls(workers)

    @classmethod
    def of_schedule(cls, name: str, num_stages: int, chunks: int = CHUNKS) -> Layout:
        """The layout the built-in schedule ``name`` runs on."""
        return cls(tuple(worker_stages(name, num_stages, chunks)))

    @classmethod
    def of_plans(cls, plans: Sequence[Sequence[Op]]) -> Layout:
        """The layout plans imply: each worker holds the stages its operations run."""
        return cls(tuple(tuple(sorted({o.stage for o in ops})) for ops in plans))

    @property
    def num_workers(self) -> int:
        """How many workers the layout has."""
        return len(self.workers)

    def worker_of(self) -> dict[int, int]:
        """``{stage: the worker holding it}``."""
        return {s: w for w, stages in enumerate(self.workers) for s in stages}

    def label(self, worker: int) -> str:
        """Worker ``worker`` in messages: ``stage 2``, or ``stages 1 and 6 (worker 1)``."""
        stages = self.workers[worker]
        if len(stages) == 1:
            return f"stage {stages[0]}"
        return f"stages {' and '.join(map(str, stages))} (worker {worker})"

    def as_lists(self) -> list[tuple[int, ...]]:
        """The per-worker stage tuples as a list (what ``check_plans`` and ``worker_stages`` return)."""
        return list(self.workers)
