"""64-bit dtypes with ``jax_enable_x64`` off (one refusal naming the leaf) and on (artifacts in 64 bits).

The x64-on tests turn the flag on through the ``x64`` fixture, which puts it back
whatever the test does, so the rest of the suite keeps JAX's 32-bit default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export as jexport
from models import assert_trees_close

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P

S = jax.ShapeDtypeStruct
WIDE = {np.float64: "float32", np.int64: "int32", np.uint64: "uint32", np.complex128: "complex64"}


@pytest.fixture
def x64():
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


def as_float(x):
    """A real float of x's width: |x|^2 for complex, a cast for integers."""
    if jnp.iscomplexobj(x):
        return jnp.abs(x) ** 2
    return x.astype(jnp.float64 if x.dtype.itemsize == 8 else jnp.float32)


def loss(params, x):
    return jnp.sum(jnp.sin(params["w"]) * as_float(x)) + jnp.sum(params["b"] ** 2)


def staged(params, x, y):
    h = vs.stage_boundary(jnp.tanh(x @ params["w1"]))
    return jnp.mean((h @ params["w2"] - y) ** 2)


def staged_specs(dtype):
    (b,) = jexport.symbolic_shape("b")
    return {"w1": S((3, 4), dtype), "w2": S((4, 1), dtype)}, S((b, 3), dtype), S((b, 1), dtype)


def staged_values(dtype):
    rng = np.random.default_rng(1)
    params = {"w1": rng.normal(size=(3, 4)).astype(dtype), "w2": rng.normal(size=(4, 1)).astype(dtype)}
    return params, rng.normal(size=(8, 3)).astype(dtype), rng.normal(size=(8, 1)).astype(dtype)


# ---- jax_enable_x64 off ----


@pytest.mark.parametrize("dtype", list(WIDE), ids=lambda d: np.dtype(d).name)
def test_a_64bit_spec_without_x64_is_one_line_naming_the_leaf_and_the_fix(dtype):
    params = {"w": S((3,), np.float32), "b": S((2,), np.float32)}
    with pytest.raises(vs.VjpsplitError) as e:
        vs.export(loss, params, S((3,), dtype), platforms="cpu")
    msg = str(e.value)
    name = np.dtype(dtype).name
    assert msg.startswith(f"input 'x' is {name}, but jax_enable_x64 is off")
    assert "jax.config.update('jax_enable_x64', True)" in msg and f"declare the leaf {WIDE[dtype]}" in msg
    assert "\n" not in msg


def test_a_64bit_leaf_deep_in_a_pytree_is_named_by_its_file_key():
    params = {"w": S((3,), np.float64), "b": S((2,), np.float64)}
    with pytest.raises(vs.VjpsplitError, match=r"^input 'params/b' is float64 \(and 1 other 64-bit leaf\)"):
        vs.export(loss, params, S((3,), np.float32), platforms="cpu")
    # an array given as a spec, or a shape-polymorphic spec, alike: the spec's dtype is what counts
    with pytest.raises(vs.VjpsplitError, match="^input 'a' is float64"):
        vs.export(jnp.sum, np.ones(3), platforms="cpu")
    with pytest.raises(vs.VjpsplitError, match="^input 'x' is int64"):
        vs.export(lambda x: jnp.sum(as_float(x)), S(jexport.symbolic_shape("n"), np.int64), platforms="cpu")


def test_export_stages_refuses_by_the_users_key_before_cutting():
    p, x, y = staged_specs(np.float32)
    with pytest.raises(vs.VjpsplitError, match="^input 'params/w2' is float64"):
        vs.export_stages(staged, {**p, "w2": S((4, 1), np.float64)}, x, y, wrt="params", platforms="cpu")
    with pytest.raises(vs.VjpsplitError, match="^input 'y' is float64"):
        vs.export_stages(staged, p, x, S(y.shape, np.float64), wrt="params", platforms="cpu")


