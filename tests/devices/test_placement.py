"""Every stage on a device of its own, on 4 CPU devices: where parameters, optimizer state, residuals,
activations and cotangents live, and that N Trainer steps still equal N optax steps in one process."""

from __future__ import annotations

import functools
import warnings

import jax
import numpy as np
import optax
import pytest
from models import assert_trees_close, optax_reference
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs, mlp, mlp_params

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.pipeline.runtime.devices import SharedDevicesWarning
from vjpsplit_cli.pipeline.runtime.evaluation import eval_stage
from vjpsplit_cli.pipeline.runtime.model import side_for

D = jax.local_devices()


@functools.lru_cache(maxsize=None)
def _stages():
    return vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")


def _on(tree, device) -> bool:
    leaves = [a for a in jax.tree_util.tree_leaves(tree) if isinstance(a, jax.Array)]
    return bool(leaves) and all(a.devices() == {device} for a in leaves)


def _train(n: int = 3, **kw):
    """A Trainer over the tied-embedding GPT, ``n`` steps (the last timed) checked against optax in one process."""
    params, tx = gpt_params(), optax.adam(1e-2)
    batches = [gpt_batch(8, seed=40 + i) for i in range(n)]
    tr = P.Trainer(_stages(), params, optimizer=tx, microbatches=4, **kw)
    losses = [tr.step(b, timed=i == n - 1) for i, b in enumerate(batches)]
    ref_losses, ref_params = optax_reference(gpt, params, tx, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(tr.params(), ref_params, rtol=1e-4, atol=1e-6)
    assert tr.last_result.timed and {e.stage for e in tr.last_result.events} == {0, 1, 2, 3}
    return tr


def _state_lives_on(tr, want) -> None:
    """Stage s's parameters and optimizer state (every array of it) on ``want[s]``, as ``placement`` says."""
    assert tr.placement == [(d,) for d in want]
    for t, d in zip(tr.backend.trainers, want):
        assert _on(t.params, d) and _on(t.worker.params, d), t.stage_index
        assert _on(t.state, d), (t.stage_index, {k: v.devices() for k, v in t.state.items()})


def _one_microbatch_by_hand(tr, want) -> None:
    """F through every stage, then B back: residuals stay on their stage's device; what crosses is moved there."""
    workers = [t.worker for t in tr.backend.trainers]
    x, side = _stages().stage_batch(gpt_batch(8, seed=3), 4)[0]
    for w in workers:
        w.reset(timed=False)
    h = x
    for s, w in enumerate(workers):
        h = w.forward(0, h, side_for(side, s, 4))
        assert _on(w.res[0], want[s]), s  # the residuals, and the inputs they hold (the activation moved here)
        assert _on(h, want[s]), s  # made here; the next stage moves it to its own device
    ct = None
    for s in reversed(range(4)):
        ct = workers[s].backward(0, ct, 4)
        if s:
            assert _on(ct, want[s]), s
        assert _on(workers[s].grads, want[s]), s
    for w in workers:
        w.reset()


def _evaluates_on(tr, want) -> None:
    """evaluate: each stage's forward-only program runs on its stage's device; the one-process loss."""
    workers, programs = [t.worker for t in tr.backend.trainers], _stages().evaluation
    batch = gpt_batch(8, seed=4)
    x, side = _stages().stage_batch(batch, 4)[0]
    for s, (w, p) in enumerate(zip(workers, programs)):
        x = eval_stage(w, p, x, side_for(side, s, 4), 0)
        assert _on(x, want[s]), s  # made on the stage's device, from what was moved there
    assert all(not w.res for w in workers)
    ref = float(gpt(tr.params(), *batch))
    assert abs(tr.evaluate(batch) - ref) <= 1e-6 * abs(ref)


def test_default_placement_puts_each_of_4_stages_on_its_own_device():
    with warnings.catch_warnings():
        warnings.simplefilter("error", SharedDevicesWarning)  # 4 stages on 4 devices share none
        tr = _train(schedule="1f1b")
    assert len({t.worker.device for t in tr.backend.trainers}) == 4
    _state_lives_on(tr, D[:4])
    _one_microbatch_by_hand(tr, D[:4])


def test_explicit_devices_are_respected():
    backwards = D[::-1]
    tr = _train(schedule="zbh1", runner=P.InProcess(devices=[[d] for d in backwards]))
    _state_lives_on(tr, backwards)
    _one_microbatch_by_hand(tr, backwards)
    _evaluates_on(tr, backwards)


def test_zbv_puts_each_workers_two_stages_on_its_device():
    # Two of the 4 devices stay idle: said, with the fix (issue 67: ZB-V on 2 stages ran both on device 0 silently).
    said = (
        r"ZB-V puts 2 stages on each worker: 4 stages make 2 workers on 2 of this host's 4 devices, so stages 0 and "
        r"3 share one device \(one after another\) while 2 stay idle; .*'1f1b', 'zbh1'\), or cut the model into 8 stages"
    )
    with pytest.warns(SharedDevicesWarning, match=said):
        tr = _train(schedule="zbv")  # 2 workers: worker 0 holds stages 0 and 3, worker 1 stages 1 and 2
    assert tr.last_result.num_workers == 2
    _state_lives_on(tr, [D[0], D[1], D[1], D[0]])


def test_zbv_on_two_stages_says_both_share_one_device():
    params = mlp_params(width=8, layers=2)
    (b,) = jax.export.symbolic_shape("b")
    spec = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    batch = (jax.ShapeDtypeStruct((b, 8), np.float32), jax.ShapeDtypeStruct((b,), np.int32))
    stages = vs.export_stages(mlp, spec, *batch, wrt="params", platforms="cpu", stages=2)
    with pytest.warns(
        SharedDevicesWarning, match=r"2 stages make 1 worker on 1 of this host's 4 devices, so stages 0 "
    ):
        tr = P.Trainer(stages, params, optimizer=optax.sgd(0.1), schedule="zbv", microbatches=2)
    assert tr.placement == [(D[0],)] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", SharedDevicesWarning)  # a device per stage, or devices given: nothing to say
        P.Trainer(stages, params, optimizer=optax.sgd(0.1), schedule="zbh1", microbatches=2).close()
        P.Trainer(
            stages, params, optimizer=optax.sgd(0.1), schedule="zbv", microbatches=2,
            runner=P.InProcess(devices=[[D[0]], [D[0]]]),
        ).close()  # fmt: skip
    tr.close()


def test_interleaved_workers_stages_share_the_workers_device():
    tr = _train(schedule="interleaved1f1b")  # 2 workers, round robin: stages 0 and 2, 1 and 3
    _state_lives_on(tr, [D[0], D[1], D[0], D[1]])


def test_a_restored_run_goes_back_onto_each_stages_device(tmp_path):
    """A checkpoint arrives from host memory: restore (and fit, resuming from it) put it on the stages' devices."""
    tr = _train(schedule="1f1b", runner=P.InProcess(devices=[[d] for d in D[::-1]]))
    tr.save(tmp_path / "ck")
    again = P.Trainer.restore(
        tmp_path / "ck", _stages(), optimizer=optax.adam(1e-2), runner=P.InProcess(devices=[[d] for d in D[::-1]])
    )
    _state_lives_on(again, D[::-1])
    again.step(gpt_batch(8, seed=50))
    again.fit(lambda step: gpt_batch(8, seed=50 + step), steps=4, checkpoint_dir=tmp_path / "ck")  # from step 3
    assert again.step_count == 4
    _state_lives_on(again, D[::-1])


def test_more_workers_than_devices_share_the_default_device():
    params = mlp_params(width=8, layers=8)
    (b,) = jax.export.symbolic_shape("b")
    spec = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    batch = (jax.ShapeDtypeStruct((b, 8), np.float32), jax.ShapeDtypeStruct((b,), np.int32))
    stages = vs.export_stages(mlp, spec, *batch, wrt="params", platforms="cpu", stages=8)
    rng = np.random.default_rng(5)
    batches = [(rng.normal(size=(8, 8)).astype(np.float32), rng.integers(0, 4, 8).astype(np.int32)) for _ in range(2)]
    tx = optax.sgd(0.1)
    with pytest.warns(
        SharedDevicesWarning,
        match="8 workers need 8 devices but this host has 4 cpu devices.*xla_force_host_platform_device_count=8",
    ):
        tr = P.Trainer(stages, params, optimizer=tx, schedule="1f1b", microbatches=2)  # 8 workers, 4 devices
    losses = [tr.step(b) for b in batches]
    assert tr.placement == [(D[0],)] * 8
    ref_losses, ref_params = optax_reference(mlp, params, tx, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(tr.params(), ref_params, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("timed", [False, True])
def test_run_inprocess_on_devices_equals_value_and_grad(timed):
    params, batch = gpt_params(), gpt_batch(8, seed=7)
    loss, grads = jax.value_and_grad(gpt)(params, *batch)
    r = P.run_inprocess(_stages(), params, batch, microbatches=4, schedule="zbh1", timed=timed)
    np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
    assert_trees_close(r.grads, grads, rtol=1e-5, atol=1e-6)
    assert r.timed is timed and (len(r.events) > 0) is timed
    # Each block's gradient where its stage ran; the tied embedding's summed onto its first holder's device.
    assert _on(r.grads["blocks"][0]["w"], D[1]) and _on(r.grads["blocks"][1]["w"], D[2])
    assert _on(r.grads["embed"], D[0])


def test_a_device_list_per_stage_is_checked():
    params, batch = gpt_params(), gpt_batch(8)
    with pytest.raises(vs.VjpsplitError, match="4 stages but 2 device groups"):
        P.run_inprocess(_stages(), params, batch, microbatches=4, devices=[[D[0]], [D[1]]])
    with pytest.raises(vs.VjpsplitError, match="stage 1 is not sharded: give it one device, not 2"):
        P.run_inprocess(_stages(), params, batch, microbatches=4, devices=[[D[0]], D[:2], [D[2]], [D[3]]])
