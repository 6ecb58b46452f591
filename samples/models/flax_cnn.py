"""A flax.linen CNN with an optax loss, exported once and run from the CLI.

bash samples/models/run.sh flax_cnn          # export, run-fwd, run-bwd, check
python samples/models/flax_cnn.py make-inputs inputs.npz --batch 16
python samples/models/flax_cnn.py check inputs.npz grads.npz
"""

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import vjpsplit_cli as vs


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.avg_pool(x, (2, 2), (2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def init_params():
    """The CNN's parameters (a plain dict of dicts, as flax.linen gives them)."""
    return CNN().init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))


def param_shapes():
    """For ``--shapes params=@samples/models/flax_cnn.py:param_shapes``."""
    return jax.eval_shape(init_params)


def loss(params, x, labels):
    """Mean softmax cross-entropy."""
    logits = CNN().apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def main(argv):
    if argv[:1] == ["make-inputs"]:
        batch = int(argv[argv.index("--batch") + 1]) if "--batch" in argv else 16
        rng = np.random.default_rng(1)
        x = rng.normal(size=(batch, 28, 28, 1)).astype(np.float32)
        labels = rng.integers(0, 10, size=batch).astype(np.int32)
        vs.save_arrays(argv[1], vs.file_arrays(params=init_params(), x=x, labels=labels))
        return 0
    if argv[:1] == ["check"]:
        inputs, _ = vs.load_arrays(argv[1])
        grads, _ = vs.load_arrays(argv[2])
        params = vs.tree_from_file(inputs, "params", like=param_shapes())
        ref = vs.file_arrays(params=jax.grad(loss)(params, inputs["x"], inputs["labels"]))
        ok = sorted(grads) == sorted(ref) and all(np.allclose(grads[k], ref[k], rtol=1e-4, atol=1e-6) for k in ref)
        print(f"{'OK' if ok else 'FAIL'}: flax CNN, {len(ref)} gradients vs jax.grad")
        return 0 if ok else 1
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
