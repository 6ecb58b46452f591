"""Write tests/fixtures/jax-<version>/: a small artifact, its residuals, inputs and expected results.

Run it under the oldest supported jax (``scripts/compat 0.6.2 --fixture``); the test
suite then loads the files with whatever jax is installed (tests/test_compat.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.export
import jax.numpy as jnp
import numpy as np

import vjpsplit_cli as vs
from fixture_files import save_expected


def loss(params, x):
    """A two-layer MLP with a symbolic batch: the shape of artifact users ship."""
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"]) ** 2)


def main() -> int:
    out = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / f"jax-{jax.__version__}"
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(6, 8)).astype(np.float32),
        "b1": np.zeros(8, np.float32),
        "w2": rng.normal(size=(8, 3)).astype(np.float32),
    }
    x = rng.normal(size=(5, 6)).astype(np.float32)
    (b,) = jax.export.symbolic_shape("b")
    spec = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    art = vs.export(loss, spec, jax.ShapeDtypeStruct((b, 6), jnp.float32), name="fixture:loss")
    art.save(out / "mlp.vjps")
    value, res = art.fwd(params, x)
    vs.save_residuals(out / "residuals.msgpack", res, self_contained=True)
    g_params, g_x = art.bwd(res)
    save_expected(out / "expected.npz", params, x, value, g_params, g_x)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
