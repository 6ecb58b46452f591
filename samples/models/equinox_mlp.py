"""An equinox MLP, exported as the array half of ``eqx.partition`` and run from the CLI.

    bash samples/models/run.sh equinox_mlp
    python samples/models/equinox_mlp.py make-inputs inputs.npz --batch 16
    python samples/models/equinox_mlp.py check inputs.npz grads.npz

The static half (activation functions, sizes) is rebuilt from code inside the
loss; the exported artifact holds only arrays and runs without equinox.
"""

import sys

import equinox as eqx
import jax
import numpy as np

import vjpsplit_cli as vs


def _model():
    return eqx.nn.MLP(in_size=32, out_size=4, width_size=64, depth=2, key=jax.random.key(0))


def init_params():
    """The arrays of the MLP: an ``eqx.nn.MLP`` whose non-array fields are None."""
    return eqx.partition(_model(), eqx.is_array)[0]


def param_shapes():
    """For ``--shapes params=@samples/models/equinox_mlp.py:param_shapes``."""
    return jax.eval_shape(init_params)


def loss(params, x, y):
    """Mean squared error of the MLP, vmapped over the batch."""
    model = eqx.combine(params, eqx.partition(_model(), eqx.is_array)[1])
    return ((jax.vmap(model)(x) - y) ** 2).mean()


def main(argv):
    if argv[:1] == ["make-inputs"]:
        batch = int(argv[argv.index("--batch") + 1]) if "--batch" in argv else 16
        rng = np.random.default_rng(1)
        x = rng.normal(size=(batch, 32)).astype(np.float32)
        y = rng.normal(size=(batch, 4)).astype(np.float32)
        vs.save_arrays(argv[1], vs.file_arrays(params=init_params(), x=x, y=y))
        return 0
    if argv[:1] == ["check"]:
        inputs, _ = vs.load_arrays(argv[1])
        grads, _ = vs.load_arrays(argv[2])
        params = vs.tree_from_file(inputs, "params", like=init_params())
        ref = vs.file_arrays(params=jax.grad(loss)(params, inputs["x"], inputs["y"]))
        ok = sorted(grads) == sorted(ref) and all(np.allclose(grads[k], ref[k], rtol=1e-4, atol=1e-6) for k in ref)
        print(f"{'OK' if ok else 'FAIL'}: equinox MLP, {len(ref)} gradients vs jax.grad")
        return 0 if ok else 1
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
