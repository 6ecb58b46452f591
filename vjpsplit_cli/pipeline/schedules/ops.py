"""One operation of a pipeline step, and the one rule of what an operation waits for.

An ``Op`` is ``kind`` (F, B or W) on microbatch ``mb`` of stage ``stage``.
``dependencies`` is the only place that says which operations' results an
operation reads; the play of plans (``play``), and through it the dispatcher,
the deadlock check, the simulator and ZB-H1's W placement, all ask it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from ...errors import VjpsplitError


class Kind(enum.StrEnum):
    """What an operation computes: ``F`` the forward, ``B`` the backward, ``W`` its weight part.

    ``B`` is the backward's input part where a ``W`` of the same stage and
    microbatch is in the plans, else the whole backward.

    Attributes:
        F: The forward.
        B: The backward (its input part where a ``W`` follows).
        W: The backward's weight part.
    """

    F = "F"
    B = "B"
    W = "W"


class OpKey(NamedTuple):
    """An operation as dependencies name it: ``(kind, mb, stage)``, without how it is presented."""

    kind: str
    mb: int
    stage: int


@dataclass(frozen=True)
class Op:
    """One operation of a worker: ``kind`` F, B or W on microbatch ``mb`` of stage ``stage``.

    ``stage`` indexes the pipeline's stages (its artifacts). It equals the worker's
    index except where a worker runs several stages (ZB-V, DualPipeV, interleaved).
    ``overlap`` marks the first of two operations that torch's runtime runs as one
    ``OVERLAP_F_B`` action (DualPipeV); vjpsplit runs them one after the other.

    Attributes:
        kind: ``Kind.F``, ``Kind.B`` or ``Kind.W`` (a string ``"F"``, ``"B"`` or ``"W"`` is converted).
        mb: The microbatch.
        stage: The stage.
        overlap: Whether this is the first of two operations torch runs as one ``OVERLAP_F_B``.
        key: ``(kind, mb, stage)`` as dependencies name it (derived, not a constructor argument).

    Raises:
        VjpsplitError: If ``kind`` is not F, B or W.
    """

    kind: Kind
    mb: int
    stage: int
    overlap: bool = False
    key: OpKey = field(init=False, repr=False, compare=False)  # ``(kind, mb, stage)``, as dependencies name it

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            try:
                object.__setattr__(self, "kind", Kind(self.kind))
            except ValueError:
                raise VjpsplitError(f"Op kind {self.kind!r}: use 'F', 'B' or 'W'") from None
        # Made once: the play of plans looks operations up by it many times per step.
        object.__setattr__(self, "key", OpKey(self.kind, self.mb, self.stage))


def dependencies(op: Op, num_stages: int) -> tuple[OpKey, ...]:
    """The operations whose results ``op`` reads.

    F reads the previous stage's activation; B reads its own stage's residuals (its F)
    and the next stage's cotangent (the last stage starts from its loss); W reads what
    its B left.
    """
    k, mb, s = op.kind, op.mb, op.stage
    if k == Kind.F:
        return (OpKey(Kind.F, mb, s - 1),) if s > 0 else ()
    if k == Kind.B:
        return (OpKey(Kind.F, mb, s), OpKey(Kind.B, mb, s + 1)) if s < num_stages - 1 else (OpKey(Kind.F, mb, s),)
    return (OpKey(Kind.B, mb, s),)


def received(op: Op, deps: Sequence[OpKey]) -> OpKey | None:
    """The operation of another stage whose result ``op`` takes as its input, if any, among ``op``'s
    ``dependencies``.

    That is the one on another stage: F's activation from the stage before, B's
    cotangent from the stage after. What an operation reads from its own stage
    (residuals, intermediates) stays with the stage.
    """
    for d in deps:
        if d.stage != op.stage:
            return d
    return None


def split_ops(plans: Sequence[Sequence[Op]]) -> set[tuple[int, int]]:
    """The ``(stage, microbatch)`` pairs whose backward is split: their B is the input part, a W follows."""
    return {(o.stage, o.mb) for ops in plans for o in ops if o.kind == Kind.W}


def action_name(op: Op | OpKey, split: set[tuple[int, int]]) -> str:
    """``op`` as torch's CSV action writes it: stage, ``F``/``I``/``B``/``W``, microbatch (``1I2``)."""
    kind = "I" if op.kind == Kind.B and (op.stage, op.mb) in split else str(op.kind)
    return f"{op.stage}{kind}{op.mb}"
