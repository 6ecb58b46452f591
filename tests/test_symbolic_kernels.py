"""Symbolic artifacts with JAX's own LAPACK calls run unsigned (issue 27): their kernels are checked at the call's shapes.

Each function's symbolic dim reaches the LAPACK call's operands; every artifact is
exported, loaded unsigned without ``allow_kernels`` and run at two sizes, through
the Python API and the CLI, and its gradients are compared with ``jax.value_and_grad``.
A forged kernel call whose shapes, once refined, disagree with the module is refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from clihelp import opts
from jax import export as jexport

import vjpsplit_cli as vs
from vjpsplit_cli.cli import main
from vjpsplit_cli.trust import verdicts as trust


def _spd(x):
    n = x.shape[-1]
    return x @ jnp.swapaxes(x, -1, -2) + n * jnp.eye(n, dtype=x.dtype)


def solve(a, b):
    return jnp.sum(jnp.linalg.solve(a + a.shape[0] * jnp.eye(a.shape[0], dtype=a.dtype), b) ** 2)


def cholesky(x):
    return jnp.sum(jnp.linalg.cholesky(_spd(x)) ** 2)


def qr(x):
    q, r = jnp.linalg.qr(x)
    return jnp.sum(q[..., 0] * x[..., 0]) + jnp.sum(r**2)


def eigh(x):
    w, v = jnp.linalg.eigh(_spd(x))
    return jnp.sum(w) + jnp.sum(jnp.abs(v[:, -1]))


def svd(x):
    return jnp.sum(jnp.linalg.svd(x, compute_uv=False))


def lu(x):
    _, low, up = jax.scipy.linalg.lu(_spd(x))
    return jnp.sum(low**2) + jnp.sum(up**2)


def inv(x):
    return jnp.sum(jnp.linalg.inv(_spd(x)) ** 2)


def det(x):
    return jnp.linalg.slogdet(_spd(x))[1]


# name -> (function, argument spec templates with "n" symbolic, sizes of n to run)
CASES = {
    "solve": (solve, ["f32[n,n]", "f32[n,3]"]),
    "cholesky": (cholesky, ["f32[n,n]"]),
    "qr": (qr, ["f32[n,5,3]"]),  # a symbolic batch of matrices
    "eigh": (eigh, ["f32[n,n]"]),
    "svd": (svd, ["f32[n,n]"]),
    "lu": (lu, ["f32[n,n]"]),
    "inv": (inv, ["f32[n,n]"]),
    "det": (det, ["f32[n,n]"]),
}
SIZES = (4, 7)


def _structs(specs):
    (n,) = jexport.symbolic_shape("n")
    out = []
    for spec in specs:
        dims = spec[spec.index("[") + 1 : -1].split(",")
        out.append(jax.ShapeDtypeStruct(tuple(n if d == "n" else int(d) for d in dims), np.float32))
    return out


def _inputs(specs, size, seed=0):
    rng = np.random.default_rng(seed + size)
    out = []
    for spec in specs:
        dims = spec[spec.index("[") + 1 : -1].split(",")
        out.append(rng.normal(size=[size if d == "n" else int(d) for d in dims]).astype(np.float32))
    return out


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-3, atol=2e-4)


@pytest.mark.parametrize("name", sorted(CASES))
def test_symbolic_linear_algebra_runs_unsigned_through_the_python_api(name, tmp_path):
    fn, specs = CASES[name]
    art = vs.export(fn, *_structs(specs), platforms="cpu")
    assert b"lapack_" in art.modules["fwd"]
    art.save(tmp_path / "a.vjps")
    loaded = vs.load(tmp_path / "a.vjps", cache_dir=None)  # unsigned, no allow_kernels
    assert "fwd" in loaded._check_at_call  # the symbolic LAPACK calls wait for the call's shapes
    for size in SIZES:
        args = _inputs(specs, size)
        out, res = loaded.fwd(*args)
        grads = loaded.bwd(res)
        value, want = jax.value_and_grad(fn, argnums=tuple(range(len(args))))(*args)
        _close(out, value)
        for g, w in zip(grads if isinstance(grads, tuple) else (grads,), want):
            _close(g, w)


@pytest.mark.parametrize("name", sorted(CASES))
def test_symbolic_linear_algebra_runs_unsigned_through_the_cli(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VJPSPLIT_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "m.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "import sys\nsys.path.insert(0, %r)\n"
        % str(__import__("pathlib").Path(__file__).parent)
        + f"from test_symbolic_kernels import {name} as fn\n"
    )
    fn, specs = CASES[name]
    params = ["a", "b"][: len(specs)] if name == "solve" else ["x"]
    shapes = [w for p, s in zip(params, specs) for w in ("--shapes", f"{p}={s}")]
    r = CliRunner().invoke(main, ["export", "m.py:fn", *shapes, *opts(platforms="cpu"), "-o", "a.vjps"])
    assert r.exit_code == 0, r.stderr
    for size in SIZES:
        args = _inputs(specs, size)
        vs.save_arrays(f"in{size}.npz", dict(zip(params, args)))
        r = CliRunner().invoke(
            main, ["run-fwd", "a.vjps", *opts(inputs=f"in{size}.npz", residuals=f"r{size}.npz", outputs=f"o{size}.npz")]
        )
        assert r.exit_code == 0, r.stderr
        r = CliRunner().invoke(
            main, ["run-bwd", "a.vjps", *opts(inputs=f"in{size}.npz", residuals=f"r{size}.npz", grads=f"g{size}.npz")]
        )
        assert r.exit_code == 0, r.stderr
        value, want = jax.value_and_grad(fn, argnums=tuple(range(len(args))))(*args)
        _close(vs.load_arrays(f"o{size}.npz")[0]["out"], value)
        grads = vs.load_arrays(f"g{size}.npz")[0]
        for p, w in zip(params, want):
            _close(grads[p], w)


def test_the_verdict_is_kept_per_refined_signature(tmp_path, monkeypatch):
    from vjpsplit_cli.trust import kernelcheck

    fn, specs = CASES["cholesky"]
    data = vs.export(fn, *_structs(specs), platforms="cpu").to_bytes()
    seen = []
    real = kernelcheck.refined_calls
    monkeypatch.setattr(kernelcheck, "refined_calls", lambda *a: seen.append(1) or real(*a))
    trust.forget_verdicts()
    a = vs.loads(data, cache_dir=tmp_path / "cache")
    for size in (4, 4, 5, 4):
        a.fwd(*_inputs(specs, size))
    assert len(seen) == 2  # once per size
    trust.forget_verdicts()  # a fresh process: the private cache directory keeps the verdicts
    b = vs.loads(data, cache_dir=tmp_path / "cache")
    b.fwd(*_inputs(specs, 5))
    assert len(seen) == 2


def _forged_trsm(b_cols_declared):
    """A symbolic module calling LAPACK's trsm, JAX-style, with its result declared ``[n, b_cols_declared(n)]``."""

    def body(a, b):
        n = a.shape[0]
        res = jax.ffi.ffi_call("lapack_strsm_ffi", jax.ShapeDtypeStruct((n, b_cols_declared(b.shape[1])), np.float32))(
            a, b, side=np.uint8(76), uplo=np.uint8(76), trans_x=np.uint8(78), diag=np.uint8(78)
        )
        return jnp.sum(res)

    return body


