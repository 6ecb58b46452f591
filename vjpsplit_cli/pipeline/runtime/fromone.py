"""The runners' ``Stages`` form: the user's whole ``params`` and batch tuple in, loss and params-shaped grads out.

Each runner keeps its per-stage form (artifacts, one parameter set per stage,
``x`` and ``side``); ``run_stages`` translates a ``Stages`` call into it and the
per-stage gradients back into ``params``' structure, tied leaves summed.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from .dispatch import PreSplit
from ..schedules.timeline import PipelineResult


def run_stages(runner: Callable, stages, params, batch, *, microbatches: int, **kwargs) -> PipelineResult:
    """``runner(artifacts, stage params, x, side, microbatches=..., **kwargs)`` on a ``Stages``; grads like ``params``."""
    result = runner(
        list(stages.artifacts),
        stages.stage_params(params),
        PreSplit(stages.stage_batch(batch, microbatches)),
        (),
        microbatches=microbatches,
        **kwargs,
    )
    return dataclasses.replace(result, grads=stages.gather_grads(result.grads, params))
