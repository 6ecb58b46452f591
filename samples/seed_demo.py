"""The seed discussion's demonstration, done with vjpsplit instead of jax.vjp's private fields.

The discussion that started this project split ``f(x, y) = cos(x) * (1 + sin(y))``
into a compiled forward that returns its intermediate values and a separately
compiled backward that consumes them, by reaching into the partials that
``jax.vjp`` returns. That worked for one JAX release and only for the exact
argument signature it was traced with. Here the same check runs on a vjpsplit
artifact: exported once, saved, loaded back, and run over the 31x31 grid of
``np.linspace(0, pi, 31)``; value and both gradients must match ``jax.vjp``.

It then shows what the private-field version could not do: one artifact exported
with symbolic shapes ``x=f32[n], y=f32[n]`` serves any ``n``, so the whole grid
runs as a single vector call.

    python samples/seed_demo.py [--out DIR]

Prints one summary line and exits 0, or prints the first mismatch and exits 1.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jexport

import vjpsplit_cli as vs

GRID = np.linspace(0, np.pi, 31)


def f(x, y):
    """The seed's function."""
    return jnp.cos(x) * (1 + jnp.sin(y))


def _mismatch(where: str, actual, expected) -> str | None:
    """None if ``actual`` matches ``expected`` (value, dx, dy); else a one-line report."""
    actual, expected = np.r_[actual], np.r_[expected]
    if np.allclose(actual, expected):
        return None
    return f"{where}: expected {np.round(expected, 4)}, got {np.round(actual, 4)}"


def check_scalar_grid(path: Path) -> str | None:
    """Export ``f`` on scalars, reload it, and compare every grid point with ``jax.vjp``."""
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    vs.export(f, scalar, scalar).save(path)
    # Run from the file, as another process or host would: no reference to f is needed.
    art = vs.load(path)
    # The artifact takes exactly the dtypes it was exported with (no implicit casting),
    # so the grid's float64 values are cast to float32 once, here.
    grid = GRID.astype(np.float32)
    ct = np.float32(1.0)
    for x in grid:
        for y in grid:
            ve, vjp = jax.vjp(f, x, y)
            gxe, gye = vjp(ct)
            va, res = art.fwd(x, y)
            gxa, gya = art.bwd(res, ct)
            bad = _mismatch(f"x={x:.3f} y={y:.3f}", [va, gxa, gya], [ve, gxe, gye])
            if bad:
                return bad
    return None


def check_vector_grid(path: Path) -> str | None:
    """Export ``f`` once for ``f32[n]`` and run the whole grid as one call of each pass."""
    spec = jax.ShapeDtypeStruct(jexport.symbolic_shape("n"), jnp.float32)
    vs.export(f, spec, spec).save(path)
    art = vs.load(path)
    xs, ys = (a.astype(np.float32).ravel() for a in np.meshgrid(GRID, GRID, indexing="ij"))
    # The output is a vector, so the cotangent is explicit: ones give each point's own gradient.
    ct = np.ones_like(xs)
    ve, vjp = jax.vjp(f, xs, ys)
    gxe, gye = vjp(ct)
    va, res = art.fwd(xs, ys)
    gxa, gya = art.bwd(res, ct)
    for name, a, e in (("value", va, ve), ("d/dx", gxa, gxe), ("d/dy", gya, gye)):
        a, e = np.asarray(a), np.asarray(e)
        if a.shape != e.shape:
            return f"vector call: {name} has shape {a.shape}, expected {e.shape}"
        close = np.isclose(a, e)
        if not close.all():
            i = int(np.argmin(close))
            return f"vector call: {name} at x={xs[i]:.3f} y={ys[i]:.3f}: expected {e[i]:.4f}, got {a[i]:.4f}"
    return None


def main(argv=None) -> int:
    """Run both checks; 0 if everything matches ``jax.vjp``, else 1."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="directory for the artifacts (default: a temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        bad = check_scalar_grid(out / "seed_scalar.vjps")
        t1 = time.perf_counter()
        bad = bad or check_vector_grid(out / "seed_vector.vjps")
        t2 = time.perf_counter()
    if bad:
        print(f"FAIL: {bad}")
        return 1
    n = GRID.size**2
    print(
        f"{n} grid points: value and gradients match jax.vjp "
        f"(scalar artifact, one call per point: {t1 - t0:.1f}s; f32[n] artifact, one call: {t2 - t1:.1f}s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
