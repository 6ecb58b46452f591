"""What the runners call on a stage: the ``RunsOps`` protocol and ``run_op``, one scheduled operation by its kind.

``RunsOps`` is what ``run_op`` and the runners (threads in-process, Ray actors) call
on a stage: a ``worker.StageWorker``, or a ``replicas.ReplicaGroup`` standing in its
place. ``run_op`` hands an operation to the stage's F, B, I or W. May import the
schedules room's ``ops`` and ``timeline``, ``offload``'s ``Offload`` and the tracing
layer's residual types; ``worker`` and ``replicas`` implement it, the runners call it.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol, Sequence

from ..schedules.ops import Kind, Op
from ...treetypes import PyTree

if TYPE_CHECKING:
    from ...tracing.residuals import Intermediates
    from ..schedules.timeline import Event
    from .offload import Offload


class RunsOps(Protocol):
    """What runs one stage's scheduled operations: a ``StageWorker``, or a ``replicas.ReplicaGroup`` in its place.

    What ``run_op`` and the runners call on a stage; both classes document each member.
    """

    grads: PyTree

    @property
    def events(self) -> list[Event]: ...

    @property
    def ring(self) -> deque[tuple[str, int, float, float]]: ...

    @property
    def is_last(self) -> bool: ...

    @property
    def inter(self) -> dict[int, Intermediates]: ...

    @property
    def peak_residual_bytes(self) -> int: ...

    def set_offload(self, spec: Offload | None) -> None: ...

    def before(self, op: Op) -> None: ...

    def reset(self, timed: bool | None = None, plans: Sequence[Sequence[Op]] | None = None) -> None: ...

    def to_device(self, tree: PyTree) -> PyTree: ...

    def fetch_losses(self) -> dict[int, float]: ...

    def forward(self, mb: int, x: PyTree, side: Sequence[PyTree], worker: int | None = None) -> PyTree: ...

    def backward(self, mb: int, ct: PyTree, microbatches: int, worker: int | None = None) -> PyTree | None: ...

    def backward_input(self, mb: int, ct: PyTree, microbatches: int, worker: int | None = None) -> PyTree | None: ...

    def backward_weight(self, mb: int, worker: int | None = None) -> None: ...


def run_op(stage: RunsOps, op: Op, data: PyTree, side: Sequence[PyTree], microbatches: int, worker: int) -> PyTree:
    """Execute scheduled operation ``op`` on ``stage`` by its kind: F takes the activation, B and I the cotangent;
    W takes nothing.

    Returns what the operation hands on: the activation (or loss), the input
    cotangent, or None for W.
    """
    stage.before(op)  # the copy back of the stage's next backward overlaps this operation
    if op.kind == Kind.F:
        return stage.forward(op.mb, data, side, worker=worker)
    if op.kind == Kind.B:
        return stage.backward(op.mb, data, microbatches, worker=worker)
    if op.kind == Kind.I:
        return stage.backward_input(op.mb, data, microbatches, worker=worker)
    stage.backward_weight(op.mb, worker=worker)
    return None
