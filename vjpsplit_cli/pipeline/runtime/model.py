"""What a runner runs, in one form: per stage an artifact and its parameters, per microbatch its inputs.

Runners take the caller's model in one of two forms, and ``model_of`` is the one
place that tells them apart:

* the per-stage form: a list of artifacts, one parameter pytree per stage, the
  batch ``x`` (stage 0's input) and ``side`` inputs (the last stage's), each split
  into microbatches along axis 0; gradients come back per stage;
* a ``Stages`` (``export_stages``): the whole ``params`` and the function's batch
  tuple; each stage gets exactly the parameter leaves and batch inputs it reads,
  and gradients come back in ``params``' structure, a tied leaf's summed.

A ``Microbatch`` is ``(x, side)``: stage 0's input and the side inputs, a list
for the last stage or a ``StageInputs`` (one list per stage that reads batch inputs).
``PreSplit`` passes microbatches already cut where ``x`` goes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from ...errors import VjpsplitError
from ..schedules.catalog import describe
from ..schedules.ops import Kind, Op
from ..stages.directory import StageInputs, Stages
from ..stages.microbatches import Microbatches
from ...treetypes import Leaf, PyTree

if TYPE_CHECKING:
    from ...artifact.artifact import Artifact

Microbatch = tuple[PyTree, "list[Leaf] | StageInputs"]  # stage 0's input (None where it reads none), the side inputs


class PreSplit:
    """A batch already cut into ``(x, side)`` microbatches (``Stages.stage_batch``), passed where ``x`` goes."""

    def __init__(self, mbs: Sequence[Microbatch]):
        self.mbs = list(mbs)


def side_for(side: list[Leaf] | StageInputs, stage: int, num_stages: int) -> list[PyTree]:
    """Stage ``stage``'s side inputs (pytrees: a stage's own reads come as one tuple): its own from a ``StageInputs``, else
    the microbatch's for the last stage."""
    if isinstance(side, StageInputs):
        return side.get(stage, [])
    return side if stage == num_stages - 1 else []


def split_batch(x: PyTree, side: Mapping[str, Leaf] | Sequence[Leaf], microbatches: int) -> list[Microbatch]:
    """The batch and its side inputs cut into ``microbatches`` equal ``(x, side)`` pieces along axis 0."""
    if isinstance(x, PreSplit):
        if len(x.mbs) != microbatches:
            raise VjpsplitError(f"{len(x.mbs)} microbatches prepared, {microbatches} asked for")
        return list(x.mbs)
    n = np.shape(x)[0]
    if n % microbatches:
        raise VjpsplitError(f"batch of {n} does not split into {microbatches} equal microbatches")
    k = n // microbatches
    sides = list(side.values()) if isinstance(side, Mapping) else list(side)
    return [(x[i * k : (i + 1) * k], [s[i * k : (i + 1) * k] for s in sides]) for i in range(microbatches)]


class Model:
    """The per-stage form: ``artifacts[s]`` runs with ``stage_params[s]``; gradients come back per stage."""

    sides_per_stage = False  # whether stages other than the last read batch inputs (a Stages)

    def __init__(self, artifacts: Sequence[Artifact], stage_params: Sequence[PyTree]):
        self.artifacts = list(artifacts)
        self.stage_params = list(stage_params)
        if len(self.stage_params) != len(self.artifacts):
            raise VjpsplitError(f"{len(self.artifacts)} stages but {len(self.stage_params)} parameter sets")

    @property
    def num_stages(self) -> int:
        """How many stages the model has."""
        return len(self.artifacts)

    def microbatches(self, x: PyTree, side: Mapping[str, Leaf] | Sequence[Leaf], microbatches: int) -> list[Microbatch]:
        """A runner's ``x`` and ``side`` as microbatches."""
        return split_batch(x, side, microbatches)

    def batch_microbatches(
        self,
        batch: tuple[PyTree, ...] | Microbatches,
        microbatches: int,
        replicas: int = 1,
        keys: Sequence[Leaf] | None = None,
    ) -> list[Microbatch]:
        """The Trainer's batch tuple (``(x, *side)`` here) as microbatches (``replicas``, ``keys``: see
        ``StagesModel``'s; the per-stage form reads no key, and the Trainer gives it none).

        Raises:
            VjpsplitError: a ``Microbatches``, which only a ``Stages`` takes (it checks their shapes).
        """
        if isinstance(batch, Microbatches):
            raise VjpsplitError(
                "Microbatches: the per-stage form (a list of artifacts) takes one batch per step; export the "
                "function with export_stages, whose Stages checks each microbatch's shapes"
            )
        return split_batch(batch[0], list(batch[1:]), microbatches)

    def gather(self, grads: list[PyTree]) -> PyTree:
        """Per-stage gradients in the caller's form: here, as they are."""
        return grads

    def check_plans(self, name: str, plans: Sequence[Sequence[Op]]) -> None:
        """Refuse plans the stages cannot run: a stage with an I or a W in them needs the split backward."""
        need = {o.stage for ops in plans for o in ops if o.kind in (Kind.I, Kind.W)}
        for i, a in enumerate(self.artifacts):
            if i in need and not a.manifest.splits_backward:
                raise VjpsplitError(
                    f"{describe(name)} needs the split backward: export stage {i} with "
                    f"weights=('{a.manifest.arg_names[0]}',)"
                )


class StagesModel(Model):
    """A ``Stages`` and the whole ``params``: the batch is the function's batch tuple, gradients like ``params``."""

    sides_per_stage = True

    def __init__(self, stages: Stages, params: PyTree):
        super().__init__(stages.artifacts, stages.stage_params(params))
        self.stages, self.params = stages, params

    def microbatches(self, x: PyTree, side: Mapping[str, Leaf] | Sequence[Leaf], microbatches: int) -> list[Microbatch]:
        """``x`` is the batch tuple (a ``Stages`` takes no separate side inputs)."""
        if isinstance(x, PreSplit):
            return split_batch(x, (), microbatches)
        if len(side):
            raise VjpsplitError(
                "a Stages takes the batch inputs as one tuple in the function's argument order; pass them all as x"
            )
        return list(self.stages.stage_batch(x, microbatches))

    def batch_microbatches(
        self,
        batch: tuple[PyTree, ...] | Microbatches,
        microbatches: int,
        replicas: int = 1,
        keys: Sequence[Leaf] | None = None,
    ) -> list[Microbatch]:
        """The function's batch tuple as microbatches: each stage's batch inputs go to it; each stage call's rows
        (``replicas`` per microbatch) checked against the export's first dims (``Stages.stage_batch``); ``keys``:
        one PRNG key per microbatch, where the function takes one. ``Microbatches``: each batch tuple one
        microbatch, as it is (``Stages.stage_microbatches``)."""
        if isinstance(batch, Microbatches):
            return list(self.stages.stage_microbatches(batch, replicas, keys))
        return list(self.stages.stage_batch(batch, microbatches, replicas, keys))

    def gather(self, grads: list[PyTree]) -> PyTree:
        """Per-stage gradients as one pytree like ``params``, a tied leaf's summed."""
        return self.stages.gather_grads(grads, self.params)


def model_of(artifacts: Sequence[Artifact] | Stages, params: PyTree) -> Model:
    """The runners' one form of the caller's model: a ``Stages`` with the whole ``params``, or the per-stage form."""
    if isinstance(artifacts, Stages):
        return StagesModel(artifacts, params)
    return Model(artifacts, params)
