"""The cut inside scan on a sharded stage: stacked weights split over "model", the batch over "data"."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jexport
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import vjpsplit_cli as vs

L, D = 4, 8


def stage(params, x):
    def layer(h, p):
        return jnp.tanh(h @ p["w"] + p["b"]), None

    return jax.lax.scan(layer, x, params)[0]


def test_sharded_scanned_stage_splits_and_matches_vjp():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    (b,) = jexport.symbolic_shape("b", constraints=("mod(b, 2) == 0",))

    def s(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    art = vs.export(
        stage,
        {"w": s((L, D, D), P(None, None, "model")), "b": s((L, D), P(None, "model"))},
        s((b, D), P("data", None)),
        weights="params",
        platforms="cpu",
    )
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(L, D, D)).astype(np.float32) / 3, "b": rng.normal(size=(L, D)).astype(np.float32)}
    x = rng.normal(size=(6, D)).astype(np.float32)
    out, res = art.fwd(params, x)
    ct = rng.normal(size=np.shape(out)).astype(np.float32)
    grads_in, inter = art.bwd_input(res, ct)
    grads_w = art.bwd_weight(res, inter)
    ref_params, ref_x = jax.vjp(stage, params, x)[1](ct)
    for got, want in zip(jax.tree_util.tree_leaves(grads_w["params"]), jax.tree_util.tree_leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grads_in["x"]), ref_x, rtol=1e-5, atol=1e-5)
    dot = r"stablehlo\.dot_general.*?->\s*tensor<([^>]*)>"
    assert re.findall(dot, art._exps["bwd_input"].mlir_module()) == ["?x8xf32"]  # dx only
    assert re.findall(dot, art._exps["bwd_weight"].mlir_module()) == ["4x8x8xf32"]  # every layer's dW at once
