"""Metrics from the last stage on the Ray runner: a step's aux (sent with the losses, on the driver's socket or
through Ray) and ``evaluate``'s equal the one-process loop's."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from stage_models import aux_loss, aux_mean, dropout_batches, dropout_params, dropout_specs, one_process_with_aux

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P


def _close(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-6)


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_ray_step_history_and_evaluate_give_the_aux_of_the_one_process_loop(ray_session, schedule):
    p, _key, x, y = dropout_specs(dropout_params())
    stages = vs.export_stages(aux_loss, p, x, y, wrt="params", platforms="cpu", has_aux=True)
    batches = dropout_batches(3)
    kw = {"optimizer": optax.adam(1e-2), "microbatches": 4, "schedule": schedule, "runner": "ray"}
    with P.Trainer(stages, dropout_params(), **kw) as tr:
        got = [tr.step(batches[0], timed=True), tr.step(batches[1])]  # a timed report, then an untimed one
        evaluated = tr.evaluate(batches[2])
        got.append(tr.step(batches[2]))
        rows = [row.aux for row in tr.history]
        per_microbatch = tr.last_result.aux
    losses, auxes, _ = one_process_with_aux(aux_loss, dropout_params(), batches, 4, optax.adam(1e-2))
    np.testing.assert_allclose([loss for loss, _ in got], losses, rtol=1e-6)
    for (_, aux), row, want in zip(got, rows, auxes):
        _close(aux, aux_mean(want))
        _close(row, aux_mean(want))
    _close(per_microbatch, auxes[2])
    np.testing.assert_allclose(evaluated[0], losses[2], rtol=1e-6)
    _close(evaluated[1], aux_mean(auxes[2]))


def test_ray_pipeline_run_gives_each_microbatchs_aux_in_its_result(ray_session):
    """``RayPipeline.run`` (no Trainer): ``result.aux`` holds each microbatch's aux, as one process gives it."""
    p, _key, x, y = dropout_specs(dropout_params())
    stages = vs.export_stages(aux_loss, p, x, y, wrt="params", platforms="cpu", has_aux=True)
    batch = dropout_batches(1)[0]
    _, auxes, _ = one_process_with_aux(aux_loss, dropout_params(), [batch], 4, optax.sgd(0.0))
    with P.RayPipeline(stages, dropout_params()) as rp:
        timed = rp.run(batch, microbatches=4, schedule="1f1b")
        untimed = rp.run(batch, microbatches=4, schedule="zbh1", timed=False)
    for r in (timed, untimed):
        assert r.runner == "ray" and len(r.aux) == 4
        _close(r.aux, auxes[0])
