"""Schedules as data: torch.distributed.pipelining's compute-only CSV schedule format.

A CSV schedule has no header and one row per rank; each cell is one action
written stage-kind-microbatch (``0F3``: stage 0's forward of microbatch 3; ``1I2``
the input part of a backward, ``1W2`` its weight part, ``2B0`` a whole backward),
``(0F7;7B3)OVERLAP_F_B`` two actions torch runs overlapped, and an empty cell an
idle step (the runners here are driven by data, so idle steps are dropped).
Each letter is the ``Kind`` of the same name (``ops.Kind``), read and written as is.

Plans that offload residuals (``offloading.OffloadPlans``, what ``auto_schedule``
returns under ``memory_limit_bytes``) are written as the same CSV, byte for byte
the plans' without offload, so torch's reader gets the same actions: it makes a
rank of every row ``csv.reader`` gives and raises on any cell that is not an action,
so a comment line or an extra cell would break it or change its pipeline order. The
(stage, microbatch) pairs go in a file beside it, the CSV's name with
``.offload.json`` added (``plan.csv.offload.json``), which torch never opens; it
records the CSV's SHA-256, so a CSV changed or replaced since is one error, never
another plan's offload. Writing plans without offload removes that file. A last
comment line ``# offload: 0:0 0:1``, what vjpsplit wrote before, is still read.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from typing import BinaryIO, Sequence

from ...errors import VjpsplitError
from ...safeio.outputs import atomic_write
from ...safeio.reading import os_error_message, read_bytes
from .offloading import OffloadPlans
from .ops import Kind, Op, action_name, check_backwards

_ACTION = re.compile(r"(\d+)([FIBW])(\d+)")
_OVERLAP = re.compile(r"\((.*);(.*)\)OVERLAP_F_B")
OFFLOAD_MARK = "# offload:"  # the comment line older versions wrote naming the offloaded pairs; still read
OFFLOAD_SUFFIX = ".offload.json"  # added to the CSV's name: the file naming the offloaded pairs
_OFFLOAD_FORMAT = "vjpsplit offload"
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
    return "".join(lines)


def offload_path(path: str | os.PathLike[str]) -> str:
    """The file beside the CSV schedule ``path`` that names what its plans offload: ``path`` + ``.offload.json``.

    Args:
        path: The CSV schedule's path.

    Returns:
        ``path`` with ``.offload.json`` added (``plan.csv`` -> ``plan.csv.offload.json``).
    """
    return os.fspath(path) + OFFLOAD_SUFFIX


def write_schedule(path: str | os.PathLike[str], plans: Sequence[Sequence[Op]]) -> None:
    """Write ``plans`` (one list of operations per rank) as torch's compute-only CSV schedule.

    The CSV holds only actions, so torch's reader reads it as it reads the same plans
    without offload. Plans that offload (an ``OffloadPlans`` with pairs) also get
    ``offload_path(path)``, a JSON file naming the (stage, microbatch) pairs and the
    CSV's SHA-256; plans without offload remove that file if one is there (it named
    another plan's). Each file is written atomically (temp file, then rename).

    Args:
        path: The CSV file to write.
        plans: One sequence of ``Op`` per rank.

    Raises:
        VjpsplitError: If an overlapped action ends its rank's list (it overlaps with
            nothing), a backward is not one B nor an I with its W, or a file cannot be
            written or removed.
    """
    data = format_schedule(plans).encode("utf-8")
    offloaded = sorted(getattr(plans, "offloaded", ()))
    _write(path, data)
    side = offload_path(path)
    if offloaded:
        record = {
            "format": _OFFLOAD_FORMAT,
            "version": 1,
            "schedule": os.path.basename(os.fspath(path)),
            "schedule_sha256": hashlib.sha256(data).hexdigest(),
            "offload": [[s, m] for s, m in offloaded],
        }
        _write(side, (json.dumps(record, indent=1) + "\n").encode("utf-8"))
        return
    try:
        os.remove(side)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise VjpsplitError(os_error_message(side, e, "removing the offload file of the plans written before")) from e


def _write(path: str | os.PathLike[str], data: bytes) -> None:
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
    Where ``offload_path(path)`` exists (``write_schedule`` wrote offloading plans),
    or the CSV ends with an older version's ``# offload:`` line, the plans come back
    as an ``OffloadPlans`` naming those pairs.

    Args:
        path: The CSV file.

    Returns:
        One list of ``Op`` per rank, idle steps dropped (an ``OffloadPlans`` where they offload).

    Raises:
        VjpsplitError: If the file cannot be read, a cell is not a compute action (or
            an overlap of exactly two), an ``I`` lacks its ``W``, a ``W`` its ``I``, or a ``B`` has a ``W``, or
            the offload file is damaged, was written for another CSV, or names a pair
            the plans have no forward of.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise VjpsplitError(f"cannot read schedule {os.fspath(path)!r}: {e.strerror or e}") from e
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise VjpsplitError(f"schedule {os.fspath(path)!r} is not UTF-8 text ({e.reason}); write it as UTF-8") from e
    plans = parse_schedule(text)
    side = offload_path(path)
    if not os.path.lexists(side):
        return plans
    pairs = _read_offload(side, hashlib.sha256(data).hexdigest())
    marked = getattr(plans, "offloaded", None)
    if marked is not None and marked != frozenset(pairs):
        raise VjpsplitError(
            f"{side}: names other pairs than the '{OFFLOAD_MARK}' line of {os.fspath(path)}; "
            "delete that line or this file, or write the plans again with write_schedule"
        )
    _check_pairs(plans, pairs, side)
    return OffloadPlans(plans, pairs)


def _read_offload(side: str, sha256: str) -> list[tuple[int, int]]:
    """The pairs an offload file names, once it is whole and belongs to the CSV whose SHA-256 is ``sha256``."""
    raw = read_bytes(side, "offload")
    again = "write the plans again with write_schedule, or delete it"
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise VjpsplitError(f"{side}: not an offload file (not JSON: {e}); {again}") from e
    if not isinstance(record, dict) or record.get("format") != _OFFLOAD_FORMAT:
        raise VjpsplitError(f"{side}: not an offload file (no \"format\": \"{_OFFLOAD_FORMAT}\"); {again}")
    if record.get("version") != 1:
        raise VjpsplitError(
            f"{side}: offload file version {record.get('version')!r}; this vjpsplit reads version 1; {again}"
        )
    if record.get("schedule_sha256") != sha256:
        raise VjpsplitError(
            f"{side}: written for another CSV (the CSV's SHA-256 differs from the one it records); {again}"
        )
    pairs = record.get("offload")
    if not isinstance(pairs, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(type(v) is int and v >= 0 for v in p) for p in pairs
    ):
        raise VjpsplitError(
            f"{side}: \"offload\" must be a list of [stage, microbatch] pairs of non-negative integers; {again}"
        )
    return [(s, m) for s, m in pairs]


def _check_pairs(plans: Sequence[Sequence[Op]], pairs: Sequence[tuple[int, int]], where: str) -> None:
    forwards = {(o.stage, o.mb) for ops in plans for o in ops if o.kind == Kind.F}
    for s, m in pairs:
        if (s, m) not in forwards:
            raise VjpsplitError(
                f"{where}: offloads stage {s} microbatch {m}, which the plans have no forward of ({s}F{m}); "
                "name only pairs the plans run"
            )


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
    if offloaded is None:
        return plans
    _check_pairs(plans, offloaded, "the offload line")
    return OffloadPlans(plans, offloaded)


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
