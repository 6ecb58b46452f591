"""The last stage's F and B of one microbatch in one compiled call, and a timed step's actions (issue 68).

Where the last stage's plan runs a microbatch's B right after its F (1F1B, not GPipe, whose Bs follow every F), F
runs both: the stage holds no residuals of that microbatch and its B only hands on the input cotangent.
A timed step runs the same actions, in the same order on each worker, as an untimed one."""

from __future__ import annotations

import statistics

import jax
import numpy as np
import optax
import pytest

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.pipeline.stages.exporting import module_flops
from vjpsplit_cli.pipeline.training.measured import seconds
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs, mean_over_microbatches

M = 4


@pytest.fixture(scope="module")
def stages():
    return vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params")


def _trainer(stages, schedule):
    d = jax.devices()[0]
    runner = P.InProcess(devices=[[d]] * len(stages))
    return P.Trainer(stages, gpt_params(), optimizer=optax.sgd(0.1), microbatches=M, schedule=schedule, runner=runner)


def _optax_steps(batch, n):
    """``n`` steps of optax's SGD on ``jax.value_and_grad`` over ``batch`` cut in ``M``: the parameters, the losses."""
    opt = optax.sgd(0.1)
    params, state, losses = gpt_params(), opt.init(gpt_params()), []
    for _ in range(n):
        loss, g = jax.value_and_grad(lambda p: mean_over_microbatches(gpt, p, batch, M))(params)
        updates, state = opt.update(g, state, params)
        params, losses = optax.apply_updates(params, updates), [*losses, float(loss)]
    return params, losses


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
    batch = gpt_batch(8)
    params, want = _optax_steps(batch, 3)
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


def test_on_one_serial_device_zbh1_runs_every_split_backward_whole(stages, monkeypatch):
    """Every stage on one device that runs one program at a time (a TPU chip's; here a CPU device said to), operation
    by operation (as stages that offload run there; the others run the step as one program,
    ``test_step_program.py``): ZB-H1's split backwards run whole, as 1F1B's: the last stage's F runs F, I and W in
    one call (no intermediates kept), the other stages' I the whole backward; every W runs nothing. The steps are
    those of optax on ``jax.value_and_grad``, and a timed step's costs still give each stage an I and a W (cut by
    FLOPs)."""
    from vjpsplit_cli.pipeline.runtime import dispatch, untimed

    monkeypatch.setattr(dispatch, "runs_serially", lambda device: True)
    monkeypatch.setattr(untimed, "_one_program", lambda stage: False)
    batch = gpt_batch(8)
    params, want = _optax_steps(batch, 2)
    calls: list[tuple[int, str]] = []
    with _trainer(stages, "zbh1") as tr:
        workers = [t.worker for t in tr.backend.trainers]
        for s, w in enumerate(workers):
            for name in ("forward_backward", "forward_backward_acc", "backward", "backward_acc"):
                real = getattr(w.calls, name)
                monkeypatch.setattr(w.calls, name, lambda *a, _r=real, _n=name, _s=s: calls.append((_s, _n)) or _r(*a))
            for name in ("backward_weight", "backward_weight_acc"):
                monkeypatch.setattr(w.calls, name, lambda *a, _n=name: pytest.fail(f"{_n} ran"))
            monkeypatch.setattr(w.calls.forward_input, "_run", lambda *a: pytest.fail("F and I alone ran"))
        got = [tr.step(batch)]
        last = len(workers) - 1
        assert sum(s == last and n.startswith("forward_backward") for s, n in calls) == M
        assert sum(s < last and n.startswith("backward") for s, n in calls) == M * last
        got.append(tr.step(batch, timed=True))  # the same calls (a cold one runs again, to be timed warm)
        assert workers[-1].peak_residual_bytes == 0
        n = len(tr.plan.plans[0])
        for s, w in enumerate(workers):
            zero = {(k, mb) for k, mb, t0, t1, _ in list(w.ring)[-n:] if t1 == t0}
            assert zero == {(k, mb) for k in (("I", "W") if s == last else ("W",)) for mb in range(M)}
        # The last stage's F call ran F, I and W: ``costs()`` cuts its time by the FLOPs of fwd and bwd, then of
        # bwd_input and bwd_weight (as a whole backward's).
        costs, art = tr.costs(), stages.artifacts[last]
        fused = statistics.median(seconds(e) for e in tr.last_result.events if e.stage == last and e.kind == "F")
        f, bwd = module_flops(art, "fwd"), module_flops(art, "bwd")
        b, w = module_flops(art, "bwd_input"), module_flops(art, "bwd_weight")
        assert costs["F"][last] == pytest.approx(fused * f / (f + bwd))
        assert costs["B"][last] == pytest.approx(fused * bwd / (f + bwd) * b / (b + w))
        assert costs["W"][last] == pytest.approx(fused * bwd / (f + bwd) * w / (b + w))
        np.testing.assert_allclose(got, want, rtol=1e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), tr.params(), params)


def test_backwards_run_whole_only_where_every_stage_shares_one_serial_device(monkeypatch):
    import types

    from vjpsplit_cli.pipeline.runtime import dispatch

    class Device:  # hashable by identity, as a jax.Device
        def __init__(self, platform):
            self.platform = platform

    cpu, tpu, tpu2 = Device("cpu"), Device("tpu"), Device("tpu")
    on = lambda *ds: [types.SimpleNamespace(device=d) for d in ds]  # noqa: E731
    assert dispatch.whole_backwards(on(tpu, tpu, tpu))
    assert not dispatch.whole_backwards(on(tpu, tpu2))  # two chips: a W put off lets the other start sooner
    assert not dispatch.whole_backwards(on(cpu, cpu))  # a CPU device runs ready programs side by side
    assert not dispatch.whole_backwards(on(None, None))  # sharded stages
    assert not dispatch.whole_backwards([types.SimpleNamespace(replicas=on(tpu))])  # a replica group
