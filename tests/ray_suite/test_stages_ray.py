"""Stages from one function on the Ray runner: the 4-stage GPT under every schedule equals value_and_grad."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from models import assert_trees_close
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P


def test_ray_gpt_stages_equal_value_and_grad(ray_session):
    params = gpt_params()
    stages = vs.export_stages(gpt, *gpt_specs(params), wrt="params", platforms="cpu")
    batch = gpt_batch(8)
    loss, grads = jax.value_and_grad(gpt)(params, *batch)
    with P.RayPipeline(stages, params, layout="stage") as rp:
        results = [rp.run(batch, microbatches=4, schedule=name) for name in ["gpipe", "1f1b", "zbh1"]]
    # ZB-V through pipeline.run: its layout (2 workers, 2 stages each) from the schedule, in a RayPipeline of its own.
    results.append(P.run(stages, params, batch, microbatches=4, schedule="zbv", runner="ray"))
    for r in results:
        assert r.runner == "ray" and r.num_workers == (2 if r.schedule == "zbv" else 4)
        np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
        assert_trees_close(r.grads, grads, rtol=1e-4, atol=1e-6)


def test_compiled_true_with_stages_is_one_error_not_a_silent_fallback():
    params = gpt_params()
    stages = vs.export_stages(gpt, *gpt_specs(params), wrt="params", platforms="cpu")
    with pytest.raises(vs.VjpsplitError, match=r"compiled=True runs a list of artifacts.*use compiled=False"):
        P.RayPipeline(stages, params, compiled=True)
