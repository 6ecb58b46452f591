"""The last stage's F and B of one microbatch in one compiled call, and a timed step's actions (issue 68).

Where the last stage's plan runs a microbatch's B right after its F (1F1B, not GPipe, whose Bs follow every F), F
runs both: the stage holds no residuals of that microbatch and its B only hands on the input cotangent.
A timed step runs the same actions, in the same order on each worker, as an untimed one."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs, mean_over_microbatches

M = 4


@pytest.fixture(scope="module")
def stages():
    return vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params")


def _trainer(stages, schedule):
    d = jax.devices()[0]
    runner = P.InProcess(devices=[[d]] * len(stages))
    return P.Trainer(stages, gpt_params(), optimizer=optax.sgd(0.1), microbatches=M, schedule=schedule, runner=runner)


@pytest.mark.parametrize("schedule, fused", [("1f1b", {0, 1, 2, 3}), ("gpipe", set())])
def test_the_last_stage_runs_b_inside_f_where_it_follows(stages, schedule, fused, monkeypatch):
    calls = []
    batch = gpt_batch(8)
    loss, _ = jax.value_and_grad(lambda p: mean_over_microbatches(gpt, p, batch, M))(gpt_params())
    with _trainer(stages, schedule) as tr:
        last = tr.backend.trainers[-1].worker
        for name in ("forward_backward", "forward_backward_acc", "backward", "backward_acc"):
            real = getattr(last.calls, name)
            monkeypatch.setattr(last.calls, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
        got = tr.step(batch)
        # F and B in one call for the fused microbatches, the plain backward for the rest; no residual kept.
        assert sum(c.startswith("forward_backward") for c in calls) == len(fused)
        assert sum(c.startswith("backward") for c in calls) == M - len(fused)
        if len(fused) == M:
            assert last.peak_residual_bytes == 0
        b_times = [(mb, t1 - t0) for kind, mb, t0, t1, _ in last.ring if kind == "B"]
        assert {mb for mb, dt in b_times if dt == 0} == fused
    np.testing.assert_allclose(got, float(loss), rtol=1e-6)


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1", "gpipe"])
def test_a_timed_step_runs_the_untimed_steps_actions_in_its_order(stages, schedule):
    batch = gpt_batch(8)
    with _trainer(stages, schedule) as tr:
        tr.step(batch)
        workers = [t.worker for t in tr.backend.trainers]
        untimed = [[(k, mb) for k, mb, *_ in w.ring][-len(tr.plan.plans[i]) :] for i, w in enumerate(workers)]
        tr.step(batch, timed=True)
        timed = [[(k, mb) for k, mb, *_ in w.ring][-len(tr.plan.plans[i]) :] for i, w in enumerate(workers)]
        planned = [[(op.kind, op.mb) for op in ops] for ops in tr.plan.plans]
    assert untimed == timed == planned


def test_zbh1_runs_the_last_stages_i_inside_its_f_and_the_first_stages_w_inside_its_i(stages, monkeypatch):
    """ZB-H1: the last stage's I follows its F, so (once an unfused F showed where W's inputs are) F runs both and
    keeps only W's intermediates; the first stage's W follows its I, which hands nothing on, so I runs the whole
    backward and W nothing. The steps are those of optax on ``jax.value_and_grad``."""
    batch, opt = gpt_batch(8), optax.sgd(0.1)
    params, state, want = gpt_params(), opt.init(gpt_params()), []
    for _ in range(3):
        loss, g = jax.value_and_grad(lambda p: mean_over_microbatches(gpt, p, batch, M))(params)
        updates, state = opt.update(g, state, params)
        params, want = optax.apply_updates(params, updates), [*want, float(loss)]
    fused = []
    with _trainer(stages, "zbh1") as tr:
        first, last = tr.backend.trainers[0].worker, tr.backend.trainers[-1].worker
        real = last.calls.forward_input._run
        monkeypatch.setattr(last.calls.forward_input, "_run", lambda *a: fused.append(1) or real(*a))
        got = [tr.step(batch)]
        assert len(fused) >= M - 1  # an unfused F showed where W's inputs are (this step's first, or before)
        n1 = len(fused)
        got += [tr.step(batch), tr.step(batch)]
        assert len(fused) - n1 == 2 * M
        n = len(tr.plan.plans[0])
        zero = {w: {(k, mb) for k, mb, t0, t1, _ in list(w.ring)[-n:] if t1 == t0} for w in (first, last)}
        assert zero[last] == {("I", mb) for mb in range(M)} and zero[first] == {("W", mb) for mb in range(M)}
        np.testing.assert_allclose(got, want, rtol=1e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), tr.params(), params)
