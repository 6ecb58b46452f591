"""What the runners call on a stage: the ``RunsOps`` protocol and ``run_op``, one scheduled operation by its kind.

``RunsOps`` is what ``run_op`` and the runners (threads in-process, Ray actors) call on a stage: a
``worker.StageWorker``, or a ``replicas.ReplicaGroup`` standing in its place. ``run_op`` hands an
operation to the stage's F, B, I or W, and names the operation in any error it raises. ``worker`` and
``replicas`` implement it, the runners call it.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from ..schedules.ops import Kind, Op
from ...errors import VjpsplitError, raised_line
from ...treetypes import PyTree

if TYPE_CHECKING:
    import numpy as np

    from .hang_report import RingOp
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
    def ring(self) -> deque[RingOp]: ...

    @property
    def is_last(self) -> bool: ...

    @property
    def inter(self) -> dict[int, Intermediates]: ...

    def weight_pending(self, mb: int) -> bool: ...

    @property
    def peak_residual_bytes(self) -> int: ...

    @property
    def splits_backward(self) -> bool: ...

    def set_offload(self, spec: Offload | None) -> None: ...

    def discard_offloaded(self) -> None: ...

    def before(self, op: Op) -> None: ...

    def reset(
        self,
        timed: bool | None = None,
        plans: Sequence[Sequence[Op]] | None = None,
        scales: Sequence[float] | None = None,
        whole: bool = False,
    ) -> None: ...

    def to_device(self, tree: PyTree) -> PyTree: ...

    def fetch_losses(self) -> dict[int, float]: ...

    def fetch_outputs(self) -> tuple[dict[int, float], dict[int, list[np.ndarray]]]: ...

    def forward(
        self, mb: int, x: PyTree, side: Sequence[PyTree], worker: int | None = None, microbatches: int | None = None
    ) -> PyTree: ...

    def fused(self, mb: int) -> bool: ...

    def backward(self, mb: int, ct: PyTree, microbatches: int, worker: int | None = None) -> PyTree | None: ...

    def backward_input(self, mb: int, ct: PyTree, microbatches: int, worker: int | None = None) -> PyTree | None: ...

    def backward_weight(self, mb: int, worker: int | None = None) -> None: ...


def run_op(
    stage: RunsOps,
    op: Op,
    data: PyTree,
    side: Sequence[PyTree],
    microbatches: int,
    worker: int,
    hand_on: Callable[[PyTree], None] | None = None,
) -> PyTree:
    """Execute scheduled operation ``op`` on ``stage`` by its kind: F takes the activation, B and I the cotangent;
    W takes nothing.

    ``hand_on`` (what a Ray worker's untimed list gives a B whose cotangent goes to another actor): on a stage
    with the split backward (every stage but the first), the B runs as its input part, then
    ``hand_on(cotangent)``, then its weight part, so that the cotangent travels while the weight part
    computes (the same operations as ``I`` then ``W``: the same gradients). Elsewhere it is not called.

    Returns what the operation hands on: the activation (or loss), the input
    cotangent, or None for W.

    Raises:
        VjpsplitError: what the operation raised, naming it (``F stage 1 mb 0 failed: ...``; chained), unless it
            was one already (those name what they are about).
    """
    try:
        return _run(stage, op, data, side, microbatches, worker, hand_on)
    except VjpsplitError:
        raise
    except Exception as e:  # a stage's own error (a host callback in the loss, a device error): named here
        raise VjpsplitError(f"{op.kind} stage {op.stage} mb {op.mb} failed: {raised_line(e)}") from e


def _run(
    stage: RunsOps,
    op: Op,
    data: PyTree,
    side: Sequence[PyTree],
    microbatches: int,
    worker: int,
    hand_on: Callable[[PyTree], None] | None,
) -> PyTree:
    """``run_op``'s operation, by its kind."""
    stage.before(op)  # the copy back of the stage's next backward overlaps this operation
    if op.kind == Kind.F:
        return stage.forward(op.mb, data, side, worker=worker, microbatches=microbatches)
    if op.kind == Kind.B:
        if hand_on is not None and op.stage > 0 and stage.splits_backward and not stage.fused(op.mb):
            # After a whole backward nothing hides the cotangent's trip to the next actor (1F1B's stages wait
            # for it); after the input part the weight part does.
            ct = stage.backward_input(op.mb, data, microbatches, worker=worker)
            hand_on(ct)
            stage.backward_weight(op.mb, worker=worker)
            return ct
        return stage.backward(op.mb, data, microbatches, worker=worker)
    if op.kind == Kind.I:
        return stage.backward_input(op.mb, data, microbatches, worker=worker)
    stage.backward_weight(op.mb, worker=worker)
    return None
