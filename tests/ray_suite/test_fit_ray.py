"""Trainer.fit on Ray after a lost worker: replaced, back to the last checkpoint, the run as if it never failed."""

from __future__ import annotations

import os
import signal

import jax
import numpy as np
import optax
import pytest
from models import assert_trees_close
from stage_models import gpt_batch, gpt_params, gpt_specs

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError


def _two(params, tokens, mask, labels):
    """A 2-stage GPT: the tied embedding on both stages."""
    emb = jax.numpy.take(params["embed"], tokens, axis=0)
    h = jax.numpy.tanh(emb @ params["blocks"][0]["w"]) * mask[..., None]
    h = vs.stage_boundary((h, emb))
    h = jax.numpy.tanh(h[0] @ params["blocks"][1]["w"]) + h[1]
    lp = jax.nn.log_softmax(h @ params["embed"].T)
    return -jax.numpy.mean(jax.numpy.take_along_axis(lp, labels[..., None], -1))


@pytest.fixture(scope="module")
def stages():
    return vs.export_stages(_two, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")


BATCHES = [gpt_batch(8, seed=60 + i) for i in range(6)]
KW = dict(optimizer=optax.adamw(1e-2), schedule="1f1b", microbatches=2)


@pytest.mark.timeout(600)
def test_fit_survives_a_killed_actor_and_a_killed_process(ray_session, stages, tmp_path):
    def _die_at_next_backward(actor):
        """Run inside the actor: its process ends (SIGKILL) when it starts its next B, in the middle of a step."""
        from vjpsplit_cli.pipeline.runtime.ray import lists as module  # each step's list runs its ops there
        from vjpsplit_cli.pipeline.schedules.ops import Kind

        real = module.run_op

        def run_op(stage, op, *args):
            if op.kind in (Kind.B, Kind.I):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(stage, op, *args)

        module.run_op = run_op

    never = P.Trainer(stages, gpt_params(), **KW)  # in-process: the same programs, a run that never failed
    want = never.fit(BATCHES, steps=6)
    done, asked = set(), []

    def data(step):
        asked.append(step)
        return BATCHES[step]

    def callback(step, loss):
        if step == 2 and "kill" not in done:  # after step 2, between steps: the actor killed
            done.add("kill")
            ray_session.kill(tr.workers()[1])
        if step == 4 and "sigkill" not in done:  # during step 5: its process killed
            done.add("sigkill")
            ray_session.get(tr.workers()[0].__ray_call__.remote(_die_at_next_backward))

    with P.Trainer(stages, gpt_params(), runner="ray", **KW) as tr:
        first = tr.workers()
        losses = tr.fit(
            data, steps=6, checkpoint_dir=tmp_path / "ck", checkpoint_every=2, max_restarts=2, callback=callback
        )
        got = tr.params()
        assert all(a is not b for a, b in zip(tr.workers(), first))  # both replaced
        restarts = [(r.step, r.workers, r.returned_to) for r in tr.restarts]
    np.testing.assert_allclose(losses, want, rtol=1e-6)
    assert_trees_close(got, never.params(), rtol=1e-6, atol=1e-7)
    assert restarts == [(3, (1,), 2), (5, (0,), 4)]
    assert asked == [0, 1, 2, 3, 2, 3, 4, 5, 4, 5]  # the steps since each checkpoint, again from data
    assert P.load_checkpoint(tmp_path / "ck", optimizer=KW["optimizer"])[2] == 6


@pytest.mark.timeout(300)  # far below step_timeout (600 s): the loss is reported by Ray, not waited out
def test_a_lost_worker_beyond_max_restarts_or_without_a_checkpoint_is_one_error(ray_session, stages, tmp_path):
    with P.Trainer(stages, gpt_params(), runner="ray", **KW) as tr:

        def kill_after_first(step, loss):
            if step == 0:
                ray_session.kill(tr.workers()[1])

        with pytest.raises(
            VjpsplitError, match=r"^stage 1: its Ray actor was lost at step 1 \(.+\); max_restarts=0 allows no restart$"
        ):
            tr.fit(BATCHES, steps=4, checkpoint_dir=tmp_path / "ck", checkpoint_every=1, callback=kill_after_first)
        with pytest.raises(
            VjpsplitError, match=r"^stage 1: its Ray actor was lost at step 1 .*there is no checkpoint to return to"
        ):
            tr.fit(BATCHES, steps=4, max_restarts=1)
