"""A step as a Ray Compiled Graph: the static graph of F, B, I and W calls, built once and executed per step.

The same ``dispatch.walk`` that submits actor calls binds graph nodes here: an
operation's node reads the node of the activation or cotangent it needs, so
those travel actor to actor through the graph's channels. Each actor ends the
step with ``collect``, which reads its unconsumed results (to run after them)
and returns its gradients, losses and timings, then resets; the driver gets
only those.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ...schedules.ops import Op
from ..dispatch import walk
from ....treetypes import Leaf
from .setup import ActorHandle

if TYPE_CHECKING:
    from ray.dag import DAGNode
    from ray.dag.compiled_dag_node import CompiledDAG


def compile_step(
    actors: Sequence[ActorHandle],
    plans: Sequence[Sequence[Op]],
    num_stages: int,
    microbatches: int,
) -> CompiledDAG:
    """The compiled graph of one step: ``execute(*xs, *sides)`` (one x and one side list per microbatch).

    Each node runs its operation by its kind (``stageops.run_op``): the plans say which backwards are split.

    Raises whatever Ray raises where Compiled Graphs are unavailable or refuse
    the graph; the caller falls back to actor calls.
    """
    from ray.dag import InputNode, MultiOutputNode

    M = microbatches
    last: list[DAGNode | None] = [None] * len(plans)

    with InputNode() as inp:
        mbs = [(inp[m], inp[M + m]) for m in range(M)]

        def submit(w: int, op: Op, data: object, side: list[Leaf]) -> DAGNode:
            # Chained to the worker's previous node: every node then hangs off the input
            # (Ray requires it) and each actor runs exactly its list's order.
            node = actors[w].op.bind(op.kind, op.stage, op.mb, data, side, M, last[w])
            last[w] = node
            return node

        walk(plans, num_stages, mbs, submit)
        dag = MultiOutputNode([actors[w].collect.bind(node) for w, node in enumerate(last)])
    return dag.experimental_compile()
