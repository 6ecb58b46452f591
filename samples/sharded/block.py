"""Sharded stages on 8 devices: a tensor- and data-parallel MLP block and a transformer block.

The mesh is 2 x 4 (``data`` x ``model``): the batch is split over ``data``,
hidden units and attention heads over ``model`` (Megatron-style: the first
matmul's weight by columns, the second's by rows). On CPU, run with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``; on 8 GPUs or TPU cores,
as it is.

    vjpsplit export samples/sharded/block.py:mlp \\
        --shapes params=@samples/sharded/block.py:mlp_params --shapes x=@samples/sharded/block.py:batch \\
        --platforms cpu,cuda,tpu -o mlp.vjps
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import export
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

D, H, HEADS = 16, 64, 4

# One scope for the symbolic batch: every spec below shares it. The batch is split over
# 'data' (2 ways), so it must be a multiple of 2: jax.export needs that said up front.
(B,) = export.symbolic_shape("b", constraints=("mod(b, 2) == 0",))


def mesh() -> Mesh:
    """The 2 x 4 mesh over this host's first 8 devices (Auto axes: XLA propagates the rest)."""
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def _spec(shape, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh(), spec))


def mlp(params, x):
    """A residual MLP block's loss: ``mean((x + gelu(x W1 + b1) W2)^2)``."""
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    return jnp.mean((x + h @ params["w2"]) ** 2)


def mlp_params():
    """W1 split by columns, b1 with it, W2 by rows over ``model``."""
    return {"w1": _spec((D, H), P(None, "model")), "b1": _spec((H,), P("model")), "w2": _spec((H, D), P("model", None))}


def batch():
    """The activations: a symbolic batch ``b`` split over ``data``."""
    return _spec((B, 8, D), P("data", None, None))


def attention(params, x):
    """A pre-LN causal self-attention block with an MLP, as a loss; heads split over ``model``."""

    def norm(v):
        return (v - v.mean(-1, keepdims=True)) * jax.lax.rsqrt(v.var(-1, keepdims=True) + 1e-5)

    t = x.shape[1]
    q = jnp.einsum("btd,dhk->bhtk", norm(x), params["wq"])
    k = jnp.einsum("btd,dhk->bhtk", norm(x), params["wk"])
    v = jnp.einsum("btd,dhk->bhtk", norm(x), params["wv"])
    s = jnp.einsum("bhtk,bhsk->bhts", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    a = jnp.einsum("bhts,bhsk->bthk", jax.nn.softmax(s, axis=-1), v)
    x = x + jnp.einsum("bthk,hkd->btd", a, params["wo"])
    x = x + jax.nn.gelu(norm(x) @ params["w1"] + params["b1"]) @ params["w2"]
    return jnp.mean(x**2)


def attention_params():
    """Q, K, V split by heads, the output projection by heads (rows), the MLP as in ``mlp_params``."""
    k = D // HEADS
    return {
        "wq": _spec((D, HEADS, k), P(None, "model", None)),
        "wk": _spec((D, HEADS, k), P(None, "model", None)),
        "wv": _spec((D, HEADS, k), P(None, "model", None)),
        "wo": _spec((HEADS, k, D), P("model", None, None)),
        **mlp_params(),
    }


def init(specs, seed: int = 0, b: int = 8):
    """Host arrays (numpy) for a pytree of specs, the symbolic batch sized ``b``."""
    rng = np.random.default_rng(seed)

    def one(s):
        shape = tuple(d if isinstance(d, int) else b for d in s.shape)
        return (rng.normal(size=shape) / np.sqrt(shape[0])).astype(np.float32)

    return jax.tree_util.tree_map(one, specs)
