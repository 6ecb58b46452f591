"""Trainer on sharded stages: 2 stages x 4 devices; parameters and optimizer state stay sharded on each stage's group.

The model is written once with a ``stage_boundary``; its parameter specs carry
``NamedSharding``s on a (data, model) mesh of 4 devices. ``stage_devices`` puts
stage 0 on devices 0-3 and stage 1 on devices 4-7. Three Trainer steps give the
losses and parameters of three optax steps on ``jax.value_and_grad`` in one
process, in-process and on Ray (each actor a process with its stage's 4 devices).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import export as jexport
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from models import optax_reference

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline

D, H, CLASSES = 8, 8, 4
SPECS = {"w0": P(None, "model"), "b0": P("model"), "w1": P("model", None), "b1": P()}


def _same(a: P, b: P) -> bool:
    """Two PartitionSpecs that shard alike (``P('model')`` is ``P('model', None)``)."""
    strip = lambda s: tuple(s)[: max((i + 1 for i, e in enumerate(s) if e is not None), default=0)]  # noqa: E731
    return strip(a) == strip(b)


def loss(params, x, labels):
    h = jnp.tanh(x @ params["w0"] + params["b0"])
    h = vs.stage_boundary(h)
    logits = h @ params["w1"] + params["b1"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def _setup():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    (b,) = jexport.symbolic_shape("b", constraints=("mod(b, 2) == 0",))
    rng = np.random.default_rng(3)
    params = {
        "w0": (rng.normal(size=(D, H)) / 3).astype(np.float32),
        "b0": rng.normal(size=H).astype(np.float32),
        "w1": (rng.normal(size=(H, CLASSES)) / 3).astype(np.float32),
        "b1": np.zeros(CLASSES, np.float32),
    }
    pspecs = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, SPECS[k])) for k, v in params.items()
    }
    x = jax.ShapeDtypeStruct((b, D), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    y = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=NamedSharding(mesh, P("data")))
    stages = vs.export_stages(loss, pspecs, x, y, wrt="params", platforms="cpu")
    batches = [
        (rng.normal(size=(8, D)).astype(np.float32), rng.integers(0, CLASSES, 8).astype(np.int32)) for _ in range(3)
    ]
    return stages, params, batches


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_sharded_stages_train_like_one_process(schedule):
    stages, params, batches = _setup()
    assert all(a.manifest.sharded and a.manifest.nr_devices == 4 for a in stages.artifacts)
    tx = optax.adam(1e-2)
    tr = pipeline.Trainer(stages, params, optimizer=tx, schedule=schedule, microbatches=2)
    losses = [tr.step(b) for b in batches]

    ref_losses, ref = optax_reference(loss, params, tx, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[0] != losses[-1]
    got = tr.params()
    for k in params:
        np.testing.assert_allclose(got[k], np.asarray(ref[k]), rtol=1e-4, atol=1e-6)

    # Where the state lives: each stage's parameters and optimizer state on its own 4 devices, sharded as specified.
    for i, t in enumerate(tr.backend.trainers):
        group = {d.id for d in jax.devices()[4 * i : 4 * i + 4]}
        assert t.params, f"stage {i} holds no parameters"
        for key, arr in t.params.items():
            leaf = key.split("/")[-1]
            assert {d.id for d in arr.sharding.device_set} == group, (i, key)
            assert _same(arr.sharding.spec, SPECS[leaf]), (i, key, arr.sharding.spec)
        # Adam's moments are keyed by the parameter's key as one segment: ``0/mu/params%2Fw0``.
        moments = {k: v for k, v in t.state.items() if k.split("/")[1] in ("mu", "nu")}
        assert len(moments) == 2 * len(t.params), (i, list(t.state))
        for key, arr in moments.items():
            leaf = key.split("/")[-1].split("%2F")[-1]
            assert {d.id for d in arr.sharding.device_set} == group, (i, key)
            assert _same(arr.sharding.spec, SPECS[leaf]), (i, key, arr.sharding.spec)


def test_sharded_state_is_optax_own_and_a_checkpoint_continues_sharded(tmp_path):
    stages, params, batches = _setup()
    tx = optax.adam(1e-2)
    tr = pipeline.Trainer(stages, params, optimizer=tx, schedule="1f1b", microbatches=2)
    tr.step(batches[0])
    tr.save(tmp_path / "ck")
    _, opt_state = tr.state()
    state, p = tx.init(params), params
    g = jax.grad(loss)(p, *batches[0])
    _, state = tx.update(g, state, p)
    assert jax.tree_util.tree_structure(opt_state) == jax.tree_util.tree_structure(state)
    for a, b in zip(jax.tree_util.tree_leaves(opt_state), jax.tree_util.tree_leaves(state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    ref_losses, _ = optax_reference(loss, params, tx, batches)
    again = pipeline.Trainer.restore(tmp_path / "ck", stages, optimizer=tx)
    np.testing.assert_allclose([again.step(b) for b in batches[1:]], ref_losses[1:], rtol=1e-5)
    for i, t in enumerate(again.backend.trainers):  # the restored state went back onto each stage's devices
        group = {d.id for d in jax.devices()[4 * i : 4 * i + 4]}
        for arr in [*t.params.values(), *(v for k, v in t.state.items() if k.split("/")[1] in ("mu", "nu"))]:
            assert {d.id for d in arr.sharding.device_set} == group


def test_ray_trainer_with_sharded_stages_equals_one_process(ray_session):
    stages, params, batches = _setup()
    tx = optax.adam(1e-2)
    with pipeline.Trainer(stages, params, optimizer=tx, schedule="zbh1", microbatches=2, runner="ray") as tr:
        losses = [tr.step(b) for b in batches]
        got = tr.params()
        placement = tr.placement

        def where(actor):  # in each actor: every parameter and Adam moment on the actor's 4 devices, as specified
            out = {}
            for t in actor.trainers.values():
                moments = {k: v for k, v in t.state.items() if k.split("/")[1] in ("mu", "nu")}
                assert len(moments) == 2 * len(t.params)
                for k, v in {**t.params, **moments}.items():
                    out[k] = (sorted(d.id for d in v.sharding.device_set), tuple(v.sharding.spec))
            return out

        inside = ray_session.get([a.__ray_call__.remote(where) for a in tr.backend.rp.actors])
    ref_losses, ref = optax_reference(loss, params, tx, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k in params:
        np.testing.assert_allclose(got[k], np.asarray(ref[k]), rtol=1e-4, atol=1e-6)
    assert [len(set(p)) for p in placement] == [4, 4]  # each actor's own 4 devices
    assert [len(part) for part in inside] == [6, 6]  # two parameters and their two moments each
    for part in inside:
        for key, (ids, spec) in part.items():
            leaf = key.split("/")[-1].split("%2F")[-1]
            assert ids == [0, 1, 2, 3] and _same(P(*spec), SPECS[leaf]), (key, ids, spec)


def test_ray_data_parallel_over_sharded_stages_equals_one_process(ray_session):
    # PP 2 x DP 2 x TP 4: each actor runs its stage's 2 replicas, each on 4 of the actor's 8 devices.
    stages, params, batches = _setup()
    tx = optax.adam(1e-2)
    ref_losses, ref = optax_reference(loss, params, tx, batches)

    def where(actor):  # in each actor: its stage's reductions run, and where its replicas' parameters are
        (w,) = actor.stage_workers.values()
        return w.reductions, [
            sorted({d.id for a in jax.tree_util.tree_leaves(r.params) for d in a.devices()}) for r in w.replicas
        ]

    with pipeline.Trainer(
        stages, params, optimizer=tx, schedule="1f1b", microbatches=2, runner=pipeline.Ray(data_parallel=2)
    ) as tr:
        losses = [tr.step(b) for b in batches]
        got = tr.params()
        inside = ray_session.get([a.__ray_call__.remote(where) for a in tr.backend.rp.actors])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for k in params:
        np.testing.assert_allclose(got[k], np.asarray(ref[k]), rtol=1e-6, atol=1e-7)
    assert inside == [(3, [[0, 1, 2, 3], [4, 5, 6, 7]])] * 2, inside  # one reduction per step; a group per replica


def test_sharded_stages_with_data_parallel_on_too_few_devices_are_one_clear_error():
    # 2 stages x 2 replicas x a mesh of 4 devices: 16 devices, this process has 8.
    stages, params, _ = _setup()
    with pytest.raises(
        vs.VjpsplitError,
        match=r"data_parallel=2 with 2 workers needs 16 devices, this host has 8 \(on CPU, set XLA_FLAGS=",
    ):
        pipeline.Trainer(
            stages, params, optimizer=optax.sgd(0.1), microbatches=2, runner=pipeline.InProcess(data_parallel=2)
        )


def test_export_stages_records_data_parallel_for_sharded_specs():
    # The CLI's --stages --data-parallel N goes through here: the index records N, the Trainer's default.
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    shapes = {"w0": (D, H), "b0": (H,), "w1": (H, CLASSES), "b1": (CLASSES,)}
    pspecs = {
        k: jax.ShapeDtypeStruct(v, jnp.float32, sharding=NamedSharding(mesh, SPECS[k])) for k, v in shapes.items()
    }
    (b,) = jexport.symbolic_shape("b", constraints=("mod(b, 2) == 0",))
    x = jax.ShapeDtypeStruct((b, D), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    y = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=NamedSharding(mesh, P("data")))
    st = vs.export_stages(loss, pspecs, x, y, wrt="params", platforms="cpu", data_parallel=2)
    assert st.index.data_parallel == 2 and all(a.manifest.sharded for a in st.artifacts)
