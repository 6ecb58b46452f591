"""The benchmark workloads: an MLP, a transformer block and a small conv net, with inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclass
class Workload:
    name: str
    fn: Callable
    args: tuple  # concrete numpy arguments (params first)
    batch_arg: int  # index of the argument whose leading dim is the batch


def _mlp(params, x, labels):
    h = x
    for i, (w, b) in enumerate(params):
        h = h @ w + b
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    logp = jax.nn.log_softmax(h)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def mlp(batch=256, sizes=(784, 1024, 1024, 10), seed=0) -> Workload:
    """MLP 784-1024-1024-10, batch 256, relu, log-softmax cross-entropy."""
    rng = np.random.default_rng(seed)
    params = [
        ((rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32), np.zeros(b, np.float32))
        for a, b in zip(sizes[:-1], sizes[1:])
    ]
    x = rng.normal(size=(batch, sizes[0])).astype(np.float32)
    labels = rng.integers(0, sizes[-1], batch).astype(np.int32)
    return Workload("mlp", _mlp, (params, x, labels), 1)


HEADS = 4


def _block(params, x):
    b, t, d = x.shape
    h = HEADS

    def norm(v, g):
        mu = jnp.mean(v, -1, keepdims=True)
        return (v - mu) * jax.lax.rsqrt(jnp.var(v, -1, keepdims=True) + 1e-5) * g

    xn = norm(x, params["g1"])
    qkv = xn @ params["wqkv"]
    q, k, v = (a.reshape(b, t, h, d // h) for a in jnp.split(qkv, 3, axis=-1))
    logits = jnp.einsum("bthe,bshe->bhts", q, k) / np.sqrt(d // h)
    mask = jnp.tril(jnp.ones((t, t), bool))
    att = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
    x = x + jnp.einsum("bhts,bshe->bthe", att, v).reshape(b, t, d) @ params["wo"]
    x = x + jax.nn.gelu(norm(x, params["g2"]) @ params["w1"]) @ params["w2"]
    return jnp.mean(x**2)


def transformer(batch=8, t=128, d=256, seed=1) -> Workload:
    """One pre-norm transformer block: d=256, 4 heads, T=128, batch 8, MLP ratio 4."""
    rng = np.random.default_rng(seed)
    f = lambda *s: (rng.normal(size=s) / np.sqrt(s[0])).astype(np.float32)  # noqa: E731
    params = {
        "wqkv": f(d, 3 * d),
        "wo": f(d, d),
        "w1": f(d, 4 * d),
        "w2": f(4 * d, d),
        "g1": np.ones(d, np.float32),
        "g2": np.ones(d, np.float32),
    }
    return Workload("transformer", _block, (params, rng.normal(size=(batch, t, d)).astype(np.float32)), 1)


def _layer_norm(v, g, b):
    mu = jnp.mean(v, -1, keepdims=True)
    return (v - mu) * jax.lax.rsqrt(jnp.var(v, -1, keepdims=True) + 1e-5) * g + b


def _preln_block(params, x):
    """x + attn(LN(x)), then + MLP(LN(.)): causal, HEADS heads, gelu MLP of 4d, biases everywhere."""
    b, t, d = x.shape
    h = HEADS
    qkv = _layer_norm(x, params["ln1_g"], params["ln1_b"]) @ params["wqkv"] + params["bqkv"]
    q, k, v = (a.reshape(b, t, h, d // h) for a in jnp.split(qkv, 3, axis=-1))
    logits = jnp.einsum("bthe,bshe->bhts", q, k) / np.sqrt(d // h)
    att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9), axis=-1)
    x = x + jnp.einsum("bhts,bshe->bthe", att, v).reshape(b, t, d) @ params["wo"] + params["bo"]
    hid = jax.nn.gelu(_layer_norm(x, params["ln2_g"], params["ln2_b"]) @ params["w1"] + params["b1"])
    x = x + hid @ params["w2"] + params["b2"]
    return jnp.mean(x**2)


def block(batch=8, t=128, d=256, seed=3) -> Workload:
    """Issue 14's block: pre-LN causal transformer block, d=256, 4 heads, T=128, batch 8, gelu MLP 4d."""
    rng = np.random.default_rng(seed)
    f = lambda *s: (rng.normal(size=s) / np.sqrt(s[0])).astype(np.float32)  # noqa: E731
    z = lambda n: np.zeros(n, np.float32)  # noqa: E731
    params = {
        "ln1_g": np.ones(d, np.float32),
        "ln1_b": z(d),
        "wqkv": f(d, 3 * d),
        "bqkv": z(3 * d),
        "wo": f(d, d),
        "bo": z(d),
        "ln2_g": np.ones(d, np.float32),
        "ln2_b": z(d),
        "w1": f(d, 4 * d),
        "b1": z(4 * d),
        "w2": f(4 * d, d),
        "b2": z(d),
    }
    return Workload("block", _preln_block, (params, rng.normal(size=(batch, t, d)).astype(np.float32)), 1)


def _conv(params, x):
    dn = ("NHWC", "HWIO", "NHWC")
    y = jax.nn.relu(jax.lax.conv_general_dilated(x, params["k1"], (1, 1), "SAME", dimension_numbers=dn))
    y = jax.nn.relu(jax.lax.conv_general_dilated(y, params["k2"], (2, 2), "SAME", dimension_numbers=dn))
    return jnp.mean((jnp.mean(y, axis=(1, 2)) @ params["head"]) ** 2)


def convnet(batch=32, seed=2) -> Workload:
    """Two 3x3 convolutions (16, 32 channels) on 32x32x3 images, pooled linear head."""
    rng = np.random.default_rng(seed)
    params = {
        "k1": (rng.normal(size=(3, 3, 3, 16)) * 0.2).astype(np.float32),
        "k2": (rng.normal(size=(3, 3, 16, 32)) * 0.1).astype(np.float32),
        "head": (rng.normal(size=(32, 10)) * 0.1).astype(np.float32),
    }
    return Workload("convnet", _conv, (params, rng.normal(size=(batch, 32, 32, 3)).astype(np.float32)), 1)


ALL = (mlp, transformer, convnet)
# Issue 14's two workloads (the MLP as described there is ``mlp()``) and the conv net.
PERF = (mlp, block, convnet)