def test_a_forged_kernel_call_whose_refined_shapes_disagree_is_refused(tmp_path):
    (n,) = jexport.symbolic_shape("n")
    s = jax.ShapeDtypeStruct
    a_spec, b_spec = s((n, n), np.float32), s((n, 1), np.float32)  # b's columns are 1, always
    fn = _forged_trsm(lambda cols: 2 * n)  # a result of [n, 2n]: far larger than the b it overwrites
    exp = jexport.export(
        jax.jit(fn), platforms=["cpu"], disabled_checks=[jexport.DisabledSafetyCheck.custom_call("lapack_strsm_ffi")]
    )(a_spec, b_spec)
    art = vs.export(lambda a, b: jnp.sum(a) + jnp.sum(b), a_spec, b_spec, platforms="cpu", policy="nothing")
    forged = _replace_fwd_with(art, exp)
    loaded = vs.loads(forged, cache_dir=None)  # symbolic at load: deferred to the call
    assert loaded._check_at_call == {"fwd"}
    with pytest.raises(vs.VjpsplitError, match=r"lapack_strsm_ffi.*cannot vouch for at the call's shapes") as e:
        loaded.fwd(np.eye(4, dtype=np.float32), np.ones((4, 1), np.float32))
    assert "\n" not in str(e.value)
    # On the CLI: one line, no outputs.
    (tmp_path / "f.vjps").write_bytes(forged)
    vs.save_arrays(tmp_path / "in.npz", {"a": np.eye(4, dtype=np.float32), "b": np.ones((4, 1), np.float32)})
    r = CliRunner().invoke(
        main, ["run-fwd", str(tmp_path / "f.vjps"), *opts(inputs=tmp_path / "in.npz", residuals=tmp_path / "r.npz")]
    )
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and "cannot vouch for at the call's shapes" in lines[0], r.stderr
    assert not (tmp_path / "r.npz").exists()


def _replace_fwd_with(art, body_exp) -> bytes:
    """``art``'s file whose forward's outputs all come from ``body_exp`` (a scalar), re-fingerprinted."""
    import dataclasses

    import msgpack

    from vjpsplit_cli.artifact.manifest import MAGIC, fingerprint

    outs = art._exps["fwd"].out_avals
    (n,) = jexport.symbolic_shape("n")

    def fwd(a, b):
        v = body_exp.call(a, b)
        return tuple(jnp.broadcast_to(v, o.shape).astype(o.dtype) for o in outs)

    exp = jexport.export(
        jax.jit(fwd), platforms=["cpu"], disabled_checks=[jexport.DisabledSafetyCheck.custom_call("lapack_strsm_ffi")]
    )(*[jax.ShapeDtypeStruct(leaf_shape, np.float32) for leaf_shape in ((n, n), (n, 1))])
    modules = dict(art.modules)
    modules["fwd"] = bytes(exp.serialize())
    m = dataclasses.replace(art.manifest, fingerprint="")
    m = dataclasses.replace(m, fingerprint=fingerprint(m, modules))
    return MAGIC + msgpack.packb({"manifest": m.to_json(), **modules}, use_bin_type=True)
