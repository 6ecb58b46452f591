"""Microbatches of their own lengths on the Ray runner: weighted, they train as one process on the same ones."""

from __future__ import annotations

import numpy as np
import optax
import pytest
from stage_models import one_process_weighted, seq_loss, seq_microbatches, seq_specs

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P


def _params():
    rng = np.random.default_rng(0)
    return {
        "w0": (rng.normal(size=(4, 8)) / 2).astype(np.float32),
        "w1": (rng.normal(size=(8, 3)) / 3).astype(np.float32),
    }


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_ray_microbatches_of_two_lengths_train_as_one_process_weighted(ray_session, schedule):
    """The last stage's actor starts each backward from its microbatch's weight: losses, clipped updates and
    ``evaluate`` are those of the weighted mean in one process; the third step is timed."""
    stages = vs.export_stages(seq_loss, *seq_specs(_params()), wrt="params", platforms="cpu")
    steps = []
    for t, lengths in enumerate([(8, 16, 8, 16), (16, 16, 8, 8), (8, 8, 8, 16)]):
        batches = seq_microbatches(lengths, seed=3 + t)
        steps.append((batches, [float(x.shape[0] * x.shape[1]) for x, _ in batches]))
    kw = {"optimizer": optax.adam(1e-2), "microbatches": 4, "schedule": schedule, "runner": "ray"}
    with P.Trainer(stages, _params(), clip_global_norm=0.05, **kw) as tr:
        losses = [tr.step(P.Microbatches(b, weights=w)) for b, w in steps[:2]]
        evaluated = tr.evaluate(P.Microbatches(steps[2][0], weights=steps[2][1]))
        losses.append(tr.step(P.Microbatches(steps[2][0], weights=steps[2][1]), timed=True))
        params = tr.params()
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    want, want_params = one_process_weighted(seq_loss, _params(), steps, tx)
    np.testing.assert_allclose(losses, want, rtol=1e-6)
    np.testing.assert_allclose(evaluated, want[2], rtol=1e-6)
    for k in params:
        np.testing.assert_allclose(params[k], want_params[k], rtol=1e-6, atol=1e-7)
