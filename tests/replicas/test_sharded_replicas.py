"""Data parallel x sharded stages (PP x DP x TP) on 8 CPU devices: 2 stages, each on 2 replicas of a mesh of 2
devices; one gradient reduction per stage per step over the replicas, the optimizer state sharded over them too
(ZeRO-1), equal to optax on the whole batch in one process."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import export as jexport
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from models import assert_trees_close, optax_reference

import vjpsplit_cli as vs
from vjpsplit_cli import VjpsplitError
from vjpsplit_cli import pipeline

D, H, CLASSES = 8, 8, 4
SPECS = {"w0": P(None, "model"), "b0": P("model"), "w1": P("model", None), "b1": P(), "temp": P()}
RTOL, ATOL = 1e-6, 1e-7
CLIP = 0.5


def loss(params, x, labels):
    h = jnp.tanh(x @ params["w0"] + params["b0"])
    h = vs.stage_boundary(h)
    logits = (h @ params["w1"] + params["b1"]) * params["temp"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def _params():
    rng = np.random.default_rng(3)
    return {
        "w0": (rng.normal(size=(D, H)) / 3).astype(np.float32),
        "b0": rng.normal(size=H).astype(np.float32),
        "w1": (rng.normal(size=(H, CLASSES)) / 3).astype(np.float32),
        "b1": np.zeros(CLASSES, np.float32),
        "temp": np.float32(1.5),
    }


def _batches(n, rows=16, seed=4):
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(rows, D)).astype(np.float32), rng.integers(0, CLASSES, rows).astype(np.int32))
        for _ in range(n)
    ]


@functools.lru_cache(maxsize=None)
def _stages():
    """The stages sharded over a mesh of 2 devices, 'model'."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    (b,) = jexport.symbolic_shape("b")
    pspecs = {
        k: jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=NamedSharding(mesh, SPECS[k]))
        for k, v in _params().items()
    }
    x = jax.ShapeDtypeStruct((b, D), jnp.float32, sharding=NamedSharding(mesh, P()))
    y = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=NamedSharding(mesh, P()))
    return vs.export_stages(loss, pspecs, x, y, wrt="params", platforms="cpu")


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_pp2_dp2_tp2_equals_optax_on_the_whole_batch(schedule):
    params, tx, batches = _params(), optax.adam(1e-2), _batches(3)
    stages = _stages()
    assert all(a.manifest.sharded and a.manifest.nr_devices == 2 for a in stages.artifacts)
    with pipeline.Trainer(
        stages,
        params,
        optimizer=tx,
        microbatches=2,
        schedule=schedule,
        clip_global_norm=CLIP,
        runner=pipeline.InProcess(data_parallel=2),
    ) as tr:
        losses = [tr.step(b, timed=i == 2) for i, b in enumerate(batches)]
        ref_losses, ref = optax_reference(loss, params, optax.chain(optax.clip_by_global_norm(CLIP), tx), batches)
        np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
        assert_trees_close(tr.params(), ref, rtol=RTOL, atol=ATOL)
        assert [t.worker.reductions for t in tr.backend.trainers] == [3, 3]
        assert min(h.grad_norm for h in tr.history) > CLIP  # clipping acted: the replicas' squares count
        devs = jax.devices()
        assert [set(p) for p in tr.placement] == [set(devs[:4]), set(devs[4:])]
        for s, t in enumerate(tr.backend.trainers):
            for r, rep in enumerate(t.worker.replicas):  # each replica's parameters on its own group, as exported
                group = set(devs[4 * s + 2 * r : 4 * s + 2 * r + 2])
                assert all(a.sharding.device_set == group for a in jax.tree_util.tree_leaves(rep.params))


def test_zero1_splits_each_devices_shard_over_the_replicas():
    # Adam's moments of w0 (8 x 8, 'model' on dim 1): each of the stage's 4 devices holds 4 x 4, a quarter.
    with pipeline.Trainer(
        _stages(), _params(), optimizer=optax.adam(1e-2), microbatches=2, runner=pipeline.InProcess(data_parallel=2)
    ) as tr:
        tr.step(_batches(1)[0])
        t = tr.backend.trainers[0]
        mu = t.state["0/mu/params%2Fw0"]
        assert mu.sharding.mesh.axis_names == ("replicas", "model")
        assert sorted(s.data.shape for s in mu.addressable_shards) == [(4, 4)] * 4
        assert len({s.device for s in mu.addressable_shards}) == 4
        # The parameters: whole over the replicas, sharded over 'model' as exported (each device half of w0).
        w0 = t.params["params/w0"]
        assert sorted(s.data.shape for s in w0.addressable_shards) == [(8, 4)] * 4