@pytest.mark.parametrize("x", [np.linspace(0.0, 1.0, 5), np.arange(5, dtype=np.int64)], ids=["float64", "int64"])
def test_split_takes_64bit_numpy_as_jax_does_without_x64(x):
    # jax.jit and jax.grad compute 64-bit numpy arguments in 32 bits without x64; split does the same
    params = {"w": np.linspace(-1.0, 1.0, 5), "b": np.ones(2)}
    fwd, bwd = vs.split(loss)
    out, res = fwd(params, x)
    grads = bwd(res)
    want, want_g = jax.value_and_grad(loss, argnums=(0, 1), allow_int=True)(params, x)
    assert out.dtype == want.dtype == np.float32
    assert grads[0]["w"].dtype == want_g[0]["w"].dtype == np.float32
    assert grads[1].dtype == want_g[1].dtype  # float32, or float0 for the integers
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert_trees_close(grads, want_g, rtol=1e-6, atol=1e-7)


def test_python_scalar_specs_take_jax_dtypes_without_x64():
    art = vs.export(lambda z, w: jnp.abs(z) ** 2 * jnp.sum(w), 1j, 2.0, platforms="cpu")
    assert [(leaf.key, leaf.dtype) for leaf in art.manifest.inputs] == [("z", "complex64"), ("w", "float32")]
    out, res = art.fwd(np.complex64(1 + 2j), np.float32(3.0))
    gz, gw = art.bwd(res)
    want_z, want_w = jax.grad(lambda z, w: jnp.abs(z) ** 2 * w, argnums=(0, 1))(np.complex64(1 + 2j), np.float32(3.0))
    np.testing.assert_allclose([out, gz, gw], [15.0, want_z, want_w], rtol=1e-6)


# ---- jax_enable_x64 on ----


@pytest.mark.parametrize("dtype", list(WIDE), ids=lambda d: np.dtype(d).name)
def test_with_x64_every_64bit_dtype_exports_and_runs_in_64_bits(x64, tmp_path, dtype):
    specs = {"w": S((3,), np.float64), "b": S((2,), np.float32)}, S((3,), dtype)
    vs.export(loss, *specs, platforms="cpu").save(tmp_path / "a.vjps")
    art = vs.load(tmp_path / "a.vjps")
    assert art.manifest.x64
    assert [(leaf.key, leaf.dtype) for leaf in art.manifest.inputs] == [
        ("params/b", "float32"),
        ("params/w", "float64"),
        ("x", np.dtype(dtype).name),
    ]
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=3), "b": rng.normal(size=2).astype(np.float32)}
    x = {
        np.float64: rng.normal(size=3),
        np.int64: np.arange(3, dtype=np.int64) + 2**40,  # beyond int32: a narrowed artifact would wrap
        np.uint64: np.arange(3, dtype=np.uint64) + 2**63,
        np.complex128: rng.normal(size=3) + 1j * rng.normal(size=3),
    }[dtype]
    out, res = art.fwd(params, x)
    grads = art.bwd(res)
    want, want_g = jax.value_and_grad(loss, argnums=(0, 1), allow_int=True)(params, x)
    assert out.dtype == np.float64 and grads[0]["w"].dtype == np.float64
    np.testing.assert_allclose(out, want, rtol=1e-14)
    assert_trees_close(grads[0], want_g[0], rtol=1e-14, atol=0)
    if jnp.issubdtype(dtype, jnp.inexact):
        assert grads[1].dtype == dtype
        np.testing.assert_allclose(grads[1], want_g[1], rtol=1e-14)
    else:  # integers get float0 zeros, as jax.vjp gives
        assert grads[1].dtype == want_g[1].dtype == jax.dtypes.float0


def test_with_x64_split_and_export_stages_run_in_float64(x64):
    params, x, y = staged_values(np.float64)
    want, want_g = jax.value_and_grad(staged)(params, x, y)
    assert want.dtype == np.float64
    fwd, bwd = vs.split(staged, wrt="params")
    out, res = fwd(params, x, y)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, want, rtol=1e-14)
    assert_trees_close(bwd(res), want_g, rtol=1e-13, atol=0)
    stages = vs.export_stages(staged, *staged_specs(np.float64), wrt="params", platforms="cpu")
    assert [a.manifest.x64 for a in stages.artifacts] == [True, True]
    r = P.run(stages, params, (x, y), microbatches=2, schedule="gpipe", runner="inprocess")
    assert np.asarray(r.loss).dtype == np.float64 and r.grads["w1"].dtype == np.float64
    np.testing.assert_allclose(r.loss, want, rtol=1e-13)
    assert_trees_close(r.grads, want_g, rtol=1e-12, atol=0)
