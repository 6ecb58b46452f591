"""Schedules as data: torch.distributed.pipelining's compute-only CSV, and the checks plans pass before a run.

A CSV schedule has no header and one row per rank; each cell is one action
written stage-kind-microbatch (``0F3``: stage 0's forward of microbatch 3; ``1I2``
the input part of a backward, ``1W2`` its weight part, ``2B0`` a whole backward),
``(0F7;7B3)OVERLAP_F_B`` two actions torch runs overlapped, and an empty cell an
idle step (the runners here are driven by data, so idle steps are dropped).
vjpsplit's ``Op("B")`` is torch's ``I`` when the same stage and microbatch has a
``W`` in the plans, else its ``B``. ``resolve`` turns a schedule name or user
plans into checked plans, for every runner.
"""

from __future__ import annotations

import os
import re
from typing import Sequence

from ...errors import VjpsplitError
from .builtins import LABELS, Op, check_schedule, dependencies, layout, placement, schedule

_ACTION = re.compile(r"(\d+)([FIBW])(\d+)")
_OVERLAP = re.compile(r"\((.*);(.*)\)OVERLAP_F_B")


def split_ops(plans: Sequence[Sequence[Op]]) -> set[tuple[int, int]]:
    """The ``(stage, microbatch)`` pairs whose backward is split: their B is the input part, a W follows."""
    return {(o.chunk, o.mb) for ops in plans for o in ops if o.kind == "W"}


def _text(op: Op, split: set) -> str:
    kind = "I" if op.kind == "B" and (op.chunk, op.mb) in split else op.kind
    return f"{op.chunk}{kind}{op.mb}"


def write_schedule(path, plans: Sequence[Sequence[Op]]) -> None:
    """Write ``plans`` (one list of operations per rank) as torch's compute-only CSV schedule."""
    split = split_ops(plans)
    lines = []
    for r, ops in enumerate(plans):
        cells, i = [], 0
        while i < len(ops):
            op = ops[i]
            if op.overlap:
                if i + 1 == len(ops):
                    raise VjpsplitError(f"rank {r}: action {_text(op, split)} overlaps with nothing: it ends the list")
                cells.append(f"({_text(op, split)};{_text(ops[i + 1], split)})OVERLAP_F_B")
                i += 2
            else:
                cells.append(_text(op, split))
                i += 1
        lines.append(",".join(cells) + "\n")
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.write("".join(lines))
    os.replace(tmp, path)


def _parse(cell: str, r: int, col: int) -> list[Op]:
    m = _OVERLAP.fullmatch(cell)
    if m:
        first, second = (_parse(part.strip(), r, col) for part in m.groups())
        if len(first) != 1 or len(second) != 1:
            raise VjpsplitError(f"rank {r}, step {col}: {cell!r} must overlap exactly two actions")
        return [Op(first[0].kind, first[0].mb, first[0].chunk, True), second[0]]
    m = _ACTION.fullmatch(cell)
    if not m:
        raise VjpsplitError(
            f"rank {r}, step {col}: {cell!r} is not a compute action; write stage, F/I/B/W and microbatch, "
            "as 0F3 (communication actions are not part of a compute-only schedule)"
        )
    stage, kind, mb = int(m.group(1)), m.group(2), int(m.group(3))
    return [Op("B" if kind == "I" else kind, mb, stage)]


def read_schedule(path) -> list[list[Op]]:
    """The plans in a compute-only CSV schedule (torch's format): one list of operations per rank.

    Checks each action's syntax and that a stage's I has its W and its B none;
    ``resolve`` (every runner) checks the rest against the stages given.
    """
    try:
        with open(path, encoding="utf-8", newline="") as f:
            rows = [line.rstrip("\r\n") for line in f]
    except OSError as e:
        raise VjpsplitError(f"cannot read schedule {os.fspath(path)!r}: {e.strerror or e}") from e
    while rows and not rows[-1].strip():
        rows.pop()
    plans: list[list[Op]] = []
    kinds: dict[tuple[int, int], tuple[int, str]] = {}  # (stage, mb) -> (rank, "I" or "B")
    for r, row in enumerate(rows):
        ops: list[Op] = []
        for col, cell in enumerate(_cells(row)):
            cell = cell.strip()
            if not cell:
                continue
            for a in _ACTION.finditer(cell):
                if a.group(2) in "IB":
                    kinds[(int(a.group(1)), int(a.group(3)))] = (r, a.group(2))
            ops += _parse(cell, r, col)
        plans.append(ops)
    split = split_ops(plans)
    for (stage, mb), (r, kind) in kinds.items():
        if kind == "I" and (stage, mb) not in split:
            raise VjpsplitError(f"rank {r}: action {stage}I{mb} has no {stage}W{mb}; add it, or write {stage}B{mb}")
        if kind == "B" and (stage, mb) in split:
            raise VjpsplitError(f"rank {r}: action {stage}B{mb} is a whole backward, yet {stage}W{mb} follows; use I")
    return plans


def _cells(row: str) -> list[str]:
    """A row's cells: commas split, except inside an overlapped pair's parentheses."""
    cells: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in row:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            cells.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    return cells + ["".join(cur)]