def test_a_checkpoint_at_dp2_tp2_continues_at_dp2_and_in_one_process(tmp_path):
    params, tx, batches = _params(), optax.adam(1e-2), _batches(3)
    ref_losses, ref = optax_reference(loss, params, tx, batches)
    with pipeline.Trainer(
        _stages(), params, optimizer=tx, microbatches=2, runner=pipeline.InProcess(data_parallel=2)
    ) as tr:
        tr.step(batches[0])
        tr.save(tmp_path / "ck")
    for n in (2, 1):
        with pipeline.Trainer.restore(
            tmp_path / "ck", _stages(), optimizer=tx, runner=pipeline.InProcess(data_parallel=n)
        ) as again:
            np.testing.assert_allclose([again.step(b) for b in batches[1:]], ref_losses[1:], rtol=RTOL)
            assert_trees_close(again.params(), ref, rtol=RTOL, atol=ATOL)


def test_devices_given_place_each_replica_on_its_group():
    devs = jax.devices()
    order = [devs[6:8] + devs[0:2], devs[2:6]]  # stage 0: replica 0 on 6, 7 and replica 1 on 0, 1
    params, tx, batches = _params(), optax.sgd(0.1), _batches(2)
    with pipeline.Trainer(
        _stages(), params, optimizer=tx, microbatches=2, runner=pipeline.InProcess(devices=order, data_parallel=2)
    ) as tr:
        losses = [tr.step(b) for b in batches]
        first = tr.backend.trainers[0].worker.replicas
        assert [set(r.devices) for r in first] == [set(devs[6:8]), set(devs[0:2])]
    ref_losses, ref = optax_reference(loss, params, tx, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_trees_close(tr.params(), ref, rtol=RTOL, atol=ATOL)


def test_bad_layouts_are_one_clear_error():
    st, params, sgd = _stages(), _params(), optax.sgd(0.1)
    devs = jax.devices()
    with pytest.raises(VjpsplitError, match=r"data_parallel=4 with 2 workers needs 16 devices, this host has 8"):
        pipeline.Trainer(st, params, optimizer=sgd, microbatches=2, runner=pipeline.InProcess(data_parallel=4))
    with pytest.raises(
        VjpsplitError,
        match=r"data_parallel=2: stage 1 is given 3 devices \(3 distinct\) in devices=; give it 4 distinct devices, "
        r"2 replicas x its mesh of 2",
    ):
        runner = pipeline.InProcess(devices=[devs[:4], devs[4:7]], data_parallel=2)
        pipeline.Trainer(st, params, optimizer=sgd, microbatches=2, runner=runner)
    with pytest.raises(VjpsplitError, match=r"stage 0 is given 4 devices \(2 distinct\)"):
        runner = pipeline.InProcess(devices=[devs[:2] * 2, devs[4:8]], data_parallel=2)
        pipeline.Trainer(st, params, optimizer=sgd, microbatches=2, runner=runner)


def test_a_stage_mesh_axis_named_replicas_is_one_clear_error():
    mesh = Mesh(np.array(jax.devices()[:2]), ("replicas",))
    (b,) = jexport.symbolic_shape("b")
    specs = {k: P(*(("replicas" if e == "model" else e) for e in v)) for k, v in SPECS.items()}
    pspecs = {
        k: jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=NamedSharding(mesh, specs[k]))
        for k, v in _params().items()
    }
    x = jax.ShapeDtypeStruct((b, D), jnp.float32, sharding=NamedSharding(mesh, P()))
    y = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=NamedSharding(mesh, P()))
    st = vs.export_stages(loss, pspecs, x, y, wrt="params", platforms="cpu")
    with pytest.raises(VjpsplitError, match=r"stage 0: its mesh has an axis named 'replicas'.*rename that axis"):
        pipeline.Trainer(
            st, _params(), optimizer=optax.sgd(0.1), microbatches=2, runner=pipeline.InProcess(data_parallel=2)
        )
