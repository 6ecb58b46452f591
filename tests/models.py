"""Small models and inputs shared by the tests; every gradient is checked against jax.vjp."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name


def mlp(params, x):
    """Two-layer tanh MLP, scalar mean-square output."""
    h = checkpoint_name(jnp.tanh(x @ params["w1"] + params["b1"]), "hidden")
    return jnp.mean((h @ params["w2"]) ** 2)


def mlp_inputs(batch=4, seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": rng.normal(size=(6, 8)).astype(np.float32),
        "b1": rng.normal(size=(8,)).astype(np.float32),
        "w2": rng.normal(size=(8, 3)).astype(np.float32),
    }
    return params, rng.normal(size=(batch, 6)).astype(np.float32)


def convnet(params, x):
    """One NHWC convolution, relu, global average pool, linear head; vector output."""
    y = jax.lax.conv_general_dilated(x, params["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    y = checkpoint_name(jax.nn.relu(y + params["b"]), "hidden")
    return jnp.mean(y, axis=(1, 2)) @ params["head"]


def convnet_inputs(batch=2, seed=1):
    rng = np.random.default_rng(seed)
    params = {
        "k": rng.normal(size=(3, 3, 2, 4)).astype(np.float32),
        "b": rng.normal(size=(4,)).astype(np.float32),
        "head": rng.normal(size=(4, 5)).astype(np.float32),
    }
    return params, rng.normal(size=(batch, 6, 6, 2)).astype(np.float32)


def attention(params, x):
    """One pre-norm self-attention block with 2 heads and a residual connection."""
    b, t, d = x.shape
    h = 2
    mu = jnp.mean(x, -1, keepdims=True)
    xn = (x - mu) / jnp.sqrt(jnp.var(x, -1, keepdims=True) + 1e-5)
    q, k, v = (jnp.einsum("btd,de->bte", xn, params[n]).reshape(b, t, h, d // h) for n in ("wq", "wk", "wv"))
    logits = jnp.einsum("bthe,bshe->bhts", q, k) / np.sqrt(d // h)
    mask = jnp.tril(jnp.ones((t, t), bool))
    att = checkpoint_name(jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1), "hidden")
    o = jnp.einsum("bhts,bshe->bthe", att, v).reshape(b, t, d)
    return x + o @ params["wo"]


def attention_inputs(batch=2, t=5, d=8, seed=2):
    rng = np.random.default_rng(seed)
    params = {n: (rng.normal(size=(d, d)) / np.sqrt(d)).astype(np.float32) for n in ("wq", "wk", "wv", "wo")}
    return params, rng.normal(size=(batch, t, d)).astype(np.float32)


def nested(params, x):
    """Params as lists and tuples with empty tuples inside; non-scalar output."""
    (w0, _empty, b0), layers = params["first"], params["layers"]
    h = jnp.sin(x @ w0 + b0)
    for layer in layers:
        h = h * layer["scale"] + layer["shift"][0]
    return h


def nested_inputs(seed=3):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    params = {
        "first": (f(3, 4), (), f(4)),
        "layers": [{"scale": f(4), "shift": (f(4), ())}, {"scale": f(4), "shift": (f(4), ())}],
    }
    return params, f(2, 3)


def stage_hidden(params, x):
    """A pipeline stage: one tanh layer."""
    return jnp.tanh(x @ params["w"] + params["b"])


def stage_head(params, x, labels):
    """The last pipeline stage: a linear head and softmax cross-entropy on integer labels."""
    logits = x @ params["w"] + params["b"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def stages_whole(params, x, labels):
    """The model a pipeline of ``stage_hidden`` stages and a ``stage_head`` computes, in one function."""
    for p in params[:-1]:
        x = stage_hidden(p, x)
    return stage_head(params[-1], x, labels)


def ref_vjp(fn, args, ct=None, argnums=None):
    """(out, grads) from plain jax.vjp; ct defaults to ones like the output."""
    argnums = tuple(range(len(args))) if argnums is None else argnums

    def partial(*diff):
        full = list(args)
        for i, d in zip(argnums, diff):
            full[i] = d
        return fn(*full)

    out, vjp = jax.vjp(partial, *(args[i] for i in argnums))
    if ct is None:
        ct = jax.tree_util.tree_map(jnp.ones_like, out)
    return out, vjp(ct)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-5):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, f"{ta} != {tb}"
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, x.dtype, y.shape, y.dtype)
        if x.dtype == jax.dtypes.float0:
            continue
        np.testing.assert_allclose(x.astype(np.float64), y.astype(np.float64), rtol=rtol, atol=atol)


MODELS = {
    "mlp": (mlp, mlp_inputs),
    "convnet": (convnet, convnet_inputs),
    "attention": (attention, attention_inputs),
    "nested": (nested, nested_inputs),
}


def optax_reference(loss_fn, params, tx, batches):
    """N steps of optax ``tx`` on ``jax.value_and_grad(loss_fn)`` in one process: ``(losses, params)``.

    What every Trainer test compares against; each batch is a tuple of ``loss_fn``'s batch arguments.
    """
    import optax

    state, losses = tx.init(params), []
    step = jax.jit(jax.value_and_grad(loss_fn))
    for b in batches:
        loss, g = step(params, *b)
        u, state = tx.update(g, state, params)
        params = optax.apply_updates(params, u)
        losses.append(float(loss))
    return losses, jax.tree_util.tree_map(np.asarray, params)


def mlp_stage_artifacts(stages: int, rng, d: int = 8, classes: int = 5, scale: float = 3.0):
    """An MLP cut by hand into ``stages`` artifacts (``stage_hidden`` ones, then ``stage_head``), with their params.

    Each exported for the split backward over a symbolic batch; stage 0 differentiates only its
    parameters (its input gradient would be dropped), the others their input too.
    """
    from jax import export as jexport

    import vjpsplit_cli as vs

    params = [
        {"w": (rng.normal(size=(d, d)) / scale).astype(np.float32), "b": rng.normal(size=d).astype(np.float32)}
        for _ in range(stages - 1)
    ]
    params.append({"w": (rng.normal(size=(d, classes)) / scale).astype(np.float32), "b": np.zeros(classes, np.float32)})
    (b,) = jexport.symbolic_shape("b")
    s = jax.ShapeDtypeStruct
    spec = lambda p: jax.tree_util.tree_map(lambda a: s(a.shape, a.dtype), p)  # noqa: E731
    arts = [
        vs.export(
            stage_hidden,
            spec(p),
            s((b, d), jnp.float32),
            weights="params",
            wrt=("params",) if i == 0 else ("params", "x"),
            platforms="cpu",
        )
        for i, p in enumerate(params[:-1])
    ]
    arts.append(
        vs.export(
            stage_head,
            spec(params[-1]),
            s((b, d), jnp.float32),
            s((b,), jnp.int32),
            weights="params",
            wrt=("params", "x") if stages > 1 else ("params",),
            platforms="cpu",
        )
    )
    return arts, params
