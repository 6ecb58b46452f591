"""Evaluation: every stage's forward only, from its evaluation program, where the stage's worker runs.

A stage's evaluation program (``stages.evalprograms``) takes what the artifact's
forward takes and returns only what the stage sends on (the loss, for the last
stage): nothing is kept for a backward, and the worker's residuals, gradients
and parameters are not touched. ``eval_stage`` runs one stage on one
microbatch on its worker's device; ``evaluate_here`` runs every microbatch
through every stage in this process (dispatched in microbatch order, so the
stages' devices work on different microbatches at once); ``EvaluatingActor``
gives a Ray actor the same call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from ..stages.evalprograms import EvalProgram
from .model import Microbatch, side_for
from .replicas import ReplicaGroup
from .worker import StageWorker
from ...treetypes import Leaf, PyTree

if TYPE_CHECKING:
    import jax


def eval_stage(
    worker: StageWorker | ReplicaGroup, program: EvalProgram, x: PyTree, side: Sequence[Leaf]
) -> jax.Array | tuple[jax.Array, ...]:
    """Stage ``worker``'s forward on one microbatch from ``program``: the tuple it sends on, or the loss (last)."""
    import jax

    xs = worker.to_device([x, *side])  # stage 0's x is the batch leaves it reads
    out = program.run(*jax.tree_util.tree_leaves((worker.params, *xs)))
    return out[0] if worker.is_last else out


def evaluate_here(
    workers: Sequence[StageWorker], programs: Sequence[EvalProgram], mbs: Sequence[Microbatch], keep: bool = False
) -> tuple[list[jax.Array], list[PyTree]]:
    """Every microbatch of ``mbs`` through every stage (``workers[s]`` runs ``programs[s]``): per microbatch the
    loss (a device scalar) and, with ``keep``, what the last stage received (else nothing is held)."""
    S = len(workers)
    losses, received = [], []
    for x, side in mbs:
        for s, (w, p) in enumerate(zip(workers, programs)):
            if keep and s == S - 1:
                received.append(x)
            x = eval_stage(w, p, x, side_for(side, s, S))
        losses.append(x)
    return losses, received


def host(tree: PyTree) -> PyTree:
    """``tree``'s arrays as host arrays (what a Ray actor hands on)."""
    import jax

    return jax.tree_util.tree_map(np.asarray, tree)


class EvaluatingActor:
    """What a Ray actor adds to evaluate: its stages' evaluation programs (sent once) and one stage's forward.

    It expects ``stage_workers`` (stage index -> ``StageWorker``), as ``StageActor`` has.
    """

    stage_workers: dict[int, StageWorker | ReplicaGroup]

    def load_eval(self, programs: Mapping[int, bytes]) -> None:
        """Hold the evaluation programs of the stages this actor holds (``EvalProgram`` bytes, checked by the
        driver when it loaded them)."""
        self.eval_programs = {
            int(s): EvalProgram.from_bytes(data, f"stage {s}'s evaluation program") for s, data in programs.items()
        }

    def has_eval(self) -> bool:
        """Whether ``load_eval`` has run on this actor (a replaced actor has not)."""
        return bool(getattr(self, "eval_programs", None))

    def eval_op(self, stage: int, x: PyTree, side: list[Leaf]) -> PyTree:
        """Stage ``stage``'s forward on one microbatch: what it sends on, or the loss (last), as host arrays."""
        return host(eval_stage(self.stage_workers[stage], self.eval_programs[stage], x, side))
