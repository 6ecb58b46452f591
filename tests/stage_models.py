"""Models written as one function for export_stages: a tiny GPT (tied embedding, mask, skip, pytree boundary)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jexport

import vjpsplit_cli as vs

V, D, T = 11, 8, 5  # vocabulary, width, sequence


def gpt(params, tokens, mask, labels):
    """4 stages: embed | block 0 (reads the mask) | block 1 (+ a skip from stage 0) | tied-logits loss."""
    emb = jnp.take(params["embed"], tokens, axis=0)
    h = vs.stage_boundary({"h": emb, "aux": jnp.zeros((), jnp.float32)})  # a pytree boundary
    h, aux = h["h"], h["aux"]
    h = jnp.tanh(h @ params["blocks"][0]["w"]) * mask[..., None]  # the mask: read only by this middle stage
    aux = aux + jnp.mean(h**2)
    h, aux = vs.stage_boundary((h, aux))
    h = jnp.tanh(h @ params["blocks"][1]["w"]) + emb  # a skip connection across a stage
    h = vs.stage_boundary(h)
    logits = h @ params["embed"].T  # the tied embedding, read again by the last stage
    lp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(lp, labels[..., None], -1)) + 0.1 * aux


def gpt_params(seed: int = 0):
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.normal(size=(V, D)).astype(np.float32),
        "blocks": [{"w": (rng.normal(size=(D, D)) / 3).astype(np.float32)} for _ in range(2)],
    }


def gpt_batch(n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, V, size=(n, T)).astype(np.int32),
        (rng.random((n, T)) > 0.3).astype(np.float32),
        rng.integers(0, V, size=(n, T)).astype(np.int32),
    )


def specs_like(tree):
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def gpt_specs(params):
    """Param specs and per-microbatch batch specs with a symbolic batch ``b``."""
    (b,) = jexport.symbolic_shape("b")
    S = jax.ShapeDtypeStruct
    return specs_like(params), S((b, T), jnp.int32), S((b, T), jnp.float32), S((b, T), jnp.int32)


def mean_over_microbatches(fn, params, batch, microbatches: int):
    """The pipeline's loss: the mean of ``fn`` over equal microbatches (== fn on the whole batch for means)."""
    k = batch[0].shape[0] // microbatches
    parts = [fn(params, *[x[m * k : (m + 1) * k] for x in batch]) for m in range(microbatches)]
    return jnp.mean(jnp.stack(parts))


def mlp(params, x, labels):
    """8 dense layers, no marks (export_stages(..., stages=4) cuts them)."""
    for p in params[:-1]:
        x = jax.nn.gelu(x @ p["w"] + p["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def mlp_params(width: int = 16, classes: int = 4, layers: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        {
            "w": (rng.normal(size=(width, classes if i == layers - 1 else width)) / np.sqrt(width)).astype(np.float32),
            "b": np.zeros(classes if i == layers - 1 else width, np.float32),
        }
        for i in range(layers)
    ]
