"""The quick-start model: a small MLP classifier, used by README and samples/quickstart.sh.

python samples/mlp.py make-inputs DIR/inputs.npz [--batch N]
python samples/mlp.py check DIR/inputs.npz DIR/grads.npz
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

SIZES = (784, 256, 10)


def param_shapes():
    """Parameter shapes, for ``--shapes params=@samples/mlp.py:param_shapes``."""
    return {
        f"layer{i}": {"w": jax.ShapeDtypeStruct((a, b), jnp.float32), "b": jax.ShapeDtypeStruct((b,), jnp.float32)}
        for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:]))
    }


def init_params(seed: int = 0):
    """Random parameters with the shapes of ``param_shapes``."""
    rng = np.random.default_rng(seed)
    return {
        name: {
            "w": (rng.normal(size=s["w"].shape) / np.sqrt(s["w"].shape[0])).astype(np.float32),
            "b": np.zeros(s["b"].shape, np.float32),
        }
        for name, s in param_shapes().items()
    }


def loss(params, x, labels):
    """Mean softmax cross-entropy of the MLP on a batch."""
    h = x
    layers = [params[k] for k in sorted(params)]
    for i, layer in enumerate(layers):
        h = h @ layer["w"] + layer["b"]
        if i < len(layers) - 1:
            h = jax.nn.relu(h)
    logp = jax.nn.log_softmax(h)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def _flat(params):
    return {f"params/{k}/{n}": v for k, layer in params.items() for n, v in layer.items()}


def main(argv):
    import vjpsplit_cli as vs

    if argv[:1] == ["make-inputs"]:
        batch = int(argv[argv.index("--batch") + 1]) if "--batch" in argv else 32
        rng = np.random.default_rng(1)
        arrays = _flat(init_params())
        arrays["x"] = rng.normal(size=(batch, SIZES[0])).astype(np.float32)
        arrays["labels"] = rng.integers(0, SIZES[-1], size=batch).astype(np.int32)
        vs.save_arrays(argv[1], arrays)
        print(f"wrote {argv[1]}: params, x f32[{batch},{SIZES[0]}], labels i32[{batch}]")
        return 0
    if argv[:1] == ["check"]:
        inputs, _ = vs.load_arrays(argv[1])
        grads, _ = vs.load_arrays(argv[2])
        params = {k: {n: inputs[f"params/{k}/{n}"] for n in ("w", "b")} for k in param_shapes()}
        ref_p, ref_x = jax.grad(loss, argnums=(0, 1))(params, inputs["x"], inputs["labels"])
        ref = _flat(ref_p) | {"x": ref_x}
        if sorted(grads) != sorted(ref):
            print(f"FAIL: grads keys {sorted(grads)} != {sorted(ref)}")
            return 1
        worst = max(float(np.max(np.abs(grads[k] - np.asarray(ref[k])))) for k in ref)
        ok = all(np.allclose(grads[k], ref[k], rtol=1e-5, atol=1e-6) for k in ref)
        print(f"{'OK' if ok else 'FAIL'}: {len(ref)} gradients match jax.grad (max abs diff {worst:.2e})")
        return 0 if ok else 1
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