def check_plans(plans: Sequence[Sequence[Op]], stages: int, microbatches: int) -> list[tuple[int, ...]]:
    """Check user plans against the stages given; return the placement (the stages each rank holds).

    Every stage's F and B of every microbatch exactly once (W at most once, after
    its B's split), each stage on one rank, and no deadlock: the plans are played
    first. Each failure is one error naming the rank and the action.
    """
    S, M = stages, microbatches
    where: dict[int, int] = {}
    seen: set[tuple] = set()
    split = split_ops(plans)
    for r, ops in enumerate(plans):
        for o in ops:
            if not isinstance(o, Op) or o.kind not in ("F", "B", "W"):
                raise VjpsplitError(f"rank {r}: {o!r} is not an Op('F'|'B'|'W', microbatch, stage)")
            name = _text(o, split)
            if not (0 <= o.chunk < S and 0 <= o.mb < M):
                raise VjpsplitError(f"rank {r}: action {name} is outside the {S} stages and {M} microbatches given")
            if where.setdefault(o.chunk, r) != r:
                raise VjpsplitError(
                    f"rank {r}: action {name} runs stage {o.chunk}, which rank {where[o.chunk]} holds; "
                    "a stage lives on one rank"
                )
            key = (o.kind, o.mb, o.chunk)
            if key in seen:
                raise VjpsplitError(f"rank {r}: action {name} appears twice")
            seen.add(key)
    for s in range(S):
        for mb in range(M):
            for kind in "FB":
                if (kind, mb, s) not in seen:
                    owner = f"rank {where[s]}" if s in where else "no rank"
                    raise VjpsplitError(f"{owner}: action {s}{kind}{mb} is missing (stage {s}, microbatch {mb})")
    _check_deadlock(plans, S)
    return [tuple(sorted({o.chunk for o in ops})) for ops in plans]


def _check_deadlock(plans: Sequence[Sequence[Op]], S: int) -> None:
    """Play the lists in order; a rank stuck on an operation whose inputs never come is an error naming it."""
    done: set[tuple] = set()
    idx = [0] * len(plans)
    moved = True
    while moved:
        moved = False
        for r, ops in enumerate(plans):
            while idx[r] < len(ops):
                o = ops[idx[r]]
                if any(d not in done for d in dependencies(o, S, True)):
                    break
                done.add((o.kind, o.mb, o.chunk))
                idx[r] += 1
                moved = True
    split = split_ops(plans)
    stuck = []
    for r, ops in enumerate(plans):
        if idx[r] < len(ops):
            o = ops[idx[r]]
            need = Op(*next(d for d in dependencies(o, S, True) if d not in done))
            own = any((x.kind, x.mb, x.chunk) == (need.kind, need.mb, need.chunk) for x in ops)
            stuck.append((not own, r, o, need))  # a rank waiting on its own later action is the cause
    if stuck:
        _, r, o, need = min(stuck, key=lambda t: (t[0], t[1]))
        raise VjpsplitError(
            f"the schedule deadlocks: rank {r}'s action {_text(o, split)} waits for "
            f"{_text(need, split)}, which never runs before it; reorder the plans"
        )


def resolve(
    schedule_name: str, plans: Sequence[Sequence[Op]] | None, stages: int, microbatches: int
) -> tuple[str, list[list[Op]], list[tuple[int, ...]]]:
    """The name, checked plans and placement of one step: the named schedule's, or ``plans`` after ``check_plans``.

    ``plans`` (``schedule=`` of the runners) wins over ``schedule_name``; its name is ``"custom"``.
    """
    if plans is None:
        check_schedule(schedule_name, stages, microbatches)
        return schedule_name, schedule(schedule_name, stages, microbatches), placement(schedule_name, stages)
    checked = [list(ops) for ops in plans]
    return "custom", checked, check_plans(checked, stages, microbatches)


def describe(name: str) -> str:
    """A schedule's label for titles and messages."""
    return LABELS.get(name, name)


def layout_placement(layout, stages: int) -> list[tuple[int, ...]]:
    """The stages each worker holds under a runner's ``layout``.

    ``"stage"`` (one each), ``"v"`` (ZB-V's and DualPipeV's V), ``"interleaved"``
    (``CHUNKS`` per worker, round robin), or the placement itself: one sequence of
    stage indices per worker, each stage on exactly one (as ``resolve`` returns for plans).
    """
    names = {"stage": "1f1b", "v": "zbv", "interleaved": "interleaved1f1b"}
    if isinstance(layout, str):
        if layout not in names:
            raise VjpsplitError(
                f"unknown layout {layout!r}; use stage, v, interleaved or one list of stages per worker"
            )
        return placement(names[layout], stages)
    out = [tuple(int(s) for s in chunks) for chunks in layout]
    if sorted(s for chunks in out for s in chunks) != list(range(stages)) or not all(out):
        raise VjpsplitError(
            f"layout {out} must put each of the {stages} stages on exactly one worker, and give every worker one"
        )
    return out


def layout_of(schedule_name: str, plans: Sequence[Sequence[Op]] | None, stages: int):
    """The ``RayPipeline`` layout a step needs: the named schedule's, or the placement ``plans`` imply."""
    if plans is None:
        return layout(schedule_name)
    return [tuple(sorted({o.chunk for o in ops})) for ops in plans]
