"""Small real models from flax (linen and nnx), equinox, haiku and optax, as users write them.

Each case is a loss function plus what it takes: concrete parameters, a batch
of a given size, export specs with a symbolic batch ``b``, and the CLI's
``--shapes``. The CLI reaches the specs as ``@tests/model_zoo.py:<case>_specs``.
Models are tiny so the whole zoo runs in seconds on two cores.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

ZOO = str(Path(__file__).resolve())


def _struct(tree):
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype), tree)


def _xent(logits, y):
    """Mean softmax cross-entropy with integer labels, written out (no optax needed)."""
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


def _labels(n: int, classes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, classes, size=(n,)).astype(np.int32)


@dataclass
class Case:
    """One model: ``loss(*args)``; ``args(n)`` gives concrete arguments for batch ``n``."""

    name: str
    loss: Callable
    args: Callable[[int], tuple]
    specs: Callable[[Any], tuple]  # export specs, given the symbolic batch dim
    cli_shapes: list[str]  # --shapes for the CLI
    wrt: Any = "params"
    has_aux: bool = False
    rtol: float = 1e-5
    atol: float = 1e-6
    library: str = ""
    extra: dict = field(default_factory=dict)


# -- flax.linen CNN with optax cross-entropy -------------------------------------------------
def _linen_cnn():
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(4, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), (2, 2))
            return nn.Dense(5)(x.reshape(x.shape[0], -1))

    return CNN()


def linen_cnn_loss(params, x, y):
    """Mean softmax cross-entropy of a flax.linen CNN, via optax."""
    import optax

    logits = _linen_cnn().apply(params, x)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def linen_cnn_params():
    """Initial parameters of the CNN."""
    return _linen_cnn().init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))


def linen_cnn_specs():
    """The CNN's parameter specs (for ``--shapes params=@...``)."""
    return _struct(linen_cnn_params())


# -- flax.nnx model passed as nnx.State ------------------------------------------------------
def _nnx_graphdef_and_state():
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(6, 8, rngs=rngs)
            self.l2 = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.gelu(self.l1(x)))

    return nnx.split(MLP(nnx.Rngs(0)))


def nnx_loss(state, x, y):
    """Cross-entropy of an nnx MLP given as its ``nnx.State``."""
    from flax import nnx

    graphdef, _ = _nnx_graphdef_and_state()
    logits = nnx.merge(graphdef, state)(x)
    return _xent(logits, y)


def nnx_state():
    """The nnx MLP's state."""
    return _nnx_graphdef_and_state()[1]


def nnx_specs():
    """The nnx state's specs: still an ``nnx.State``, leaves ShapeDtypeStructs."""
    return _struct(nnx_state())


# -- a transformer block with dropout ---------------------------------------------------------
def _block():
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            h = nn.LayerNorm()(x)
            h = nn.SelfAttention(num_heads=2, qkv_features=8, dropout_rate=0.2, deterministic=not train)(h)
            x = x + nn.Dropout(0.2, deterministic=not train)(h)
            h = nn.Dense(16)(nn.LayerNorm()(x))
            return x + nn.Dense(8)(nn.Dropout(0.2, deterministic=not train)(jax.nn.gelu(h)))

    return Block()


def block_loss(params, x, key):
    """Mean square of a pre-LN attention block's output, dropout driven by ``key``."""
    y = _block().apply(params, x, rngs={"dropout": key})
    return jnp.mean(y**2)


def block_params():
    """The block's parameters."""
    return _block().init(jax.random.key(1), jnp.zeros((1, 4, 8)), train=False)


def block_specs():
    """The block's parameter specs."""
    return _struct(block_params())


def typed_key_spec():
    """A typed threefry key (``jax.random.key``)."""
    return jax.ShapeDtypeStruct((), jax.random.key(0).dtype)


# -- BatchNorm statistics as aux ------------------------------------------------------------
def _bn_net():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(8)(x)
            x = nn.BatchNorm(use_running_average=False, momentum=0.9)(x)
            return nn.Dense(3)(nn.relu(x))

    return Net()


