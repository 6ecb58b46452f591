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
    for lay, names in [("stage", ["gpipe", "1f1b", "zbh1"]), ("v", ["zbv"])]:
        with P.RayPipeline(stages, params, layout=lay) as rp:
            for name in names:
                r = rp.run(batch, microbatches=4, schedule=name)
                assert r.runner == "ray" and r.num_workers == (2 if lay == "v" else 4)
                np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
                assert_trees_close(r.grads, grads, rtol=1e-4, atol=1e-6)
    r = P.run(stages, params, batch, microbatches=2, schedule="1f1b", runner="ray")
    np.testing.assert_allclose(r.loss, loss, rtol=1e-5)


def test_compiled_true_with_stages_is_one_error_not_a_silent_fallback():
    params = gpt_params()
    stages = vs.export_stages(gpt, *gpt_specs(params), wrt="params", platforms="cpu")
    with pytest.raises(vs.VjpsplitError, match=r"compiled=True runs a list of artifacts.*use compiled=False"):
        P.RayPipeline(stages, params, compiled=True)
