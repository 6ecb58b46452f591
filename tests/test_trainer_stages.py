"""pipeline.Trainer on a Stages (export_stages' GPT, tied embedding): N steps equal N steps of optax in one process."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from models import assert_trees_close, optax_reference
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError

# What jax names its runtime errors: JaxRuntimeError (XlaRuntimeError on older jax, 0.6.2 among them).
RUNTIME_ERROR = jax.errors.JaxRuntimeError.__name__


@functools.lru_cache(maxsize=None)
def _stages():
    return vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")


def _batches(n, size=8):
    return [gpt_batch(size, seed=10 + i) for i in range(n)]


def _tied_copies(trainer):
    return [p["params/embed"] for p, _ in trainer.backend.snapshots() if "params/embed" in p]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbh1", "zbv"])
def test_steps_equal_single_process_optax(schedule):
    params, batches, tx = gpt_params(), _batches(3), optax.adamw(1e-2)
    tr = P.Trainer(_stages(), params, optimizer=tx, schedule=schedule, microbatches=4)
    losses = [tr.step(b, timed=i == 2) for i, b in enumerate(batches)]  # the last step timed: the same numbers
    ref_losses, ref_params = optax_reference(gpt, params, tx, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[0] != losses[-1]
    got = tr.params()
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(params)
    assert_trees_close(got, ref_params, rtol=1e-4, atol=1e-6)
    copies = _tied_copies(tr)
    assert len(copies) == 2  # the first and the last stage hold the embedding
    np.testing.assert_array_equal(copies[0], copies[1])  # bitwise
    assert not np.array_equal(copies[0], params["embed"])
    assert len(tr.backend.trainers) == 4 and tr.last_result.num_workers == (2 if schedule == "zbv" else 4)
    h = tr.history
    assert [e.step for e in h] == [1, 2, 3] and all(e.grad_norm > 0 and e.step_time > 0 for e in h)
    assert all(np.isnan(e.bubble) and np.isnan(e.modeled_bubble) for e in h[:2])  # untimed: no timeline
    assert 0 <= h[2].bubble < 1 and 0 <= h[2].modeled_bubble < 1
    assert {e.stage for e in tr.last_result.events} == {0, 1, 2, 3} and tr.last_result.timed
    # One device here: every stage shares it (tests/devices checks a device each).
    assert tr.placement == [(jax.devices()[0],)] * 4
    assert all(a.devices() == {jax.devices()[0]} for t in tr.backend.trainers for a in t.params.values())


def test_global_norm_clipping_equals_optax_chain():
    params, batches, c = gpt_params(), _batches(3), 0.5
    tx = optax.sgd(0.1, momentum=0.9)
    tr = P.Trainer(_stages(), params, optimizer=tx, schedule="1f1b", microbatches=2, clip_global_norm=c)
    losses = [tr.step(b) for b in batches]
    assert min(h.grad_norm for h in tr.history) > 2 * c  # clipping acts on every step, so this can fail
    ref_losses, ref_params = optax_reference(gpt, params, optax.chain(optax.clip_by_global_norm(c), tx), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(tr.params(), ref_params, rtol=1e-4, atol=1e-6)
    # The norm counts the tied embedding once: it equals optax's over params' structure.
    g = jax.grad(gpt)(params, *batches[0])
    np.testing.assert_allclose(tr.history[0].grad_norm, float(optax.tree.norm(g)), rtol=1e-5)
    unclipped = optax_reference(gpt, params, tx, batches)[0]
    assert not np.allclose(unclipped[1:], ref_losses[1:], rtol=1e-5)  # the clipping changed the run


def test_save_after_3_steps_and_restore_continue_the_run(tmp_path):
    params, batches = gpt_params(), _batches(5)
    kw = dict(optimizer=optax.adamw(optax.linear_schedule(1e-2, 1e-3, 5)), schedule="zbh1", microbatches=4)
    never_stopped = P.Trainer(_stages(), params, **kw)
    losses = [never_stopped.step(b) for b in batches]
    first = P.Trainer(_stages(), params, **kw)
    for b in batches[:3]:
        first.step(b)
    first.save(tmp_path / "ck")
    first.save(tmp_path / "ck")  # an existing checkpoint is replaced whole
    again = P.Trainer.restore(tmp_path / "ck", _stages(), **kw)
    assert again.step_count == 3
    later = [again.step(b) for b in batches[3:]]
    np.testing.assert_array_equal(later, losses[3:])  # the same programs on the same arrays: bitwise
    assert_trees_close(again.params(), never_stopped.params(), rtol=0, atol=0)
    ref_losses, _ = optax_reference(gpt, params, optax.adamw(optax.linear_schedule(1e-2, 1e-3, 5)), batches)
    np.testing.assert_allclose(later, ref_losses[3:], rtol=1e-5)


def test_bad_arguments_are_one_clear_error(tmp_path):
    params = gpt_params()
    with pytest.raises(VjpsplitError, match="unknown runner 'mpi'"):
        P.Trainer(_stages(), params, optimizer=optax.sgd(0.1), microbatches=2, runner="mpi")
    with pytest.raises(VjpsplitError, match="clip_global_norm=-1"):
        P.Trainer(_stages(), params, optimizer=optax.sgd(0.1), microbatches=2, clip_global_norm=-1)
    with pytest.raises(VjpsplitError, match="not an optax GradientTransformation"):
        P.Trainer(_stages(), params, optimizer=object(), microbatches=2)
    with pytest.raises(VjpsplitError, match="is not a vjpsplit checkpoint"):
        P.Trainer.restore(tmp_path, _stages(), optimizer=optax.sgd(0.1), microbatches=2)


def test_progress_bar_and_loss_plot(tmp_path, capsys):
    params, batches = gpt_params(), _batches(2)
    with P.Trainer(
        _stages(), params, optimizer=optax.adam(1e-2), microbatches=2, observe=P.Observe(progress=True)
    ) as tr:
        for b in batches:
            tr.step(b)
        tr.plot_loss(tmp_path / "loss.png")
    err = capsys.readouterr().err
    assert "train" in err and "loss=" in err
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_restore_as_the_contract_writes_it_uses_the_recorded_settings(tmp_path):
    """SPEC: ``trainer.save(DIR); trainer = P.Trainer.restore(DIR, stages, optimizer=..., runner=...)``."""
    params, batches, tx, c = gpt_params(), _batches(4), optax.sgd(0.1, momentum=0.9), 0.5
    stages = _stages()
    kw = dict(optimizer=tx, schedule="zbh1", microbatches=2, runner="inprocess", clip_global_norm=c)
    never_stopped = P.Trainer(stages, params, **kw)
    losses = [never_stopped.step(b) for b in batches]
    trainer = P.Trainer(stages, params, **kw)
    for b in batches[:2]:
        trainer.step(b)
    trainer.save(tmp_path / "ck")
    trainer = P.Trainer.restore(tmp_path / "ck", stages, optimizer=tx, runner="inprocess")
    assert (trainer.microbatches, trainer.plan.name, trainer.clip_global_norm) == (2, "zbh1", c)
    later = [trainer.step(b) for b in batches[2:]]
    np.testing.assert_array_equal(later, losses[2:])  # clipped as before: the very same run
    assert min(h.grad_norm for h in trainer.history) > c


def test_restore_values_given_win_over_the_recorded_ones(tmp_path):
    params, batches, tx = gpt_params(), _batches(3), optax.sgd(0.1)
    stages = _stages()
    trainer = P.Trainer(stages, params, optimizer=tx, schedule="zbh1", microbatches=2, clip_global_norm=0.5)
    trainer.step(batches[0])
    trainer.save(tmp_path / "ck")
    again = P.Trainer.restore(
        tmp_path / "ck", stages, optimizer=tx, microbatches=4, schedule="gpipe", clip_global_norm=None
    )
    assert (again.microbatches, again.plan.name, again.clip_global_norm) == (4, "gpipe", None)
    loss = again.step(batches[1])
    assert again.last_result.microbatches == 4 and again.last_result.schedule == "gpipe"
    # Unclipped from the saved parameters: plain SGD on the whole batch's gradient.
    saved = trainer.params()
    want, g = jax.value_and_grad(gpt)(saved, *batches[1])
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    step = jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, saved, g)
    assert_trees_close(again.params(), step, rtol=1e-4, atol=1e-6)


def test_restore_of_a_checkpoint_that_records_no_microbatches(tmp_path):
    """A checkpoint as vjpsplit wrote it before microbatches and clipping were recorded (per stage, layout 1)."""
    from checkpoint_v1 import write_per_stage_checkpoint

    params, batches, tx = gpt_params(), _batches(3), optax.sgd(0.1)
    stages = _stages()
    trainer = P.Trainer(stages, params, optimizer=tx, schedule="1f1b", microbatches=2)
    trainer.step(batches[0])
    old_meta = {"schedule": "1f1b", "optimizer": "sgd", "structure": trainer.ownership.structure}
    write_per_stage_checkpoint(tmp_path / "old", trainer.backend.snapshots(), trainer.step_count, old_meta)
    with pytest.raises(
        VjpsplitError, match=r"old: this checkpoint does not record its microbatches.*pass microbatches="
    ):
        P.Trainer.restore(tmp_path / "old", stages, optimizer=tx)
    again = P.Trainer.restore(tmp_path / "old", stages, optimizer=tx, microbatches=2)
    assert (again.step_count, again.plan.name, again.clip_global_norm) == (1, "1f1b", None)
    np.testing.assert_array_equal(again.step(batches[1]), trainer.step(batches[1]))


def test_restore_runs_the_callers_plans_it_recorded(tmp_path):
    params, batches, tx = gpt_params(), _batches(2), optax.sgd(0.1)
    plans = P.schedule("zbh1", 4, 2)
    trainer = P.Trainer(_stages(), params, optimizer=tx, schedule=P.Schedule(plans=plans), microbatches=2)
    trainer.step(batches[0])
    trainer.save(tmp_path / "ck")
    again = P.Trainer.restore(tmp_path / "ck", _stages(), optimizer=tx)
    assert again.plan.name == "custom" and again.plan.plans == plans
    np.testing.assert_array_equal(again.step(batches[1]), trainer.step(batches[1]))


def test_timeline_times_every_step_and_an_untimed_step_says_how_to_time_it(tmp_path):
    params, batches, tx = gpt_params(), _batches(2), optax.sgd(0.1)
    timed = P.Trainer(
        _stages(), params, optimizer=tx, schedule="zbh1", microbatches=2, observe=P.Observe(timeline=True)
    )
    plain = P.Trainer(_stages(), params, optimizer=tx, schedule="zbh1", microbatches=2)
    assert [timed.step(b) for b in batches] == [plain.step(b) for b in batches]  # the same numbers
    assert all(0 <= h.bubble < 1 for h in timed.history) and timed.last_result.timed
    timed.last_result.plot(tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0
    assert not plain.last_result.timed and plain.last_result.events == []
    with pytest.raises(VjpsplitError, match=r"not timed.*trainer.step\(batch, timed=True\)"):
        plain.last_result.plot(tmp_path / "u.png")
    timed.close()
    assert timed.backend.timeline is None  # the timed steps' watcher threads ended with the Trainer


def test_a_timed_step_whose_hand_out_fails_updates_nothing_and_the_next_step_runs(monkeypatch):
    """A failure while the driver hands a timed step out (here before its last operation) is
    the step's error: no stage updates from the partial gradients, and the Trainer steps on as if it never ran."""
    from vjpsplit_cli.pipeline.runtime import untimed  # a timed step is handed out as an untimed one

    params, batches, tx = gpt_params(), _batches(2), optax.sgd(0.1)
    tr = P.Trainer(_stages(), params, optimizer=tx, schedule="1f1b", microbatches=2, observe=P.Observe(timeline=True))
    ref = P.Trainer(_stages(), params, optimizer=tx, schedule="1f1b", microbatches=2, observe=P.Observe(timeline=True))
    real_walk = untimed.walk

    def half_then_fail(plans, num_stages, mbs, submit, order=None):
        budget = sum(len(p) for p in plans) - 1  # every stage has gradients of some microbatch

        def counted(*a):
            nonlocal budget
            if budget == 0:
                raise RuntimeError("hand-out interrupted")
            budget -= 1
            return submit(*a)

        return real_walk(plans, num_stages, mbs, counted, order)

    monkeypatch.setattr(untimed, "walk", half_then_fail)
    with pytest.raises(RuntimeError, match="hand-out interrupted"):
        tr.step(batches[0])
    monkeypatch.setattr(untimed, "walk", real_walk)
    assert_trees_close(tr.params(), params, rtol=0, atol=0)  # nothing applied
    assert [tr.step(b) for b in batches] == [ref.step(b) for b in batches]
    assert_trees_close(tr.params(), ref.params(), rtol=0, atol=0)
    tr.close()
    ref.close()


