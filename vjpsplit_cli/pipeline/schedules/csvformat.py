"""Schedules as data: torch.distributed.pipelining's compute-only CSV schedule format.

A CSV schedule has no header and one row per rank; each cell is one action
written stage-kind-microbatch (``0F3``: stage 0's forward of microbatch 3; ``1I2``
the input part of a backward, ``1W2`` its weight part, ``2B0`` a whole backward),
``(0F7;7B3)OVERLAP_F_B`` two actions torch runs overlapped, and an empty cell an
idle step (the runners here are driven by data, so idle steps are dropped).
Each letter is the ``Kind`` of the same name (``ops.Kind``), read and written as is.

Plans that offload residuals (``offloading.OffloadPlans``, what ``auto_schedule``
returns under ``memory_limit_bytes``) get one more, last line, a comment naming the
(stage, microbatch) pairs: ``# offload: 0:0 0:1 1:0``. Plans without offload are
written byte for byte as before, which torch's reader reads; torch's reader does
not skip comments, so for it drop that line (``grep -v '^#'``): it changes no action.
"""

from __future__ import annotations

import io
import os
import re
from typing import BinaryIO, Sequence

from ...errors import VjpsplitError
from ...safeio.outputs import atomic_write
from .offloading import OffloadPlans
from .ops import Kind, Op, action_name, check_backwards

_ACTION = re.compile(r"(\d+)([FIBW])(\d+)")
_OVERLAP = re.compile(r"\((.*);(.*)\)OVERLAP_F_B")
OFFLOAD_MARK = "# offload:"  # the comment line naming the offloaded (stage, microbatch) pairs
_PAIR = re.compile(r"(\d+):(\d+)")


def format_schedule(plans: Sequence[Sequence[Op]]) -> str:
    """``plans`` (one list of operations per rank) as the text of torch's compute-only CSV schedule.

    Refuses (``ops.check_backwards``) a backward that is not one B nor an I with its W, which torch's
    reader and ``parse_schedule`` would refuse.
    """
    check_backwards(plans)
    lines = []
    for r, ops in enumerate(plans):
        cells: list[str] = []
        i = 0
        while i < len(ops):
            op = ops[i]
            if op.overlap:
                if i + 1 == len(ops):
                    raise VjpsplitError(f"rank {r}: action {action_name(op)} overlaps with nothing: it ends the list")
                cells.append(f"({action_name(op)};{action_name(ops[i + 1])})OVERLAP_F_B")
                i += 2
            else:
                cells.append(action_name(op))
                i += 1
        lines.append(",".join(cells) + "\n")
    offloaded = sorted(getattr(plans, "offloaded", ()))
    if offloaded:
        lines.append(" ".join([OFFLOAD_MARK, *(f"{s}:{m}" for s, m in offloaded)]) + "\n")
    return "".join(lines)


def write_schedule(path: str | os.PathLike[str], plans: Sequence[Sequence[Op]]) -> None:
    """Write ``plans`` (one list of operations per rank) as torch's compute-only CSV schedule.

    The file is written atomically (temp file, then rename).

    Args:
        path: The CSV file to write.
        plans: One sequence of ``Op`` per rank.

    Raises:
        VjpsplitError: If an overlapped action ends its rank's list (it overlaps with
            nothing), a backward is not one B nor an I with its W, or the file cannot be written.
    """
    data = format_schedule(plans).encode("utf-8")

    def write(f: BinaryIO) -> None:
        f.write(data)

    atomic_write(path, write, size=len(data))


def _parse(cell: str, r: int, col: int) -> list[Op]:
    m = _OVERLAP.fullmatch(cell)
    if m:
        first, second = (_parse(part.strip(), r, col) for part in m.groups())
        if len(first) != 1 or len(second) != 1:
            raise VjpsplitError(f"rank {r}, step {col}: {cell!r} must overlap exactly two actions")
        return [Op(first[0].kind, first[0].mb, first[0].stage, True), second[0]]
    m = _ACTION.fullmatch(cell)
    if not m:
        raise VjpsplitError(
            f"rank {r}, step {col}: {cell!r} is not a compute action; write stage, F/I/B/W and microbatch, "
            "as 0F3 (communication actions are not part of a compute-only schedule)"
        )
    stage, kind, mb = int(m.group(1)), m.group(2), int(m.group(3))
    return [Op(Kind(kind), mb, stage)]


def read_schedule(path: str | os.PathLike[str]) -> list[list[Op]]:
    """The plans in a compute-only CSV schedule (torch's format): one list of operations per rank.

    Checks each action's syntax and that each backward is one B or an I with its W
    (``ops.check_backwards``); ``check_plans`` (every runner, through ``resolve``) checks the rest against the stages given.

    Args:
        path: The CSV file.

    Returns:
        One list of ``Op`` per rank, idle steps dropped.

    Raises:
        VjpsplitError: If the file cannot be read, a cell is not a compute action (or
            an overlap of exactly two), or an ``I`` lacks its ``W``, a ``W`` its ``I``, or a ``B`` has a ``W``.
    """
    try:
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
    except OSError as e:
        raise VjpsplitError(f"cannot read schedule {os.fspath(path)!r}: {e.strerror or e}") from e
    return parse_schedule(text)


def parse_schedule(text: str) -> list[list[Op]]:
    """The plans in the text of a compute-only CSV schedule (what ``read_schedule`` reads from a file)."""
    rows = [line.rstrip("\r\n") for line in io.StringIO(text, newline="")]
    while rows and not rows[-1].strip():
        rows.pop()
    offloaded: list[tuple[int, int]] | None = None
    if rows and rows[-1].startswith(OFFLOAD_MARK):
        marks = rows.pop()[len(OFFLOAD_MARK) :].split()
        offloaded = []
        for mark in marks:
            pair = _PAIR.fullmatch(mark)
            if not pair:
                raise VjpsplitError(
                    f"the offload line: {mark!r} is not a pair; write stage:microbatch, as 0:3, separated by spaces"
                )
            offloaded.append((int(pair.group(1)), int(pair.group(2))))
    plans: list[list[Op]] = []
    for r, row in enumerate(rows):
        ops: list[Op] = []
        for col, cell in enumerate(_cells(row)):
            cell = cell.strip()
            if not cell:
                continue
            ops += _parse(cell, r, col)
        plans.append(ops)
    check_backwards(plans)
    return plans if offloaded is None else OffloadPlans(plans, offloaded)


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
