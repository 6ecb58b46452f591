"""Evaluation: every stage's forward only, from its evaluation program, where the stage's worker runs.

A stage's evaluation program (``stages.evalprograms``) takes what the artifact's
forward takes and returns only what the stage sends on (the loss, for the last
stage): nothing is kept for a backward, and the worker's residuals, gradients
and parameters are not touched. ``eval_stage`` runs one stage on one
microbatch on its worker's device (a stage with replicas: each replica on its
part of the microbatch, as a step's F runs, handing on a ``Parts``);
``evaluate_here`` runs every microbatch through every stage in this process
(dispatched in microbatch order, so the stages' devices work on different
microbatches at once); ``training.train_actor.TrainActor`` gives a Ray actor the same call.
``loss_and_aux`` and ``joined`` turn what the last stage gives and receives into
the caller's loss, aux and outputs. An error a stage's program raises names the stage
and the microbatch.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from ...errors import VjpsplitError, raised_line
from ..stages.evalprograms import EvalProgram
from .model import Microbatch, side_for
from .replicas import Parts, ReplicaGroup, split_parts
from .worker import StageWorker
from ...treetypes import Leaf, PyTree


def eval_stage(
    worker: StageWorker | ReplicaGroup, program: EvalProgram, x: PyTree, side: Sequence[Leaf], mb: int
) -> PyTree:
    """Stage ``worker``'s forward on microbatch ``mb`` from ``program``: the tuple it sends on, or the loss (last;
    ``(loss, *aux leaves)`` for a last stage with aux).

    A stage with replicas runs each replica on its part of the microbatch (``x`` whole, or the ``Parts`` the
    stage before handed on) and hands on a ``Parts``: per replica, its output or its loss.

    Raises:
        VjpsplitError: the microbatch does not split into the replicas; what the program raised, naming the stage
            and the microbatch (chained).
    """
    if isinstance(worker, ReplicaGroup):
        xs = list(x) if isinstance(x, Parts) else split_parts(x, worker.n)
        sides = split_parts(list(side), worker.n) if side else [[] for _ in range(worker.n)]
        return Parts(eval_stage(r, program, xs[i], sides[i], mb) for i, r in enumerate(worker.replicas))
    try:
        xs = worker.to_device([x, *side])  # stage 0's x is the batch leaves it reads
        out = program.run(*jax.tree_util.tree_leaves((worker.params, *xs)))
    except VjpsplitError:
        raise
    except Exception as e:  # a stage's own error (a host callback in the loss, a device error): named here
        raise VjpsplitError(
            f"evaluate: stage {worker.stage_index} mb {mb} failed in its evaluation program: {raised_line(e)}"
        ) from e
    return out[0] if worker.is_last and not worker.art.manifest.has_aux else out


def evaluate_here(
    workers: Sequence[StageWorker | ReplicaGroup],
    programs: Sequence[EvalProgram],
    mbs: Sequence[Microbatch],
    keep: bool = False,
) -> tuple[list[PyTree], list[PyTree]]:
    """Every microbatch of ``mbs`` through every stage (``workers[s]`` runs ``programs[s]``): per microbatch the
    loss (a device scalar, the loss and aux leaves, or a ``Parts`` of the replicas'; ``loss_and_aux``) and, with
    ``keep``, what the
    last stage received (else nothing is held)."""
    S = len(workers)
    losses, received = [], []
    for m, (x, side) in enumerate(mbs):
        for s, (w, p) in enumerate(zip(workers, programs)):
            if keep and s == S - 1:
                received.append(x)
            x = eval_stage(w, p, x, side_for(side, s, S), m)
        losses.append(x)
    return losses, received


def loss_and_aux(value: PyTree) -> tuple[float, list[np.ndarray]]:
    """A microbatch's loss as a float and its aux leaves as host arrays (none without aux), from what the last
    stage gave (``eval_stage``): for a ``Parts``, the means over the replicas (each over its part, as a step's
    loss is)."""
    if isinstance(value, Parts):
        got = [loss_and_aux(v) for v in value]
        return float(np.mean([loss for loss, _ in got])), [np.mean(a, axis=0) for a in zip(*(aux for _, aux in got))]
    if isinstance(value, tuple):  # (loss, *aux leaves)
        return float(np.asarray(value[0])), [np.asarray(a) for a in value[1:]]
    return float(np.asarray(value)), []


def joined(tree: PyTree) -> PyTree:
    """What a stage received, whole: a ``Parts`` (per replica, host arrays) joined back along axis 0."""
    if not isinstance(tree, Parts):
        return tree
    return jax.tree_util.tree_map(lambda *parts: np.concatenate(parts), *tree)


def host(tree: PyTree) -> PyTree:
    """``tree``'s arrays as host arrays (what a Ray actor hands on)."""
    return jax.tree_util.tree_map(np.asarray, tree)