@pytest.mark.parametrize("timed", [False, True])
def test_an_error_inside_a_stage_names_the_operation_and_the_trainer_steps_on(monkeypatch, timed):
    """A host callback that raises in stage 1's forward of microbatch 1 reached the caller as jax's raw
    JaxRuntimeError, naming no stage, microbatch or operation."""
    from vjpsplit_cli.pipeline.runtime.worker import StageWorker

    def host(_):
        raise RuntimeError("the user's callback failed")

    @jax.jit
    def raising(x):
        like = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
        return jax.pure_callback(host, like, x)

    real = StageWorker.forward

    def forward(self, m, x, side, worker=None, microbatches=None):
        x = raising(x) if (self.stage_index, m) == (1, 1) else x
        return real(self, m, x, side, worker=worker, microbatches=microbatches)

    params, batches, tx = gpt_params(), _batches(2), optax.sgd(0.1)
    with P.Trainer(_stages(), params, optimizer=tx, microbatches=2, observe=P.Observe(timeline=timed)) as tr:
        monkeypatch.setattr(StageWorker, "forward", forward)
        with pytest.raises(VjpsplitError) as got:
            tr.step(batches[0])
        assert str(got.value) == (
            f"F stage 1 mb 1 failed: {RUNTIME_ERROR}: INTERNAL: RuntimeError: the user's callback failed"
        )
        assert isinstance(got.value.__cause__, jax.errors.JaxRuntimeError)
        monkeypatch.setattr(StageWorker, "forward", real)
        assert_trees_close(tr.params(), params, rtol=0, atol=0)  # nothing applied
        assert np.isfinite(tr.step(batches[1]))
