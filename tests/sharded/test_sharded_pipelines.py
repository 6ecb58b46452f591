"""Pipelines of sharded stages: each stage on its own group of the 8 devices, in-process and on Ray.

Every step's loss and gradients equal ``value_and_grad`` of the whole model.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export as jexport
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from models import stage_head as head
from models import stage_hidden as hidden
from models import stages_whole as whole

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline
from vjpsplit_cli.pipeline.runtime.devices import stage_devices

D, CLASSES, BATCH = 8, 6, 24


@functools.lru_cache(maxsize=None)
def make(stages: int):
    """``stages`` artifacts, each on a (2, n/2) mesh of n = 8 // stages devices: batch over data, units over model."""
    n = 8 // stages
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(2, n // 2), ("data", "model"))
    (b,) = jexport.symbolic_shape("b", constraints=("mod(b, 2) == 0",))

    def s(shape, spec, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    rng = np.random.default_rng(stages)
    params = [
        {"w": (rng.normal(size=(D, D)) / 3).astype(np.float32), "b": rng.normal(size=D).astype(np.float32)}
        for _ in range(stages - 1)
    ]
    params.append({"w": (rng.normal(size=(D, CLASSES)) / 3).astype(np.float32), "b": np.zeros(CLASSES, np.float32)})
    hidden_spec = {"w": s((D, D), P(None, "model")), "b": s((D,), P("model"))}
    arts = [
        vs.export(
            hidden,
            hidden_spec,
            s((b, D), P("data", None)),
            weights="params",
            wrt=("params",) if i == 0 else ("params", "x"),
            platforms="cpu",
        )
        for i in range(stages - 1)
    ]
    arts.append(
        vs.export(
            head,
            {"w": s((D, CLASSES), P("model", None)), "b": s((CLASSES,), P())},
            s((b, D), P("data", None)),
            s((b,), P("data"), jnp.int32),
            weights="params",
            wrt=("params", "x"),
            platforms="cpu",
        )
    )
    x = rng.normal(size=(BATCH, D)).astype(np.float32)
    labels = rng.integers(0, CLASSES, BATCH).astype(np.int32)
    return arts, params, x, labels


def _check(result, params, x, labels):
    loss, grads = jax.value_and_grad(whole)(params, x, labels)
    np.testing.assert_allclose(result.loss, loss, rtol=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves(result.grads), jax.tree_util.tree_leaves(grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", ["1f1b", "zbh1"])
def test_inprocess_stages_on_disjoint_device_groups(name, stages):
    arts, params, x, labels = make(stages)
    placed = stage_devices(arts)
    groups = [set(d.id for d in a.devices) for a in placed]
    n = 8 // stages
    assert groups == [set(range(n * s, n * s + n)) for s in range(stages)]  # disjoint, consecutive
    r = pipeline.run_inprocess(arts, params, x, [labels], microbatches=4, schedule=name)
    _check(r, params, x, labels)
    # Each stage's gradients stay on its own devices, sharded like its parameters.
    for grads, art in zip(r.grads, placed):
        for leaf in jax.tree_util.tree_leaves(grads):
            assert {d.id for d in leaf.sharding.device_set} <= set(d.id for d in art.devices)


def test_inprocess_stages_on_one_shared_mesh():
    arts, params, x, labels = make(2)
    shared = [jax.devices()[:4], jax.devices()[:4]]
    r = pipeline.run_inprocess(arts, params, x, [labels], microbatches=2, schedule="zbh1", devices=shared)
    _check(r, params, x, labels)


def test_device_groups_must_match_the_stages():
    arts, params, x, labels = make(2)
    with pytest.raises(vs.VjpsplitError, match="2 stages but 1 device groups"):
        pipeline.run_inprocess(arts, params, x, [labels], microbatches=2, devices=[jax.devices()[:4]])


@pytest.mark.parametrize("stages", [2, 4])
def test_ray_actors_drive_multi_device_stages(ray_session, stages):
    arts, params, x, labels = make(stages)
    with pipeline.RayPipeline(arts, params) as rp:
        # Each actor is a process of its own with exactly its stage's devices, however many the driver has.
        states = ray_session.get([a.state.remote() for a in rp.actors])
        n = 8 // stages
        assert [st["device_count"] for st in states] == [n] * stages
        assert [st["devices"] for st in states] == [{s: list(range(n))} for s in range(stages)]
        for name in ("1f1b", "zbh1"):
            r = rp.run(x, [labels], microbatches=4, schedule=name)
            assert r.runner == "ray"
            _check(r, params, x, labels)
