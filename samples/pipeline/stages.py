"""An 8-layer MLP cut for pipeline parallelism: into 4 stages of 2 layers, or (ZB-V) 8 stages of 1 layer.

``export_stages`` writes the model once (``one_function``) and cuts it at its
``stage_boundary`` marks; ``export_hand_written`` is the older form, one
function per stage, kept to compare.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jexport

WIDTH, CLASSES, LAYERS = 512, 10, 8


def hidden(params, x):
    """A hidden stage: dense layers with GELU, one per entry of ``params``."""
    for p in params:
        x = jax.nn.gelu(x @ p["w"] + p["b"])
    return x


def head(params, x, labels):
    """The last stage: its hidden layers, the classifier layer, then the microbatch's mean cross-entropy."""
    x = hidden(params[:-1], x)
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def whole(params, x, labels):
    """The unpipelined model (``params``: one dict per layer), for checking gradients."""
    return head(params, x, labels)


def init(layers: int = LAYERS, seed: int = 0):
    """One ``{"w", "b"}`` per layer; the last maps to the classes."""
    rng = np.random.default_rng(seed)
    return [
        {
            "w": (rng.normal(size=(WIDTH, CLASSES if i == layers - 1 else WIDTH)) / np.sqrt(WIDTH)).astype(np.float32),
            "b": np.zeros(CLASSES if i == layers - 1 else WIDTH, np.float32),
        }
        for i in range(layers)
    ]


def group(params, stages: int):
    """The layers' parameters as ``stages`` consecutive groups, one list per stage."""
    k = len(params) // stages
    if k * stages != len(params):
        raise ValueError(f"{len(params)} layers do not split into {stages} equal stages")
    return [params[i * k : (i + 1) * k] for i in range(stages)]


def one_function(every: int):
    """The whole model as one function, with a ``stage_boundary`` after every ``every`` layers."""
    import vjpsplit_cli as vs

    def loss(params, x, labels):
        for i, p in enumerate(params[:-1]):
            x = jax.nn.gelu(x @ p["w"] + p["b"])
            if (i + 1) % every == 0:
                x = vs.stage_boundary(x)
        logits = x @ params[-1]["w"] + params[-1]["b"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))

    return loss


def export_stages(params, stages: int, platforms="cpu"):
    """``stages`` stages of the one-function model (``vs.export_stages``), batch symbolic, zero-bubble split.

    The function is written once; the marks put ``LAYERS // stages`` layers in each stage.
    """
    import vjpsplit_cli as vs

    (b,) = jexport.symbolic_shape("b")
    s = jax.ShapeDtypeStruct
    spec = jax.tree_util.tree_map(lambda a: s(a.shape, a.dtype), params)
    group(params, stages)  # refuses a layer count that does not split evenly
    fn = one_function(len(params) // stages)
    return vs.export_stages(fn, spec, s((b, WIDTH), jnp.float32), s((b,), jnp.int32), wrt="params", platforms=platforms)


def export_hand_written(params, stages: int, platforms="cpu"):
    """The same stages written by hand, one function per stage (what ``export_stages`` replaces)."""
    import vjpsplit_cli as vs

    (b,) = jexport.symbolic_shape("b")
    s = jax.ShapeDtypeStruct
    spec = lambda p: jax.tree_util.tree_map(lambda a: s(a.shape, a.dtype), p)  # noqa: E731
    groups = group(params, stages)
    wrt = lambda i: ("params",) if i == 0 else ("params", "x")  # noqa: E731
    arts = [
        vs.export(hidden, spec(p), s((b, WIDTH), jnp.float32), wrt=wrt(i), weights="params", platforms=platforms)
        for i, p in enumerate(groups[:-1])
    ]
    arts.append(
        vs.export(
            head,
            spec(groups[-1]),
            s((b, WIDTH), jnp.float32),
            s((b,), jnp.int32),
            wrt=wrt(stages - 1),
            weights="params",
            platforms=platforms,
        )
    )
    return arts
