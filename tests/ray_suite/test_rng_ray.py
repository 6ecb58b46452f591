"""A PRNG key per microbatch on the Ray runner: dropout trains as the one-process loop over microbatch keys."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from stage_models import (
    dropout_batches,
    dropout_loss,
    dropout_params,
    dropout_specs,
    one_process_with_keys,
    split_key_loss,
)

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P

KEY = jax.random.key(7)


@pytest.mark.parametrize(("fn", "schedule"), [(dropout_loss, "1f1b"), (split_key_loss, "zbh1")])
def test_ray_dropout_trains_as_the_one_process_loop_over_microbatch_keys(ray_session, fn, schedule):
    """Every stage's actor reads the microbatch's key (``dropout_loss``), or gets a key split on the stage before
    (``split_key_loss``: sent actor to actor as key data); ``evaluate`` takes the next step's keys."""
    stages = vs.export_stages(fn, *dropout_specs(dropout_params()), wrt="params", platforms="cpu")
    batches = dropout_batches(3)
    kw = {"optimizer": optax.adam(1e-2), "microbatches": 4, "schedule": schedule, "runner": "ray", "rng": KEY}
    with P.Trainer(stages, dropout_params(), **kw) as tr:
        losses = [tr.step(b) for b in batches[:2]]
        evaluated = tr.evaluate(batches[2])
        losses.append(tr.step(batches[2]))
    want, _ = one_process_with_keys(fn, dropout_params(), KEY, batches, 4, optax.adam(1e-2))
    np.testing.assert_allclose(losses, want, rtol=1e-6)
    np.testing.assert_allclose(evaluated, want[2], rtol=1e-6)
