"""A 2-stage model whose embedding is tied (read by both stages), and optax on it in one process: what the
optimizer catalogue tests (tests/test_optimizer_catalogue.py, tests/ray_suite) train."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import export as jexport

import vjpsplit_cli as vs

V, D, T = 12, 8, 5
STEPS, MICROBATCHES = 3, 2


def model(params, tokens, labels):
    """Two stages: the embedding and a layer | a head and the tied embedding's logits."""
    h = jnp.tanh(jnp.take(params["embed"], tokens, axis=0) @ params["w0"])
    h = vs.stage_boundary(h)
    logits = (jnp.tanh(h @ params["w1"]) + params["b"]) @ params["embed"].T
    lp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(lp, labels[..., None], -1))


def params_():
    """The parameters: ``embed`` tied (both stages read it), ``w0`` on stage 0, ``w1`` and ``b`` on stage 1."""
    rng = np.random.default_rng(0)
    return {
        "embed": rng.normal(size=(V, D)).astype(np.float32),
        "w0": (rng.normal(size=(D, D)) / 3).astype(np.float32),
        "w1": (rng.normal(size=(D, D)) / 3).astype(np.float32),
        "b": np.zeros((D,), np.float32),
    }


def batches():
    """``STEPS`` batches of (tokens, labels), 4 rows each."""
    rng = np.random.default_rng(1)
    return [
        (rng.integers(0, V, size=(4, T)).astype(np.int32), rng.integers(0, V, size=(4, T)).astype(np.int32))
        for _ in range(STEPS)
    ]


@functools.lru_cache(maxsize=None)
def stages():
    """``model`` cut at its mark into 2 stages, for a symbolic batch."""
    (b,) = jexport.symbolic_shape("b")
    specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params_())
    S = jax.ShapeDtypeStruct
    return vs.export_stages(model, specs, S((b, T), jnp.int32), S((b, T), jnp.int32), wrt="params", platforms="cpu")


def one_process(tx, data):
    """3 steps of ``tx`` in one process, ``value=loss`` passed as a loop over ``value_and_grad`` passes it."""
    params, losses = params_(), []
    state = tx.init(params)
    step = jax.jit(jax.value_and_grad(model))
    extra = isinstance(tx, optax.GradientTransformationExtraArgs)
    for b in data:
        loss, g = step(params, *b)
        u, state = tx.update(g, state, params, **({"value": loss} if extra else {}))
        params = optax.apply_updates(params, u)
        losses.append(float(loss))
    return losses, params, state


def _close(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind in "fc":
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6, err_msg=what)
    else:
        np.testing.assert_array_equal(a, b, err_msg=what)


def assert_as_one_process(name, losses, params, state, ref):
    """The pipeline's losses, parameters and ``state()`` equal ``one_process``'s (``ref``) within float noise."""
    ref_losses, ref_params, ref_state = ref
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6, err_msg=name)
    for (k, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(ref_params)):
        _close(a, b, f"{name}: parameter {jax.tree_util.keystr(k)}")
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(ref_state), name
    for (k, a), b in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree_util.tree_leaves(ref_state)):
        if jax.dtypes.issubdtype(getattr(b, "dtype", np.float32), jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        _close(a, b, f"{name}: state {jax.tree_util.keystr(k)}")
