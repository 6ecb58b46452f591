"""Plans a step runs: the checks user plans pass, and ``resolve``, which every runner asks for its step's plans.

Plans are one list of ``Op`` per worker (rank), from a built-in schedule or from
the caller (``read_schedule``, or built by hand). ``check_plans`` holds user
plans to the stages given and plays them (``play.sweep``) to refuse a deadlock
before anything runs.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from ...errors import VjpsplitError
from .builtins import schedule as schedule_ops
from .catalog import Schedule, check_schedule
from .layout import Layout
from .ops import Kind, Op, action_name, check_backwards
from .play import sweep


def check_plans(plans: Sequence[Sequence[Op]], num_stages: int, microbatches: int) -> list[tuple[int, ...]]:
    """Check user plans against the stages given; return their layout (the stages each rank holds).

    Every stage's F of every microbatch exactly once and its backward once: a whole
    B, or an I (input part) and its W (weight part), never B and W together (the
    reading of a B before ``Kind.I`` existed: the error says to write I); each stage
    on one rank, and no deadlock: the plans are played. Each failure is one error
    naming the rank and the action.

    Args:
        plans: One sequence of ``Op`` per rank (worker), in the order it runs them.
        num_stages: The pipeline's stage count.
        microbatches: The microbatches per step.

    Returns:
        The layout: per rank, the sorted stage indices it holds.

    Raises:
        VjpsplitError: If an entry is not an ``Op``, an action is outside the stages
            or microbatches, runs a stage another rank holds, appears twice or is
            missing, a backward is not one B nor an I with its W, or the plans deadlock.
    """
    S, M = num_stages, microbatches
    where: dict[int, int] = {}
    seen: set[tuple] = set()
    check_backwards(plans)  # first: a B and an I of one microbatch share a key, "twice" would misname them
    for r, ops in enumerate(plans):
        for o in ops:
            if not isinstance(o, Op):
                raise VjpsplitError(f"rank {r}: {o!r} is not an Op('F'|'B'|'I'|'W', microbatch, stage)")
            name = action_name(o)
            if not (0 <= o.stage < S and 0 <= o.mb < M):
                raise VjpsplitError(f"rank {r}: action {name} is outside the {S} stages and {M} microbatches given")
            if where.setdefault(o.stage, r) != r:
                raise VjpsplitError(
                    f"rank {r}: action {name} runs stage {o.stage}, which rank {where[o.stage]} holds; "
                    "a stage lives on one rank"
                )
            if o.key in seen:
                raise VjpsplitError(f"rank {r}: action {name} appears twice")
            seen.add(o.key)
    for s in range(S):
        for mb in range(M):
            for kind in (Kind.F, Kind.B):  # an I is keyed as its B (``ops.OpKey``)
                if (kind, mb, s) not in seen:
                    owner = f"rank {where[s]}" if s in where else "no rank"
                    raise VjpsplitError(f"{owner}: action {s}{kind}{mb} is missing (stage {s}, microbatch {mb})")
    for _ in sweep(plans, S):  # raises where the plans deadlock
        pass
    return Layout.of_plans(plans).as_lists()


class Resolved(NamedTuple):
    """One step's schedule: its name (``"custom"`` for plans), the checked plans and the layout they run on."""

    name: str
    plans: list[list[Op]]
    layout: Layout


def resolve(schedule: Schedule, num_stages: int, microbatches: int) -> Resolved:
    """The name, checked plans and layout of one step: the named schedule's, or its plans after ``check_plans``.

    Plans are named ``"custom"``.

    Raises:
        VjpsplitError: ``"auto"`` (the Trainer plans it over the steps it measures); what ``check_schedule`` and
            ``check_plans`` refuse.
    """
    _refuse_auto(schedule)
    if schedule.plans is None:
        name = schedule.label
        check_schedule(name, num_stages, microbatches)
        return Resolved(name, schedule_ops(name, num_stages, microbatches), Layout.of_schedule(name, num_stages))
    checked = [list(ops) for ops in schedule.plans]
    return Resolved("custom", checked, Layout(tuple(check_plans(checked, num_stages, microbatches))))


def layout_for(schedule: Schedule, num_stages: int) -> Layout:
    """The layout a step needs: the named schedule's, or the one its plans imply."""
    _refuse_auto(schedule)
    if schedule.plans is None:
        return Layout.of_schedule(schedule.label, num_stages)
    return Layout.of_plans(schedule.plans)


def _refuse_auto(schedule: Schedule) -> None:
    """Refuse ``"auto"`` for one step: the Trainer plans it over the steps it measures."""
    if schedule.auto:
        raise VjpsplitError(
            "Schedule('auto') plans from the steps a Trainer measures; for one step, pass "
            "schedule=Schedule(plans=auto_schedule(stages, microbatches, costs=...))"
        )
