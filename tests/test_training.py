"""pipeline.training.Trainer: N pipelined optimizer steps equal N steps of optax on jax.value_and_grad in one process."""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import numpy as np
import optax
import pytest
from fetches import step_noting_fetches
from models import assert_trees_close, mlp_stage_artifacts
from models import stages_whole as whole

from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.pipeline import PerStage
from vjpsplit_cli.pipeline.training.backend import Backend
from vjpsplit_cli.pipeline.training.history import CheckpointTime, RestartRecord, StepRecord
from vjpsplit_cli.pipeline.training.local_backend import InProcessBackend
from vjpsplit_cli.pipeline.training.distributed_backend import DistributedBackend
from vjpsplit_cli.pipeline.training.ray_backend import RayBackend
from vjpsplit_cli.pipeline.training.trainer import Trainer
from vjpsplit_cli.pipeline.training.device_memory import DeviceMemory

D, CLASSES, BATCH, STAGES = 8, 5, 16, 3


@functools.lru_cache(maxsize=None)
def _make():
    return mlp_stage_artifacts(STAGES, np.random.default_rng(0), D, CLASSES, scale=2.0)


def _batches(n):
    rng = np.random.default_rng(5)
    return [
        (rng.normal(size=(BATCH, D)).astype(np.float32), rng.integers(0, CLASSES, BATCH).astype(np.int32))
        for _ in range(n)
    ]


