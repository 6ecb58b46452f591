"""Models written as one function for export_stages: a tiny GPT (tied embedding, mask, skip, pytree boundary)."""

from __future__ import annotations

import functools

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


TIED_V, TIED_D, TIED_T = 16, 8, 4  # ``tied``'s vocabulary, width, sequence


def tied(params, tokens, labels):
    """2 stages with a tied embedding (read by both) and a scalar leaf (no dimension to shard)."""
    h = jnp.take(params["embed"], tokens, axis=0)
    h = jnp.tanh(h @ params["w0"] + params["b0"])
    h = vs.stage_boundary(h)
    h = jnp.tanh(h @ params["w1"])
    logits = (h @ params["embed"].T) * params["temp"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1))


def tied_params(seed: int = 0):
    rng = np.random.default_rng(seed)
    v, d = TIED_V, TIED_D
    return {
        "embed": rng.normal(size=(v, d)).astype(np.float32),
        "w0": (rng.normal(size=(d, d)) / 3).astype(np.float32),
        "b0": np.full(d, 0.1, np.float32),
        "w1": (rng.normal(size=(d, d)) / 3).astype(np.float32),
        "temp": np.float32(1.5),
    }


def tied_batches(n: int, rows: int = 32, seed: int = 5):
    rng = np.random.default_rng(seed)
    v, t = TIED_V, TIED_T
    return [
        (rng.integers(0, v, (rows, t)).astype(np.int32), rng.integers(0, v, (rows, t)).astype(np.int32))
        for _ in range(n)
    ]


def tied_specs():
    """``tied``'s param specs and per-microbatch batch specs with a symbolic batch ``b``."""
    (b,) = jexport.symbolic_shape("b")
    S = jax.ShapeDtypeStruct
    return specs_like(tied_params()), S((b, TIED_T), jnp.int32), S((b, TIED_T), jnp.int32)


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


KEEP = 0.75  # dropout's keep probability in dropout_loss


def dropout_loss(params, key, x, y):
    """2 stages, dropout in each: the masks are drawn from the microbatch's key, folded with the stage's number."""
    h = jnp.tanh(x @ params["w0"])
    h = jnp.where(jax.random.bernoulli(jax.random.fold_in(key, 0), KEEP, h.shape), h / KEEP, 0.0)
    h = vs.stage_boundary(h)
    o = h @ params["w1"]
    o = jnp.where(jax.random.bernoulli(jax.random.fold_in(key, 1), KEEP, o.shape), o / KEEP, 0.0)
    return jnp.mean((o - y) ** 2)


def split_key_loss(params, key, x, y):
    """dropout_loss with both masks' keys split on stage 0: stage 1's key is sent on with the activation."""
    k0, k1 = jax.random.split(key)
    h = jnp.tanh(x @ params["w0"])
    h = jnp.where(jax.random.bernoulli(k0, KEEP, h.shape), h / KEEP, 0.0)
    h = vs.stage_boundary(h)
    o = h @ params["w1"]
    o = jnp.where(jax.random.bernoulli(k1, KEEP, o.shape), o / KEEP, 0.0)
    return jnp.mean((o - y) ** 2)


def dropout_params(seed: int = 0):
    rng = np.random.default_rng(seed)
    return {
        "w0": (rng.normal(size=(4, 16)) / 2).astype(np.float32),
        "w1": (rng.normal(size=(16, 3)) / 4).astype(np.float32),
    }


def dropout_specs(params):
    """Param specs, the key's (a scalar typed key) and per-microbatch batch specs with a symbolic batch ``b``."""
    (b,) = jexport.symbolic_shape("b")
    S = jax.ShapeDtypeStruct
    return specs_like(params), S((), jax.random.key(0).dtype), S((b, 4), jnp.float32), S((b, 3), jnp.float32)


def dropout_batches(n: int, rows: int = 16, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(rows, 4)).astype(np.float32), rng.normal(size=(rows, 3)).astype(np.float32)) for _ in range(n)
    ]


