"""Residuals off the device on Ray (``Trainer(..., runner=Ray(offload=...))``): bitwise the same training."""

from __future__ import annotations

import jax
import numpy as np
import optax
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P


def _train(stages, runner, offload):
    params, tx = gpt_params(), optax.adamw(1e-2)
    batches = [gpt_batch(8, seed=70 + i) for i in range(2)]
    with P.Trainer(stages, params, optimizer=tx, schedule="1f1b", microbatches=4, runner=P.Ray(offload=offload)) as tr:
        return [tr.step(b) for b in batches], tr.params()


def test_ray_training_with_file_offload_is_bitwise_the_run_without(ray_session, tmp_path):
    stages = vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")
    off = P.Offload(to="files", directory=str(tmp_path / "off"))
    losses, params = _train(stages, "ray", off)
    ref_losses, ref_params = _train(stages, "ray", None)
    assert losses == ref_losses
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref_params)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert (tmp_path / "off").is_dir() and not list((tmp_path / "off").iterdir())  # written, read back, removed