def _reference(loss_fn, params, tx, batches):
    state, losses = tx.init(params), []
    step = jax.jit(jax.value_and_grad(loss_fn))
    for x, y in batches:
        loss, g = step(params, x, y)
        u, state = tx.update(g, state, params)
        params = optax.apply_updates(params, u)
        losses.append(float(loss))
    return losses, params


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbh1"])
def test_trainer_steps_equal_single_process_optax(schedule):
    arts, params = _make()
    batches = _batches(3)
    tr = Trainer(arts, params, optimizer=optax.adamw(1e-2), microbatches=4, schedule=schedule)
    losses = [tr.step(b) for b in batches]
    ref_losses, ref_params = _reference(whole, params, optax.adamw(1e-2), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[0] != losses[-1]  # it trained
    assert_trees_close(tr.params(), jax.tree_util.tree_map(np.asarray, ref_params), rtol=1e-4, atol=1e-5)
    assert [h.step for h in tr.history] == [1, 2, 3] and all(h.grad_norm > 0 for h in tr.history)
    assert all(isinstance(h, StepRecord) for h in tr.history)
    assert tr.history[0].loss == losses[0]


def test_records_are_read_by_attribute_and_give_their_dict():
    row = StepRecord(step=1, loss=0.5, grad_norm=2.0, step_time=0.1, bubble=0.2, modeled_bubble=0.3)
    timed = dataclasses.replace(row, busy=(0.1, 0.2), stragglers=(1,), measuring=True)
    assert row.as_dict() == {
        "step": 1, "loss": 0.5, "grad_norm": 2.0, "step_time": 0.1, "bubble": 0.2, "modeled_bubble": 0.3
    }  # fmt: skip
    assert "measuring" not in row.as_dict() and timed.as_dict()["measuring"] is True
    assert "eval_loss" not in row.as_dict()  # absent, as the dict had no such key before an evaluation
    with pytest.raises(TypeError):
        row["grad_norm"]  # issue 71: one way to read a record, its attribute
    assert timed.as_dict()["busy"] == [0.1, 0.2] and timed.as_dict()["stragglers"] == [1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.loss = 1.0  # type: ignore[misc]
    ck = CheckpointTime(step=2, wait=0.01, write=0.5)
    restart = RestartRecord(step=3, workers=(1,), returned_to=2, found_at=10.0, recovery_time=1.5)
    assert ck.wait == 0.01 and restart.workers == (1,)
    assert restart.as_dict() == {"step": 3, "workers": [1], "returned_to": 2, "found_at": 10.0, "recovery_time": 1.5}


def test_trainer_clips_by_the_global_norm_over_stages():
    arts, params = _make()
    batches, c = _batches(3), 0.05
    tx = optax.sgd(0.1, momentum=0.9)
    tr = Trainer(arts, params, optimizer=tx, microbatches=2, schedule="1f1b", clip_global_norm=c)
    losses = [tr.step(b) for b in batches]
    assert min(h.grad_norm for h in tr.history) > 2 * c  # clipping acts on every step
    ref_losses, ref_params = _reference(whole, params, optax.chain(optax.clip_by_global_norm(c), tx), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(tr.params(), jax.tree_util.tree_map(np.asarray, ref_params), rtol=1e-4, atol=1e-6)


def test_tied_parameters_train_as_one_and_stay_bitwise_equal():
    arts, params = _make()
    params = [dict(p) for p in params]
    params[1]["w"] = params[0]["w"].copy()  # stages 0 and 1 share one weight matrix

    def tied_whole(p, x, y):
        stages = [{"w": p["w"], "b": p["b0"]}, {"w": p["w"], "b": p["b1"]}, p["head"]]
        return whole(stages, x, y)

    batches = _batches(3)
    tr = Trainer(
        PerStage(arts, tied=[[(0, "w"), (1, "w")]]),
        params,
        optimizer=optax.adam(1e-2),
        microbatches=4,
        schedule="gpipe",
    )
    losses = [tr.step(b) for b in batches]
    ref = {"w": params[0]["w"], "b0": params[0]["b"], "b1": params[1]["b"], "head": params[2]}
    ref_losses, ref_params = _reference(tied_whole, ref, optax.adam(1e-2), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got = tr.params()
    np.testing.assert_array_equal(got[0]["w"], got[1]["w"])
    assert not np.array_equal(got[0]["w"], params[0]["w"])
    np.testing.assert_allclose(got[0]["w"], ref_params["w"], rtol=1e-4, atol=1e-5)
    with pytest.raises(VjpsplitError, match="tied leaf '0/b' differs between stages 0 and 1"):
        Trainer(PerStage(arts, tied=[[(0, "b"), (1, "b")]]), params, optimizer=optax.sgd(0.1), microbatches=2)


def test_an_untimed_step_fetches_nothing_before_every_update_is_dispatched(monkeypatch):
    """Tied gradients are summed and squared norms taken on the devices: the step's thread reads nothing back
    (no implicit transfer, no ``device_get``) until every stage's update is dispatched, then fetches once."""
    arts, params = _make()
    params = [dict(p) for p in params]
    params[1]["w"] = params[0]["w"].copy()
    tr = Trainer(
        PerStage(arts, tied=[[(0, "w"), (1, "w")]]), params, optimizer=optax.adam(1e-2), microbatches=4, schedule="1f1b"
    )
    batch = _batches(1)[0]
    tr.step(batch)  # compiled and warm
    loss, seen = step_noting_fetches(tr, batch, monkeypatch)
    assert seen[: len(arts)] == ["update"] * len(arts) and set(seen[len(arts) :]) == {"fetch"}, seen
    assert np.isfinite(loss) and np.isfinite(tr.history[-1].grad_norm)


def test_a_batch_on_a_device_is_cut_there_and_trains_as_the_same_batch_on_the_host():
    """A device batch's microbatches are cut where it is (no trip through the host) and the steps equal those on
    the same batch from host memory, bitwise."""
    arts, params = _make()
    batches = _batches(2)
    host = Trainer(arts, params, optimizer=optax.adam(1e-2), microbatches=4, schedule="1f1b")
    dev = Trainer(arts, params, optimizer=optax.adam(1e-2), microbatches=4, schedule="1f1b")
    jax.config.update("jax_transfer_guard_device_to_host", "disallow")  # np.asarray of a device array raises
    try:
        got = [dev.step(jax.device_put(b)) for b in batches]
    finally:
        jax.config.update("jax_transfer_guard_device_to_host", "allow")
    assert got == [host.step(b) for b in batches]
    assert_trees_close(dev.params(), host.params(), rtol=0, atol=0)


def test_stages_sharing_a_device_hand_on_their_values_as_they_are(monkeypatch):
    """Stages on one device hand each other their activations and cotangents as they are (no ``jax.device_put``
    in an untimed step of a batch already there), while a worker's parameters stay in containers of its own."""
    from vjpsplit_cli.pipeline import InProcess

    arts, params = _make()
    d = jax.devices()[0]
    tr = Trainer(arts, params, optimizer=optax.sgd(1e-2), microbatches=4, runner=InProcess(devices=[[d]] * len(arts)))
    batch = jax.device_put(_batches(1)[0], d)
    tr.step(batch)
    moved, put = [], jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: moved.append(a) or put(*a, **k))
    assert np.isfinite(tr.step(batch)) and moved == []
    worker = tr.backend.trainers[1].worker
    xs = [put(np.ones(3, np.float32), d)]
    assert worker.to_device(xs) is xs
    mine = {"w": put(np.ones(2, np.float32), d)}
    placed = worker.place_params(mine)
    assert placed is not mine and placed["w"] is mine["w"]
    tr.close()


@pytest.mark.parametrize("schedule", ["1f1b"])
def test_save_and_restore_continue_the_run(tmp_path, schedule):
    arts, params = _make()
    batches = _batches(5)
    kw = dict(optimizer=optax.adamw(optax.linear_schedule(1e-2, 1e-3, 5)), microbatches=4, schedule=schedule)
    never_stopped = Trainer(arts, params, **kw)
    losses = [never_stopped.step(b) for b in batches]
    first = Trainer(arts, params, **kw)
    for b in batches[:3]:
        first.step(b)
    first.save(tmp_path / "ck")
    again = Trainer.restore(tmp_path / "ck", arts, **kw)
    assert again.step_count == 3
    later = [again.step(b) for b in batches[3:]]
    np.testing.assert_array_equal(later, losses[3:])  # the same programs on the same arrays: bitwise
    assert_trees_close(again.params(), never_stopped.params(), rtol=0, atol=0)


def test_memory_gives_each_devices_parameter_optimizer_and_residual_bytes():
    """``Trainer.memory()``: on one CPU device, one record holding the three stages' parameters and optimizer
    state (as counted from the arrays), the last step's residual peaks, and the live arrays' bytes."""
    arts, params = _make()
    tx = optax.adamw(1e-2)
    with Trainer(arts, params, optimizer=tx, microbatches=4) as tr:
        (before,) = tr.memory()
        tr.step(_batches(1)[0])
        (after,) = tr.memory()
        peaks = sum(t.worker.peak_residual_bytes for t in tr.backend.trainers)
    assert isinstance(after, DeviceMemory) and after.device == jax.devices()[0] and after.worker is None
    assert after.stages == (0, 1, 2)
    want_params = sum(np.asarray(a).nbytes for a in jax.tree_util.tree_leaves(params))
    want_state = sum(np.asarray(a).nbytes for p in params for a in jax.tree_util.tree_leaves(tx.init(p)))
    assert (before.params, before.optimizer) == (after.params, after.optimizer) == (want_params, want_state)
    assert before.peak_residuals == 0 and after.peak_residuals == peaks > 0
    assert after.in_use >= want_params + want_state and after.peak_in_use is None  # CPU: live arrays, no peak
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.params = 0  # type: ignore[misc]


def _members(cls):
    return {n: v for n, v in vars(cls).items() if not n.startswith("_")}


@pytest.mark.parametrize("backend", [InProcessBackend, RayBackend, DistributedBackend])
def test_every_backend_has_every_member_of_the_backend_protocol(backend):
    """Structurally: each Protocol method is a method of the backend taking the same parameters (names, kinds,
    defaults), each Protocol property a property; the backends add only private helpers and their attributes."""
    declared = _members(Backend)
    assert {"step", "evaluate", "placement", "snapshots", "load", "replace", "close"} <= set(declared)
    for name, want in declared.items():
        got = getattr(backend, name, None)
        assert got is not None, f"{backend.__name__} has no {name}"
        if isinstance(want, property):
            assert isinstance(got, property), f"{backend.__name__}.{name} is not a property"
            continue
        theirs, ours = inspect.signature(want).parameters, inspect.signature(got).parameters
        assert [(p.name, p.kind, p.default) for p in theirs.values()] == [
            (p.name, p.kind, p.default) for p in ours.values()
        ], f"{backend.__name__}.{name}{inspect.signature(got)} is not Backend.{name}{inspect.signature(want)}"
    # Past the protocol, only the multi-process checkpoint's members (fit and backend.write_checkpoint call them) and
    # its costs' (Trainer.costs and schedule="auto"'s race call them: every process at the same point).
    multi = {"agree", "save", "writes_checkpoints", "costs_samples", "slowest", "transfer_rates"}
    extra = multi if backend.__name__ == "DistributedBackend" else set()
    assert set(_members(backend)) - set(declared) == extra, "a public method the protocol does not declare"
