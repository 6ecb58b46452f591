"""The pipeline schedule F1 F2 B2 B1 from the seed discussion, with residuals parked on disk.

The sample MLP's loss (samples/mlp.py) is exported once with a symbolic batch
``b``. A batch of 16 is cut into two microbatches of 8; both forwards run first
(F1, F2), each microbatch's residuals go to a file (one ``.npz``, one
``.msgpack``) and are dropped from memory, then the backwards run in reverse
order (B2, B1) from the residuals read back. No forward is evaluated again. The
summed gradients and the mean of the two losses must match
``jax.value_and_grad`` of the loss on the full batch.

    python samples/pipeline_f1f2b2b1.py [--out DIR]

Prints one summary line and exits 0, or prints what differs and exits 1.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jexport

import vjpsplit_cli as vs

# The model lives next to this file; samples/ is not a package.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mlp import SIZES, init_params, loss, param_shapes  # noqa: E402

BATCH, MICRO = 16, 8


def make_batch(seed: int = 1):
    """A full batch: inputs ``f32[16,784]`` and labels ``i32[16]``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, SIZES[0])).astype(np.float32)
    labels = rng.integers(0, SIZES[-1], size=BATCH).astype(np.int32)
    return x, labels


def export_loss(path: Path) -> vs.Artifact:
    """Export the loss once for any batch size, differentiating the parameters only."""
    (b,) = jexport.symbolic_shape("b")
    art = vs.export(
        loss,
        param_shapes(),
        jax.ShapeDtypeStruct((b, SIZES[0]), jnp.float32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        wrt="params",
    )
    art.save(path)
    return vs.load(path)


def run_schedule(art: vs.Artifact, params, x, labels, out: Path):
    """F1 F2 B2 B1 on two microbatches; returns (mean loss, summed gradients, residual files)."""
    micro = [(params, x[i : i + MICRO], labels[i : i + MICRO]) for i in range(0, BATCH, MICRO)]
    # Both formats are exercised: microbatch 1 as .npz, microbatch 2 as .msgpack.
    files = [out / "residuals_mb1.npz", out / "residuals_mb2.msgpack"]

    losses = []
    for args, path in zip(micro, files):  # F1, F2
        value, res = art.fwd(*args)
        losses.append(float(value))
        # The parameters are input-backed residuals: the file leaves them out and
        # load_residuals takes them from the same arguments later.
        vs.save_residuals(path, res)
        del res  # only the file keeps this microbatch's state now

    # Each microbatch loss is a mean over 8 rows; the full-batch loss is the mean of
    # the two, so each backward gets cotangent 0.5 and the gradients simply add up.
    ct = np.float32(0.5)
    total = None
    for args, path in reversed(list(zip(micro, files))):  # B2, B1
        res = vs.load_residuals(path, inputs=args)
        grads = art.bwd(res, ct)
        total = grads if total is None else jax.tree_util.tree_map(jnp.add, total, grads)
    return float(np.mean(losses)), total, files


def compare(value, grads, ref_value, ref_grads) -> str | None:
    """None if value and every gradient leaf match the reference; else what differs."""
    if not np.allclose(value, ref_value, rtol=1e-5, atol=1e-6):
        return f"loss {value:.6f} != full-batch loss {ref_value:.6f}"
    got = dict(jax.tree_util.tree_leaves_with_path(grads))
    for path, ref in jax.tree_util.tree_leaves_with_path(ref_grads):
        name = jax.tree_util.keystr(path)
        if path not in got:
            return f"gradient {name} is missing"
        a, e = np.asarray(got[path]), np.asarray(ref)
        if a.shape != e.shape or not np.allclose(a, e, rtol=1e-5, atol=1e-6):
            worst = float(np.max(np.abs(a - e))) if a.shape == e.shape else float("nan")
            return f"gradient {name} differs (shape {a.shape} vs {e.shape}, max abs diff {worst:.2e})"
    return None


def main(argv=None) -> int:
    """Run the schedule and check it against the full-batch gradient; 0 if it matches."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, help="directory for the artifact and residual files (default: a temporary one)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        art = export_loss(out / "mlp_loss.vjps")
        params = init_params()
        x, labels = make_batch()
        value, grads, files = run_schedule(art, params, x, labels, out)
        sizes = ", ".join(f"{p.name} {p.stat().st_size / 1024:.0f} KiB" for p in files)
    ref_value, ref_grads = jax.value_and_grad(loss)(params, x, labels)
    bad = compare(value, grads, ref_value, ref_grads)
    if bad:
        print(f"FAIL: {bad}")
        return 1
    n = len(jax.tree_util.tree_leaves(ref_grads))
    print(
        f"F1 F2 B2 B1 on 2 microbatches of {MICRO}: loss {value:.6f} and {n} parameter gradients "
        f"match jax.value_and_grad on the full batch ({sizes})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
