"""The Trainer's evaluation: the loss (and outputs) of every stage's forward only, where the stages live.

``TrainerEvaluation`` is the part of ``trainer.Trainer`` that runs each stage's
evaluation program (``stages.evalprograms``) on the workers (``backend``), with the
parameters they hold now: no residuals, no gradients, no update. ``Trainer`` sets
the attributes it declares.

May import ``backend``, ``microbatch_keys``, ``step_aux`` and ``arguments`` of this room, ``runtime``, ``stages``, and the layers below ``pipeline``.
"""

from __future__ import annotations

from typing import Literal, Sequence, overload

import jax

from ...artifact.artifact import Artifact
from ...errors import VjpsplitError
from ...treetypes import PyTree
from ..runtime.model import Model
from ..runtime.result import aux_per_microbatch, step_loss
from ..stages.directory import Stages
from ..stages.evalprograms import EvalProgram, missing
from ..stages.microbatches import Microbatches
from .arguments import checked_microbatches
from .backend import Backend
from .microbatch_keys import microbatch_keys
from .step_aux import reduced


class TrainerEvaluation:
    """``Trainer.evaluate`` (the module docstring); its attributes are the Trainer's."""

    backend: Backend
    stages: Stages | Sequence[Artifact]
    model: Model
    microbatches: int
    data_parallel: int
    rng: jax.Array | None
    step_count: int
    aux: str | None

    @overload
    def evaluate(
        self,
        batch: tuple[PyTree, ...] | Microbatches,
        *,
        microbatches: int | None = None,
        outputs: Literal[False] = False,
    ) -> float | tuple[float, PyTree]: ...

    @overload
    def evaluate(
        self, batch: tuple[PyTree, ...] | Microbatches, *, microbatches: int | None = None, outputs: Literal[True]
    ) -> tuple[float, list[PyTree]] | tuple[float, PyTree, list[PyTree]]: ...

    @overload
    def evaluate(
        self, batch: tuple[PyTree, ...] | Microbatches, *, microbatches: int | None = None, outputs: bool
    ) -> float | tuple[float, PyTree] | tuple[float, PyTree, list[PyTree]]: ...

    def evaluate(
        self, batch: tuple[PyTree, ...] | Microbatches, *, microbatches: int | None = None, outputs: bool = False
    ) -> float | tuple[float, PyTree] | tuple[float, PyTree, list[PyTree]]:
        """The loss on ``batch`` from every stage's forward only: no residuals, no gradients, no update.

        Each stage runs its evaluation program (``export_stages`` writes one beside each artifact: the stage's
        forward without residual outputs) where the stage lives, in-process or on its Ray actor, with the
        parameters it holds now; activations go from stage to stage as in a step. The loss is the mean over the
        microbatches, as a step's is (the function's loss on the whole batch, for a mean loss). Parameters,
        optimizer state, the step count and the history do not change.

        Args:
            batch: the function's batch inputs as a tuple, as ``step`` takes them; or ``Microbatches`` (as many as
                it holds; the loss their weighted mean, as a step's).
            microbatches: how many microbatches to cut ``batch`` into (default: the Trainer's; not with
                ``Microbatches``).
            outputs: also return the model's output: per microbatch, the tuple of arrays the last stage
                received (what the stage before it sends on, e.g. the hidden state before the loss).

        Returns:
            The loss (a float); with ``outputs=True``, ``(loss, outputs)``. For stages whose function returns
            ``(loss, aux)``: ``(loss, aux)``, or ``(loss, aux, outputs)``, the aux as a step's (the Trainer's
            ``aux=``).

        Raises:
            VjpsplitError: ``microbatches`` is not an int >= 1, or given with ``Microbatches``; the Trainer runs the per-stage form, or a stage has
                no evaluation program (a stages directory saved by an older vjpsplit, or a sharded stage): the message
                says how to export again.
        """
        m = self.microbatches if microbatches is None else checked_microbatches(microbatches)
        scales = None
        if isinstance(batch, Microbatches):
            if microbatches is not None:
                raise VjpsplitError("evaluate: Microbatches are the microbatches; give no microbatches= with them")
            m, scales = len(batch), batch.scales
        programs = self._eval_programs()
        keys = None if self.rng is None else microbatch_keys(self.rng, self.step_count, m)
        mbs = self.model.batch_microbatches(batch, m, self.data_parallel, keys)
        losses, aux_leaves, received = self.backend.evaluate(mbs, programs, outputs)
        loss = step_loss(dict(enumerate(losses)), m, scales)
        per = aux_per_microbatch(self.model.artifacts[-1], dict(enumerate(aux_leaves)), m)
        if self.aux is None or per is None:
            return (loss, received) if outputs and received is not None else loss  # received: given with outputs
        aux = reduced(per, self.aux)
        return (loss, aux, received) if outputs and received is not None else (loss, aux)

    def _eval_programs(self) -> list[EvalProgram]:
        if not isinstance(self.stages, Stages):
            raise VjpsplitError(
                "evaluate runs the evaluation programs of a Stages (export_stages); this Trainer runs a list of "
                "artifacts: train a Stages to evaluate"
            )
        lacking = [s for s, p in enumerate(self.stages.evaluation) if p is None]
        if lacking:
            raise VjpsplitError(missing(self.stages.index.function, lacking))
        return [p for p in self.stages.evaluation if p is not None]
