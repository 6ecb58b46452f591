"""A 4-stage MLP cut for pipeline parallelism: three hidden stages and a classifier head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jexport

WIDTH, CLASSES = 512, 10


def hidden(params, x):
    """A hidden stage: two dense layers with GELU."""
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    return jax.nn.gelu(h @ params["w2"] + params["b2"])


def head(params, x, labels):
    """The last stage: a dense layer, then the microbatch's mean cross-entropy."""
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def whole(params, x, labels):
    """The unpipelined model, for checking gradients."""
    for p in params[:-1]:
        x = hidden(p, x)
    return head(params[-1], x, labels)


def init(stages: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)

    def dense(a, b):
        return (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32), np.zeros(b, np.float32)

    params = []
    for s in range(stages):
        (w1, b1), (w2, b2) = dense(WIDTH, WIDTH), dense(WIDTH, CLASSES if s == stages - 1 else WIDTH)
        params.append({"w1": w1, "b1": b1, "w2": w2, "b2": b2})
    return params


def export_stages(params, platforms="cpu"):
    """One artifact per stage, batch symbolic, with the zero-bubble split backward."""
    import vjpsplit_cli as vs

    (b,) = jexport.symbolic_shape("b")
    s = jax.ShapeDtypeStruct
    spec = lambda p: jax.tree_util.tree_map(lambda a: s(a.shape, a.dtype), p)  # noqa: E731
    arts = [vs.export(hidden, spec(p), s((b, WIDTH), jnp.float32), weights="params", platforms=platforms)
            for p in params[:-1]]
    arts.append(vs.export(head, spec(params[-1]), s((b, WIDTH), jnp.float32), s((b,), jnp.int32),
                          wrt=("params", "x"), weights="params", platforms=platforms))
    return arts
