"""The one dispatcher every runner uses, and the progress bar (``ProgressBar``).

A step is the workers' lists of F, B, I and W operations. ``walk`` hands them to a
runner's ``submit`` in the plans' execution order (``schedules.play.sweep``:
each worker's own order, every operation after those whose results it reads);
what flows between stages is whatever ``submit`` returns (a mailbox in-process,
an object reference or a graph node on Ray), so a runner never repeats this
bookkeeping. ``placed_microbatches`` puts each microbatch's batch inputs on the
device of the stage that reads them, before the in-process runner hands a step out.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, Sequence, TypeVar, cast

import jax
import numpy as np

from ..schedules.ops import Kind, Op, OpKey, received
from ..schedules.play import sweep
from ..stages.directory import StageInputs
from .devices import runs_serially
from .model import Microbatch, side_for
from ...treetypes import Leaf, PyTree

if TYPE_CHECKING:
    from .stageops import RunsOps

H = TypeVar("H")
# A runner's hand-off of one operation: (worker, op, what it takes, its side inputs) -> what its readers take.
Submit = Callable[[int, Op, object, list[Leaf]], H]


Order = list[tuple[int, Op, "OpKey | None"]]  # per operation in dispatch order: its worker, it, what it receives


def order_of(plans: Sequence[Sequence[Op]], num_stages: int) -> Order:
    """The operations in the plans' execution order, each with its worker and the operation whose result it
    takes (``ops.received``): what ``walk`` goes through, worth keeping where the same plans run every step."""
    return list(_order(plans, num_stages))


def _order(plans: Sequence[Sequence[Op]], num_stages: int) -> Iterator[tuple[int, Op, OpKey | None]]:
    for w, op, _, _, deps in sweep(plans, num_stages):
        yield w, op, received(op, deps)


def walk(
    plans: Sequence[Sequence[Op]],
    num_stages: int,
    mbs: Sequence[Microbatch],
    submit: Submit[H],
    order: Order | None = None,
) -> list[H]:
    """Call ``submit(worker, op, data, side)`` once per operation, in an order that respects every dependency.

    ``data`` is what ``submit`` returned for the operation of another stage whose
    result ``op`` takes (``ops.received`` of its dependencies: the activation for F,
    the cotangent for B), the microbatch itself for the first stage's F, or None (the last stage's B,
    which starts from its loss; W). ``side`` is the stage's side inputs for F
    (``model.side_for``), else empty. ``order``: ``order_of(plans, num_stages)``, if
    kept. Returns the handles in submission order.
    """
    S = num_stages
    sent: dict[OpKey, H] = {}  # by operation, the handles no other stage's operation has taken yet
    handles = []
    # Played as it goes: plans that deadlock fail after what can run before the cycle.
    for w, op, source in _order(plans, S) if order is None else order:
        data: object
        if source is not None:
            data = sent.pop(source)
        elif op.kind == Kind.F:
            data = mbs[op.mb][0]
        else:
            data = None
        side = side_for(mbs[op.mb][1], op.stage, S) if op.kind == Kind.F else []
        h = submit(w, op, data, side)
        sent[op.key] = h
        handles.append(h)
    return handles


def placed_microbatches(mbs: Sequence[Microbatch], workers: Sequence[RunsOps]) -> list[Microbatch]:
    """The microbatches' batch inputs on the device of the stage that reads each: one transfer per stage, or,
    where the microbatches' shapes differ (``Microbatches``), one per microbatch, so that each transfer's call
    compiles once per microbatch shape rather than once per order of them."""
    S = len(workers)
    reads = [[(x if s == 0 else None, side_for(side, s, S)) for x, side in mbs] for s in range(S)]
    moved = [_placed(w, r) for w, r in zip(workers, reads)]
    out: list[Microbatch] = []
    for m, (_, side) in enumerate(mbs):
        placed_side = (
            StageInputs({s: moved[s][m][1] for s in side}) if isinstance(side, StageInputs) else moved[S - 1][m][1]
        )
        out.append((moved[0][m][0], placed_side))
    return out


def _placed(worker: RunsOps, reads: list[tuple[PyTree, list[PyTree]]]) -> list[tuple[PyTree, list[PyTree]]]:
    """``reads`` (a stage's per microbatch) on ``worker``'s device: in one call where all have one shape."""
    if same_shapes(reads):
        return cast("list[tuple[PyTree, list[PyTree]]]", worker.to_device(reads))
    return [worker.to_device(r) for r in reads]


def same_shapes(trees: Sequence[PyTree]) -> bool:
    """Whether every tree of ``trees`` (a step's microbatches, or a stage's reads of them) has the same leaf shapes.

    Args:
        trees: The pytrees.

    Returns:
        True where they do (or there are fewer than two).
    """
    return len({tuple(np.shape(v) for v in jax.tree_util.tree_leaves(t)) for t in trees}) <= 1


def whole_backwards(workers: Sequence[RunsOps]) -> bool:
    """Whether a step's split backwards run whole (``StageWorker.reset``'s ``whole``): where every stage runs on
    one and the same device, and that device runs one program at a time (``devices.runs_serially``).

    A split backward puts its weight part (W) off so that the stage before gets its cotangent (I) sooner. On
    one device that runs one program at a time nothing runs sooner for it: the device is as busy either way. There
    the whole backward in one call costs less: one dispatch, not two, and (the last stage's, in its F's call) no
    intermediates written for a later W: on one TPU v5e chip, the GPT's last stage's F and I in one call and its W
    took 1.07 + 1.33 ms a microbatch, its F and B in one call 1.44 ms
    (``benchmarks/results/2026-12-07-tpu-whole-backward.md``).

    Args:
        workers: The step's workers (a ``ReplicaGroup``'s replicas are on devices of their own: never).

    Returns:
        True where the backwards run whole.
    """
    one = {getattr(st, "device", None) for st in workers}
    if len(one) != 1:
        return False
    (device,) = one
    return device is not None and runs_serially(device)


class ProgressBar(Protocol):
    """A progress bar (``tqdm``'s): advanced by ``update``, ended by ``close``."""

    def update(self, n: float = 1) -> object: ...

    def close(self) -> None: ...


def progress_bar(total: int, enabled: bool) -> ProgressBar | None:
    """A tqdm bar over ``total`` operations on stderr, or None when not asked for (or tqdm is missing)."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="pipeline ops", file=sys.stderr, leave=False)
