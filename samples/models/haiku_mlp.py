"""A haiku model with nested modules (params keyed like ``mlp/~/linear_0``), run from the CLI.

    bash samples/models/run.sh haiku_mlp
    python samples/models/haiku_mlp.py make-inputs inputs.npz --batch 16
    python samples/models/haiku_mlp.py check inputs.npz grads.npz

In files, ``/`` inside a haiku name is written ``%2F``: ``params/mlp%2F~%2Flinear_0/w``.
"""

import sys

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import vjpsplit_cli as vs


def _forward(x):
    return hk.nets.MLP([64, 64, 10], name="mlp")(x)


NET = hk.without_apply_rng(hk.transform(_forward))


def init_params():
    """Haiku's parameter dict: ``{"mlp/~/linear_0": {"w": ..., "b": ...}, ...}``."""
    return NET.init(jax.random.key(0), jnp.zeros((1, 32)))


def param_shapes():
    """For ``--shapes params=@samples/models/haiku_mlp.py:param_shapes``."""
    return jax.eval_shape(init_params)


def loss(params, x, labels):
    """Mean softmax cross-entropy."""
    logp = jax.nn.log_softmax(NET.apply(params, x))
    return -jnp.take_along_axis(logp, labels[:, None], axis=1).mean()


def main(argv):
    if argv[:1] == ["make-inputs"]:
        batch = int(argv[argv.index("--batch") + 1]) if "--batch" in argv else 16
        rng = np.random.default_rng(1)
        x = rng.normal(size=(batch, 32)).astype(np.float32)
        labels = rng.integers(0, 10, size=batch).astype(np.int32)
        vs.save_arrays(argv[1], vs.file_arrays(params=init_params(), x=x, labels=labels))
        return 0
    if argv[:1] == ["check"]:
        inputs, _ = vs.load_arrays(argv[1])
        grads, _ = vs.load_arrays(argv[2])
        params = vs.tree_from_file(inputs, "params", like=param_shapes())
        ref = vs.file_arrays(params=jax.grad(loss)(params, inputs["x"], inputs["labels"]))
        ok = sorted(grads) == sorted(ref) and all(np.allclose(grads[k], ref[k], rtol=1e-4, atol=1e-6) for k in ref)
        print(f"{'OK' if ok else 'FAIL'}: haiku MLP, {len(ref)} gradients vs jax.grad")
        return 0 if ok else 1
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