def one_process_with_keys(fn, params, key, batches, microbatches: int, tx, first_step: int = 0):
    """The one-process loop the Trainer's ``rng=`` equals: microbatch ``i`` of step ``t`` gets
    ``fold_in(fold_in(key, t), i)``; the loss and gradients are the mean over microbatches, then optax.
    Returns the losses and the last parameters."""
    import optax

    params = jax.tree_util.tree_map(jnp.asarray, params)
    state, losses = tx.init(params), []
    for t, batch in enumerate(batches, start=first_step):
        k = batch[0].shape[0] // microbatches

        def mean_loss(p, t=t, batch=batch, k=k):
            keys = [jax.random.fold_in(jax.random.fold_in(key, t), i) for i in range(microbatches)]
            parts = [fn(p, keys[i], *[x[i * k : (i + 1) * k] for x in batch]) for i in range(microbatches)]
            return jnp.mean(jnp.stack(parts))

        loss, grads = jax.value_and_grad(mean_loss)(params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return losses, params


MLP_IN, MLP_OUT = 4, 2  # the two-layer tanh MLP's input and output widths


def tanh_mlp(params, x, y):
    """Two stages: tanh(x @ w0) | the mean squared error of its product with w1."""
    h = vs.stage_boundary(jnp.tanh(x @ params["w0"]))
    return jnp.mean((h @ params["w1"] - y) ** 2)


def tanh_mlp_params(seed: int = 0):
    rng = np.random.default_rng(seed)
    w0, w1 = rng.normal(size=(MLP_IN, MLP_IN)), rng.normal(size=(MLP_IN, MLP_OUT))
    return {"w0": w0.astype(np.float32), "w1": w1.astype(np.float32)}


@functools.lru_cache(maxsize=None)
def tanh_mlp_stages():
    """``tanh_mlp``'s stages for a symbolic batch, on CPU (exported once per process)."""
    (b,) = jexport.symbolic_shape("b")
    S = jax.ShapeDtypeStruct
    specs = jax.tree_util.tree_map(lambda a: S(a.shape, a.dtype), tanh_mlp_params())
    x, y = S((b, MLP_IN), jnp.float32), S((b, MLP_OUT), jnp.float32)
    return vs.export_stages(tanh_mlp, specs, x, y, wrt="params", platforms="cpu")


def seq_loss(params, x, y):
    """2 stages over sequences: ``x`` is ``[b, s, 4]``, ``y`` is ``[b, s, 3]``, ``s`` a symbolic length."""
    h = jnp.tanh(x @ params["w0"])
    h = vs.stage_boundary(h)
    return jnp.mean((h @ params["w1"] - y) ** 2)


def seq_specs(params):
    """Param specs and per-microbatch batch specs with a symbolic batch ``b`` and length ``s``."""
    b, s = jexport.symbolic_shape("b, s")
    S = jax.ShapeDtypeStruct
    return specs_like(params), S((b, s, 4), jnp.float32), S((b, s, 3), jnp.float32)


def seq_microbatches(lengths, rows: int = 2, seed: int = 3):
    """One ``(x, y)`` batch tuple per length in ``lengths``, of ``rows`` rows each."""
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(rows, n, 4)).astype(np.float32), rng.normal(size=(rows, n, 3)).astype(np.float32))
        for n in lengths
    ]


def one_process_weighted(fn, params, steps, tx):
    """The one-process loop ``Microbatches`` equals: per step ``(batches, weights)``, ``jax.value_and_grad`` of
    ``sum_i w_i * fn(params, *batch_i) / sum_i w_i``, then the optax update. Returns the losses and the last params."""
    import optax

    params = jax.tree_util.tree_map(jnp.asarray, params)
    state, losses = tx.init(params), []
    for batches, weights in steps:

        def weighted(p, batches=batches, weights=weights):
            parts = [w * fn(p, *b) for b, w in zip(batches, weights)]
            return sum(parts) / sum(weights)

        loss, grads = jax.value_and_grad(weighted)(params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return losses, params


def aux_loss(params, x, y):
    """2 stages returning ``(loss, aux)``: the accuracy and the rows (an int, from the symbolic batch dim) made on the
    last stage, the first layer's mean activation made on stage 0 and carried to the last."""
    h = jnp.tanh(x @ params["w0"])
    first = jnp.mean(h)
    h = vs.stage_boundary(h)
    o = h @ params["w1"]
    accuracy = jnp.mean(jnp.argmax(o, -1) == jnp.argmax(y, -1))
    return jnp.mean((o - y) ** 2), {"accuracy": accuracy, "first": (first,), "rows": x.shape[0]}


def one_process_with_aux(fn, params, batches, microbatches: int, tx):
    """The one-process loop a Trainer on ``fn``'s stages (``has_aux=True``) equals: per step,
    ``jax.value_and_grad(has_aux=True)`` of the mean loss over the microbatches, its aux each microbatch's, then
    optax. Returns the losses, per step the list of each microbatch's aux (host arrays), and the last parameters."""
    import optax

    params = jax.tree_util.tree_map(jnp.asarray, params)
    state, losses, auxes = tx.init(params), [], []
    for batch in batches:
        k = batch[0].shape[0] // microbatches

        def mean_loss(p, batch=batch, k=k):
            parts = [fn(p, *[x[i * k : (i + 1) * k] for x in batch]) for i in range(microbatches)]
            return jnp.mean(jnp.stack([loss for loss, _ in parts])), [aux for _, aux in parts]

        (loss, aux), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
        auxes.append(jax.tree_util.tree_map(np.asarray, aux))
    return losses, auxes, params


def aux_mean(per_microbatch):
    """Each aux leaf's mean over the microbatches, as the one-process loop takes it."""
    return jax.tree_util.tree_map(lambda *a: np.asarray(jnp.mean(jnp.stack(a), axis=0)), *per_microbatch)
