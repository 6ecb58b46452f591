"""A step's plans lowered to each worker's actions: its computations, and the sends and receives between workers.

The plans say what each worker computes and in which order; an ``Action`` list also
says where a value leaves one worker and where another takes it, as
torch.distributed.pipelining lowers its schedules (``_Action(stage_index,
computation_type, microbatch_index)``; ``_add_send_recv`` puts ``SEND_F``/``RECV_F``/
``SEND_B``/``RECV_B`` around the computations) and JaxPP lowers a step to per-actor
task lists with explicit sends and receives. ``lower`` does it for vjpsplit's plans:

* a ``RECV`` right before the computation that reads a value another worker makes
  (an F's activation from the stage before, a B's or I's cotangent from the stage after);
* a ``SEND`` right after the computation that makes it;
* a B whose cotangent goes to another worker, on a stage with the split backward,
  as its I, the ``SEND_B``, then its W (``hands_on_early``): the cotangent travels while
  the weight part computes, the same operations and gradients as the whole B.

A value between two stages of one worker (ZB-V's V) is neither sent nor received.
Ray's lower bound reads the computations of these lists (``runtime.ray.lists.action_lists``); the runners do not
interpret them yet: each still places its sends and receives itself, as these lists do.

Reference: torch.distributed.pipelining, ``schedules.py`` (``_Action``, ``_add_send_recv``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping, Sequence

from .ops import BACKWARDS, Kind, Op, OpKey, dependencies, received


class Comm(enum.StrEnum):
    """A value moving between workers, by torch's names: an activation (``F``) or a cotangent (``B``) sent or
    received.

    Attributes:
        SEND_F: The stage's activation, to the worker of the stage after.
        RECV_F: The stage's input activation, from the worker of the stage before.
        SEND_B: The stage's input cotangent, to the worker of the stage before.
        RECV_B: The stage's output cotangent, from the worker of the stage after.
    """

    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


@dataclass(frozen=True, slots=True)
class Action:
    """One thing a worker does in a step: a computation (``kind`` a ``Kind``) or a move (a ``Comm``) of
    microbatch ``mb`` at stage ``stage``; ``peer`` is the other worker of a move (None for a computation).

    Written as torch writes actions: ``1F2``, ``1SEND_F2``, ``2RECV_B0`` (stage, kind, microbatch).

    Attributes:
        stage: The stage whose computation this is, or whose value moves (the sender's for a SEND, the
            receiver's for a RECV, as in torch).
        kind: ``Kind.F``/``B``/``I``/``W``, or a ``Comm``.
        mb: The microbatch.
        peer: The worker the value goes to (SEND) or comes from (RECV); None for a computation.
        overlap: A computation's ``Op.overlap`` (DualPipeV's pairs torch runs as one action).
    """

    stage: int
    kind: Kind | Comm
    mb: int
    peer: int | None = None
    overlap: bool = False

    @property
    def computes(self) -> bool:
        """Whether this is a computation (F, B, I or W), not a move."""
        return isinstance(self.kind, Kind)

    @property
    def op(self) -> Op:
        """The computation as an ``Op`` (a move has none).

        Raises:
            ValueError: If this is a move.
        """
        if not isinstance(self.kind, Kind):
            raise ValueError(f"{self} is a move, not a computation")
        return Op(self.kind, self.mb, self.stage, self.overlap)

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def destination(op: Op, num_stages: int) -> int | None:
    """The stage that reads ``op``'s result: the next for an F, the previous for a B or I; None for the loss, a W
    and the first stage's backward.

    Args:
        op: The computation.
        num_stages: The pipeline's stage count.

    Returns:
        The reading stage, or None.
    """
    if op.kind == Kind.F:
        return op.stage + 1 if op.stage < num_stages - 1 else None
    if op.kind in BACKWARDS:
        return op.stage - 1 if op.stage > 0 else None
    return None


def hands_on_early(op: Op, splits: Mapping[int, bool] | Sequence[bool], worker_of: Mapping[int, int]) -> bool:
    """Whether ``op`` runs as its input part, then sends its cotangent, then its weight part: a B on a stage with the
    split backward (``splits[stage]``) whose cotangent goes to another worker's stage.

    Args:
        op: The computation.
        splits: Per stage, whether its artifact has the split backward.
        worker_of: The worker of each stage.

    Returns:
        True for such a B.
    """
    if op.kind != Kind.B or op.stage == 0 or not splits[op.stage]:
        return False
    return worker_of[op.stage - 1] != worker_of[op.stage]


def lower(
    plans: Sequence[Sequence[Op]],
    worker_of: Mapping[int, int],
    splits: Mapping[int, bool] | Sequence[bool],
    num_stages: int,
) -> list[list[Action]]:
    """Each worker's actions for ``plans``: its computations in the plan's order, a B that hands its cotangent on
    early (``hands_on_early``) as I then W, a RECV right before each computation whose input another worker makes
    and a SEND right after each computation another worker reads.

    Args:
        plans: One sequence of ``Op`` per worker.
        worker_of: The worker of each stage.
        splits: Per stage, whether its artifact has the split backward.
        num_stages: The pipeline's stage count.

    Returns:
        One list of ``Action`` per worker.

    Reference: torch.distributed.pipelining ``_add_send_recv``.
    """
    lists: list[list[Action]] = []
    for w, ops in enumerate(plans):
        out: list[Action] = []
        for op in ops:
            src = received(op, dependencies(op, num_stages))
            if src is not None and worker_of[src.stage] != w:
                recv = Comm.RECV_F if src.kind == Kind.F else Comm.RECV_B
                out.append(Action(op.stage, recv, op.mb, worker_of[src.stage]))
            dest = destination(op, num_stages)
            to = None if dest is None or worker_of[dest] == w else worker_of[dest]
            send = (
                None if to is None else Action(op.stage, Comm.SEND_F if op.kind == Kind.F else Comm.SEND_B, op.mb, to)
            )
            if send is not None and hands_on_early(op, splits, worker_of):
                out += [Action(op.stage, Kind.I, op.mb), send, Action(op.stage, Kind.W, op.mb)]
                continue
            out.append(Action(op.stage, op.kind, op.mb, overlap=op.overlap))
            if send is not None:
                out.append(send)
        lists.append(out)
    return lists


def computations(actions: Sequence[Action]) -> list[Op]:
    """The computations among ``actions``, in order, as ``Op``s (what the plans' simulation and the costs read).

    Args:
        actions: One worker's actions.

    Returns:
        Its F, B, I and W operations.
    """
    return [a.op for a in actions if a.computes]


def sent_key(a: Action) -> OpKey:
    """The computation whose result a move carries, as dependencies name it (a cotangent's producer is ``B``).

    Args:
        a: A SEND or RECV.

    Returns:
        For a SEND, its own stage's computation; for a RECV, the sending stage's (the stage before for an
        activation, after for a cotangent).
    """
    if a.kind in (Comm.SEND_F, Comm.SEND_B):
        return OpKey(Kind.F if a.kind == Comm.SEND_F else Kind.B, a.mb, a.stage)
    if a.kind == Comm.RECV_F:
        return OpKey(Kind.F, a.mb, a.stage - 1)
    if a.kind == Comm.RECV_B:
        return OpKey(Kind.B, a.mb, a.stage + 1)
    raise ValueError(f"{a} is a computation, not a move")
