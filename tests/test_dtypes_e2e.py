"""Every dtype, 0-d and empty arrays, through run-fwd/run-bwd and both file formats."""

from __future__ import annotations

import functools
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner
from clihelp import opts

import vjpsplit_cli as vs
from vjpsplit_cli.cli import main

DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16, "i32": np.int32, "bool": np.bool_}
SHAPES = {"0d": (), "empty": (0, 3), "2x3": (2, 3)}
FORMATS = ["npz", "msgpack"]


def fn(x, w):
    """Floating x is differentiated; integer and bool x only scale w."""
    return jnp.sum(jnp.sin(w) * x.astype(w.dtype))


def w_dtype(dt):
    return dt if jnp.issubdtype(dt, jnp.inexact) else np.float32


def make(dt, shape):
    rng = np.random.default_rng(0)
    raw = rng.normal(size=shape)
    x = (raw > 0) if dt == np.bool_ else (raw * 3).astype(dt)
    return x, rng.normal(size=shape).astype(w_dtype(dt))


@functools.lru_cache(maxsize=None)
def artifact_path(tmp_root, dname, sname):
    dt, shape = DTYPES[dname], SHAPES[sname]
    s = lambda d: jax.ShapeDtypeStruct(shape, d)  # noqa: E731
    path = f"{tmp_root}/{dname}_{sname}.vjps"
    vs.export(fn, s(dt), s(w_dtype(dt)), platforms="cpu").save(path)
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dtypes"))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("sname", sorted(SHAPES))
@pytest.mark.parametrize("dname", sorted(DTYPES))
def test_dtype_shape_format(root, tmp_path, dname, sname, fmt):
    dt = DTYPES[dname]
    art = artifact_path(root, dname, sname)
    x, w = make(dt, SHAPES[sname])
    vs.save_arrays(tmp_path / f"in.{fmt}", {"x": x, "w": w})
    run = CliRunner().invoke
    r = run(
        main,
        [
            "run-fwd",
            art,
            *opts(
                inputs=tmp_path / f"in.{fmt}",
                residuals=tmp_path / f"r.{fmt}",
                outputs=tmp_path / f"o.{fmt}",
            ),
        ],
    )
    assert r.exit_code == 0, r.output
    r = run(
        main,
        [
            "run-bwd",
            art,
            *opts(
                residuals=tmp_path / f"r.{fmt}",
                inputs=tmp_path / f"in.{fmt}",
                grads=tmp_path / f"g.{fmt}",
            ),
        ],
    )
    assert r.exit_code == 0, r.output
    outs, _ = vs.load_arrays(tmp_path / f"o.{fmt}")
    grads, _ = vs.load_arrays(tmp_path / f"g.{fmt}")
    assert outs["out"].dtype == np.dtype(w_dtype(dt)) and outs["out"].shape == ()
    floating = jnp.issubdtype(dt, jnp.inexact)
    argnums = (0, 1) if floating else (1,)
    ref = jax.grad(fn, argnums=argnums)(x, w)
    expect = dict(zip(["x", "w"] if floating else ["w"], ref))
    assert sorted(grads) == sorted(expect)  # integer and bool inputs get no gradient entry
    for k, v in expect.items():
        assert grads[k].dtype == v.dtype and grads[k].shape == v.shape
        close(grads[k], v)
    close(outs["out"], jax.jit(fn)(x, w))


def close(actual, expected):
    """Equal up to the dtype's precision (XLA may fuse differently from eager jax)."""
    expected = np.asarray(expected)
    tol = {2: 2e-2, 4: 1e-5}.get(expected.dtype.itemsize, 1e-3)
    np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64), rtol=tol, atol=tol)


def test_plain_numpy_npz_with_bfloat16_is_accepted(root, tmp_path):
    art = artifact_path(root, "bf16", "2x3")
    x, w = make(ml_dtypes.bfloat16, (2, 3))
    np.savez(tmp_path / "in.npz", x=x, w=w)  # numpy stores bfloat16 as raw |V2
    assert np.load(tmp_path / "in.npz")["x"].dtype == np.dtype("V2")
    r = CliRunner().invoke(
        main, ["run-fwd", art, "--inputs", str(tmp_path / "in.npz"), "--residuals", str(tmp_path / "r.npz")]
    )
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(
        main,
        [
            "run-bwd",
            art,
            *opts(residuals=tmp_path / "r.npz", inputs=tmp_path / "in.npz", grads=tmp_path / "g.npz"),
        ],
    )
    assert r.exit_code == 0, r.output
    g, _ = vs.load_arrays(tmp_path / "g.npz")
    assert g["x"].dtype == ml_dtypes.bfloat16
    close(g["x"], jax.grad(fn)(x, w))


def test_void_of_the_wrong_width_is_refused(root, tmp_path):
    art = artifact_path(root, "f32", "2x3")
    x, w = make(np.float32, (2, 3))
    np.savez(tmp_path / "in.npz", x=np.zeros((2, 3), "V2"), w=w)
    r = CliRunner().invoke(
        main, ["run-fwd", art, "--inputs", str(tmp_path / "in.npz"), "--residuals", str(tmp_path / "r.npz")]
    )
    assert r.exit_code == 1 and "input 'x': expected f32[2,3]" in r.stderr


def test_float64_with_x64(tmp_path):
    # 64-bit dtypes need jax_enable_x64; the CLI turns it on for such artifacts, in a
    # fresh process so the rest of the suite keeps JAX's 32-bit default.
    import subprocess
    import sys

    (tmp_path / "m.py").write_text(
        textwrap.dedent("""
        import jax.numpy as jnp
        def f(x):
            return jnp.sum(jnp.sin(x))
    """)
    )
    x = np.linspace(0, 1, 4)
    vs.save_arrays(tmp_path / "in.npz", {"x": x})
    cmds = [
        ["export", "m:f", "--shapes", "x=f64[n]", "--platforms", "cpu", "-o", "a.vjps"],
        ["run-fwd", "a.vjps", "--inputs", "in.npz", "--residuals", "r.npz"],
        ["run-bwd", "a.vjps", "--residuals", "r.npz", "--inputs", "in.npz", "--grads", "g.npz"],
    ]
    for c in cmds:
        r = subprocess.run([sys.executable, "-m", "vjpsplit_cli.cli", *c], cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    g, _ = vs.load_arrays(tmp_path / "g.npz")
    assert g["x"].dtype == np.float64
    np.testing.assert_allclose(g["x"], np.cos(x), rtol=1e-12)
