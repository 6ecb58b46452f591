"""One operation of a pipeline step, and the one rule of what an operation waits for.

An ``Op`` is ``kind`` on microbatch ``mb`` of stage ``stage``: F the forward, B
the whole backward, or, where the backward is split, I its input part and W its
weight part (torch.distributed.pipelining's ``_ComputationType`` and CSV letters:
FORWARD ``F``, FULL_BACKWARD ``B``, BACKWARD_INPUT ``I``, BACKWARD_WEIGHT ``W``).
Each operation says what it computes: nothing asks the other operations of the
plans whether a backward is split.
``dependencies`` is the only place that says which operations' results an
operation reads; the plans' simulation (``play``), and through it the dispatcher,
the deadlock check, the simulator and ZB-H1's W placement, all ask it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from ...errors import VjpsplitError


class Kind(enum.StrEnum):
    """What an operation computes, by torch's letters: ``F``, ``B`` (whole backward), ``I`` and ``W`` (its parts).

    A microbatch's backward on a stage is one ``B``, or one ``I`` and one ``W`` after it
    (``plans.check_plans`` refuses any other mix).

    Attributes:
        F: The forward.
        B: The whole backward: input cotangent and weight gradients at once.
        I: The backward's input part: the input cotangent, leaving intermediates for its ``W``.
        W: The backward's weight part: the weight gradients, from what its ``I`` left.
    """

    F = "F"
    B = "B"
    I = "I"  # noqa: E741  (torch's letter for BACKWARD_INPUT)
    W = "W"


BACKWARDS = (Kind.B, Kind.I)  # the kinds that hand on a cotangent: a stage runs one of them per microbatch
RELEASES = (Kind.B, Kind.W)  # the kinds after which a stage holds nothing more of the microbatch


class OpKey(NamedTuple):
    """An operation as dependencies name it: ``(kind, mb, stage)``, without how it is presented.

    The backward that hands on the cotangent is ``B`` here whether it is the whole
    backward or its input part ``I``: the operation that reads it (the stage before's
    backward, the ``W``) reads the same value either way, and a stage runs only one
    of the two per microbatch.
    """

    kind: str
    mb: int
    stage: int


@dataclass(frozen=True)
class Op:
    """One operation of a worker: ``kind`` F, B, I or W on microbatch ``mb`` of stage ``stage``.

    ``stage`` indexes the pipeline's stages (its artifacts). It equals the worker's
    index except where a worker runs several stages (ZB-V, DualPipeV, interleaved).
    ``overlap`` marks the first of two operations that torch's runtime runs as one
    ``OVERLAP_F_B`` action (DualPipeV); vjpsplit runs them one after the other.

    Attributes:
        kind: A ``Kind`` (a string ``"F"``, ``"B"``, ``"I"`` or ``"W"`` is converted).
        mb: The microbatch.
        stage: The stage.
        overlap: Whether this is the first of two operations torch runs as one ``OVERLAP_F_B``.
        key: ``(kind, mb, stage)`` as dependencies name it, ``I`` named ``B`` (see ``OpKey``;
            derived, not a constructor argument).

    Raises:
        VjpsplitError: If ``kind`` is not F, B, I or W.
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
                raise VjpsplitError(
                    f"Op kind {self.kind!r}: use 'F', 'B' (whole backward), 'I' (its input part) or 'W' (its weight part)"
                ) from None
        # Made once: the plans' simulation looks operations up by it many times per step.
        keyed = Kind.B if self.kind == Kind.I else self.kind
        object.__setattr__(self, "key", OpKey(keyed, self.mb, self.stage))


def dependencies(op: Op, num_stages: int) -> tuple[OpKey, ...]:
    """The operations whose results ``op`` reads.

    F reads the previous stage's activation; B and I read their own stage's residuals
    (its F) and the next stage's cotangent (the last stage starts from its loss); W
    reads what its I left. The cotangent's producer is named ``B`` (see ``OpKey``).
    """
    k, mb, s = op.kind, op.mb, op.stage
    if k == Kind.F:
        return (OpKey(Kind.F, mb, s - 1),) if s > 0 else ()
    if k in BACKWARDS:
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


def action_name(op: Op) -> str:
    """``op`` as torch's CSV action writes it: stage, kind letter, microbatch (``1I2``)."""
    return f"{op.stage}{op.kind}{op.mb}"


def check_backwards(plans: Sequence[Sequence[Op]]) -> None:
    """Refuse a microbatch's backward on a stage that is neither one whole ``B`` nor an ``I`` with its ``W``.

    The old reading of a ``B`` followed by a ``W`` (the input part, as vjpsplit wrote it
    before ``I``) is refused by name, with the fix.

    Args:
        plans: One sequence of ``Op`` per rank.

    Raises:
        VjpsplitError: naming the rank, the stage and microbatch, and what to write instead.
    """
    found: dict[tuple[int, int], dict[Kind, int]] = {}  # (stage, mb) -> the backward kinds there, by rank
    for r, ops in enumerate(plans):
        for o in ops:
            if isinstance(o, Op) and o.kind != Kind.F:
                found.setdefault((o.stage, o.mb), {}).setdefault(o.kind, r)
    for (s, mb), kinds in found.items():
        where = f"rank {kinds[next(iter(kinds))]}: stage {s} microbatch {mb}"
        if Kind.B in kinds and Kind.I in kinds:
            raise VjpsplitError(
                f"{where}: {s}B{mb} (the whole backward) and {s}I{mb} (its input part) are both there; keep one"
            )
        if Kind.B in kinds and Kind.W in kinds:
            raise VjpsplitError(
                f"{where}: {s}B{mb} is the whole backward, yet {s}W{mb} is its weight part; with a W, "
                f"use I ({s}I{mb}) for the input part, or drop the W"
            )
        if Kind.I in kinds and Kind.W not in kinds:
            raise VjpsplitError(
                f"{where}: {s}I{mb} is the backward's input part, but no {s}W{mb} runs its weight part; "
                f"add the W, or use B ({s}B{mb}) for the whole backward"
            )
        if Kind.W in kinds and Kind.I not in kinds:
            raise VjpsplitError(
                f"{where}: {s}W{mb} is the backward's weight part, but no {s}I{mb} runs its input part; "
                f"add the I before it"
            )
