"""Microbatches of their own lengths with data_parallel replicas: each microbatch split over its stage's replicas,
each replica starting its backward from its share of the microbatch's weight; the run equals one process."""

from __future__ import annotations

import numpy as np
import optax
import pytest
from models import assert_trees_close
from stage_models import one_process_weighted, seq_loss, seq_microbatches, seq_specs

import vjpsplit_cli as vs
from vjpsplit_cli import VjpsplitError
from vjpsplit_cli import pipeline as P


def _params():
    rng = np.random.default_rng(0)
    return {
        "w0": (rng.normal(size=(4, 8)) / 2).astype(np.float32),
        "w1": (rng.normal(size=(8, 3)) / 3).astype(np.float32),
    }


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_replicas_train_weighted_microbatches_of_two_lengths_as_one_process(schedule):
    stages = vs.export_stages(seq_loss, *seq_specs(_params()), wrt="params", platforms="cpu")
    steps = []
    for t, lengths in enumerate([(8, 16, 8, 16), (16, 16, 8, 8), (8, 8, 8, 16)]):
        batches = seq_microbatches(lengths, rows=4, seed=3 + t)
        steps.append((batches, [float(x.shape[0] * x.shape[1]) for x, _ in batches]))
    kw = {"optimizer": optax.adam(1e-2), "microbatches": 4, "schedule": schedule}
    with P.Trainer(stages, _params(), runner=P.InProcess(data_parallel=2), **kw) as tr:
        losses = [tr.step(P.Microbatches(b, weights=w)) for b, w in steps]
        params = tr.params()
        odd = seq_microbatches([8, 16, 8, 16], rows=3)
        with pytest.raises(VjpsplitError, match=r"Microbatches batch 0: data_parallel=2: its 3 rows"):
            tr.step(P.Microbatches(odd))
    want, want_params = one_process_weighted(seq_loss, _params(), steps, optax.adam(1e-2))
    np.testing.assert_allclose(losses, want, rtol=1e-6)
    assert_trees_close(params, want_params, rtol=1e-6, atol=1e-7)
