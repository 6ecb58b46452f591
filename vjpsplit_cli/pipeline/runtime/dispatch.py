"""The one dispatch walker every runner uses, and the progress bar.

A step is the workers' lists of F, B and W operations. ``walk`` hands them to a
runner's ``submit`` in one global order that keeps each worker's own order and
lets every operation follow the operations whose results it reads; what flows
between stages is whatever ``submit`` returns (a mailbox in-process, an object
reference or a graph node on Ray), so a runner never repeats this bookkeeping.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

from ...errors import VjpsplitError
from ..schedules.builtins import Op


class PerStage(dict):
    """A microbatch's side inputs for several stages (stage index -> list), not only the last's."""


class PreSplit:
    """A batch already cut into ``(x, side)`` microbatches (``Stages.stage_batch``), passed where ``x`` goes."""

    def __init__(self, mbs: Sequence[tuple[Any, Any]]):
        self.mbs = list(mbs)


def side_for(side, chunk: int, stages: int) -> list:
    """Stage ``chunk``'s side inputs: its own from a ``PerStage``, else the microbatch's for the last stage."""
    if isinstance(side, PerStage):
        return side.get(chunk, [])
    return side if chunk == stages - 1 else []


def walk(
    plans: Sequence[Sequence[Op]],
    stages: int,
    mbs: Sequence[tuple[Any, list]],
    submit: Callable[[int, Op, Any, list], Any],
) -> list:
    """Call ``submit(worker, op, data, side)`` once per operation, in an order that respects every dependency.

    ``data`` is the microbatch itself (F of the first stage), the handle that
    ``submit`` returned for the activation (F) or cotangent (B) this operation
    reads, or None (B of the last stage, which starts from its loss; W). ``side``
    is the microbatch's side inputs for the last stage's F (or each stage's own,
    from a ``PerStage``), else empty. Returns
    the handles in submission order.
    """
    S = stages
    acts: dict[tuple, Any] = {}
    cts: dict[tuple, Any] = {}
    handles = []
    idx = [0] * len(plans)
    while any(idx[w] < len(plans[w]) for w in range(len(plans))):
        moved = False
        for w, ops in enumerate(plans):
            while idx[w] < len(ops):
                op = ops[idx[w]]
                c, mb = op.chunk, op.mb
                if op.kind == "F":
                    if c > 0 and (c, mb) not in acts:
                        break
                    data = mbs[mb][0] if c == 0 else acts.pop((c, mb))
                    h = submit(w, op, data, side_for(mbs[mb][1], c, S))
                    if c < S - 1:
                        acts[(c + 1, mb)] = h
                elif op.kind == "B":
                    if c < S - 1 and (c, mb) not in cts:
                        break
                    h = submit(w, op, None if c == S - 1 else cts.pop((c, mb)), [])
                    if c > 0:
                        cts[(c - 1, mb)] = h
                else:
                    h = submit(w, op, None, [])
                handles.append(h)
                idx[w] += 1
                moved = True
        if not moved:
            raise VjpsplitError("the schedule deadlocks: some operation waits for one that runs after it")
    return handles


def progress_bar(total: int, enabled: bool):
    """A tqdm bar over ``total`` operations on stderr, or None when not asked for (or tqdm is missing)."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="pipeline ops", file=sys.stderr, leave=False)