def bn_loss(params, batch_stats, x, y):
    """Cross-entropy with BatchNorm in training mode; the new ``batch_stats`` are aux."""
    import optax

    logits, updates = _bn_net().apply({"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y)), updates["batch_stats"]


def bn_variables():
    """``(params, batch_stats)`` of the BatchNorm net."""
    v = _bn_net().init(jax.random.key(2), jnp.zeros((2, 5)))
    return v["params"], v["batch_stats"]


def bn_params_specs():
    """Specs of the BatchNorm net's params."""
    return _struct(bn_variables()[0])


def bn_stats_specs():
    """Specs of the BatchNorm net's batch statistics."""
    return _struct(bn_variables()[1])


# -- equinox MLP, the array half of eqx.partition ------------------------------------------------
def _eqx_split():
    import equinox as eqx

    model = eqx.nn.MLP(5, 3, 8, 2, activation=jax.nn.tanh, key=jax.random.key(3))
    return eqx.partition(model, eqx.is_array)


def eqx_loss(params, x, y):
    """Cross-entropy of an equinox MLP given as the array half of ``eqx.partition``."""
    import equinox as eqx

    model = eqx.combine(params, _eqx_split()[1])
    logits = jax.vmap(model)(x)
    return _xent(logits, y)


def eqx_params():
    """The array half of the equinox MLP (an ``eqx.nn.MLP`` with ``None`` for non-arrays)."""
    return _eqx_split()[0]


def eqx_specs():
    """The equinox params' specs, still an ``eqx.nn.MLP``."""
    return _struct(eqx_params())


# -- haiku model with nested modules -----------------------------------------------------------
def _hk_forward():
    import haiku as hk

    def forward(x):
        return hk.nets.MLP([8, 3], name="mlp")(jax.nn.relu(hk.Linear(6, name="embed")(x)))

    return hk.without_apply_rng(hk.transform(forward))


def hk_loss(params, x, y):
    """Cross-entropy of a haiku model whose params are keyed like ``mlp/~/linear_0``."""
    logits = _hk_forward().apply(params, x)
    return _xent(logits, y)


def hk_params():
    """The haiku model's parameters."""
    return _hk_forward().init(jax.random.key(4), jnp.zeros((1, 5)))


def hk_specs():
    """The haiku params' specs."""
    return _struct(hk_params())


# -- bf16 parameters, f32 loss ------------------------------------------------------------------
def bf16_loss(params, x, y):
    """A flax.linen MLP computing in bfloat16, its loss accumulated in float32."""
    import flax.linen as nn
    import optax

    model = nn.Sequential(
        [
            nn.Dense(8, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16),
            nn.gelu,
            nn.Dense(3, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16),
        ]
    )
    logits = model.apply(params, x.astype(jnp.bfloat16)).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def bf16_params():
    """bfloat16 parameters of the MLP."""
    import flax.linen as nn

    model = nn.Sequential(
        [
            nn.Dense(8, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16),
            nn.gelu,
            nn.Dense(3, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16),
        ]
    )
    return model.init(jax.random.key(5), jnp.zeros((1, 5), jnp.bfloat16))


def bf16_specs():
    """Specs of the bf16 params."""
    return _struct(bf16_params())


# -- a NamedTuple and a registered dataclass, with no model library at all -----------------------
class Dense(typing.NamedTuple):
    w: Any
    b: Any


@jax.tree_util.register_dataclass
@dataclass
class TwoLayer:
    first: Dense
    second: Dense
    scale: Any


def plain_loss(params, x, y):
    """A NamedTuple inside a ``register_dataclass`` class: pytree nodes without any library."""
    h = jnp.tanh(x @ params.first.w + params.first.b)
    logits = (h @ params.second.w + params.second.b) * params.scale
    return _xent(logits, y)


def plain_params():
    """Parameters of ``plain_loss``."""
    rng = np.random.default_rng(6)
    return TwoLayer(
        Dense(rng.normal(size=(5, 8)).astype(np.float32), np.zeros(8, np.float32)),
        Dense(rng.normal(size=(8, 3)).astype(np.float32), np.zeros(3, np.float32)),
        np.float32(1.5),
    )


def plain_specs():
    """Specs of ``plain_params``."""
    return _struct(plain_params())


def _xs(n: int, shape: tuple, seed: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, *shape)).astype(dtype)


def cases() -> list[Case]:
    """Every model of the zoo."""
    return [
        Case(
            "linen_cnn",
            linen_cnn_loss,
            lambda n: (linen_cnn_params(), _xs(n, (8, 8, 1), 10), _labels(n, 5, 11)),
            lambda b: (
                linen_cnn_specs(),
                jax.ShapeDtypeStruct((b, 8, 8, 1), jnp.float32),
                jax.ShapeDtypeStruct((b,), jnp.int32),
            ),
            [f"params=@{ZOO}:linen_cnn_specs", "x=f32[b,8,8,1]", "y=i32[b]"],
            library="flax.linen + optax",
        ),
        Case(
            "nnx_state",
            nnx_loss,
            lambda n: (nnx_state(), _xs(n, (6,), 12), _labels(n, 3, 13)),
            lambda b: (nnx_specs(), jax.ShapeDtypeStruct((b, 6), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.int32)),
            [f"state=@{ZOO}:nnx_specs", "x=f32[b,6]", "y=i32[b]"],
            wrt="state",
            library="flax.nnx",
        ),
        Case(
            "block_typed_key",
            block_loss,
            lambda n: (block_params(), _xs(n, (4, 8), 14), jax.random.key(7)),
            lambda b: (block_specs(), jax.ShapeDtypeStruct((b, 4, 8), jnp.float32), typed_key_spec()),
            [f"params=@{ZOO}:block_specs", "x=f32[b,4,8]", f"key=@{ZOO}:typed_key_spec"],
            wrt=("params", "x"),
            rtol=1e-4,
            atol=1e-6,
            library="flax.linen",
        ),
        Case(
            "block_legacy_key",
            block_loss,
            lambda n: (block_params(), _xs(n, (4, 8), 15), jax.random.PRNGKey(8)),
            lambda b: (
                block_specs(),
                jax.ShapeDtypeStruct((b, 4, 8), jnp.float32),
                jax.ShapeDtypeStruct((2,), jnp.uint32),
            ),
            [f"params=@{ZOO}:block_specs", "x=f32[b,4,8]", "key=u32[2]"],
            wrt=("params", "x"),
            rtol=1e-4,
            atol=1e-6,
            library="flax.linen",
        ),
        Case(
            "batchnorm_aux",
            bn_loss,
            lambda n: (*bn_variables(), _xs(n, (5,), 16), _labels(n, 3, 17)),
            lambda b: (
                bn_params_specs(),
                bn_stats_specs(),
                jax.ShapeDtypeStruct((b, 5), jnp.float32),
                jax.ShapeDtypeStruct((b,), jnp.int32),
            ),
            [f"params=@{ZOO}:bn_params_specs", f"batch_stats=@{ZOO}:bn_stats_specs", "x=f32[b,5]", "y=i32[b]"],
            has_aux=True,
            library="flax.linen + optax",
        ),
        Case(
            "equinox_mlp",
            eqx_loss,
            lambda n: (eqx_params(), _xs(n, (5,), 18), _labels(n, 3, 19)),
            lambda b: (eqx_specs(), jax.ShapeDtypeStruct((b, 5), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.int32)),
            [f"params=@{ZOO}:eqx_specs", "x=f32[b,5]", "y=i32[b]"],
            library="equinox",
        ),
        Case(
            "haiku_nested",
            hk_loss,
            lambda n: (hk_params(), _xs(n, (5,), 20), _labels(n, 3, 21)),
            lambda b: (hk_specs(), jax.ShapeDtypeStruct((b, 5), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.int32)),
            [f"params=@{ZOO}:hk_specs", "x=f32[b,5]", "y=i32[b]"],
            library="dm-haiku",
        ),
        Case(
            "bf16_params",
            bf16_loss,
            lambda n: (bf16_params(), _xs(n, (5,), 22), _labels(n, 3, 23)),
            lambda b: (bf16_specs(), jax.ShapeDtypeStruct((b, 5), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.int32)),
            [f"params=@{ZOO}:bf16_specs", "x=f32[b,5]", "y=i32[b]"],
            rtol=2e-2,
            atol=2e-2,
            library="flax.linen + optax",
        ),
        Case(
            "namedtuple_dataclass",
            plain_loss,
            lambda n: (plain_params(), _xs(n, (5,), 24), _labels(n, 3, 25)),
            lambda b: (plain_specs(), jax.ShapeDtypeStruct((b, 5), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.int32)),
            [f"params=@{ZOO}:plain_specs", "x=f32[b,5]", "y=i32[b]"],
            library="jax.tree_util",
        ),
    ]
