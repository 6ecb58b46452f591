"""Symbolic artifacts with JAX's own LAPACK calls run unsigned (issues 27, 50): their kernels are checked at the call's shapes.

Each function's symbolic dim reaches the LAPACK call's operands; every artifact is
exported, loaded unsigned without ``allow_kernels`` and run at two sizes, through
the Python API and the CLI, and its gradients are compared with ``jax.value_and_grad``.
Every LAPACK kernel jax.export serializes has a case (getrf, potrf, geqrf, orgqr,
syevd, gesdd, trsm; geev, gees, gehrd, sytrd, gtsv since issue 50), and the shape
rule is held to each kernel's real and complex calls as JAX lowers them: accepted
as they are, refused with any result one element smaller. A forged kernel call
whose shapes, once refined, disagree with the module is refused.
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


def eig(x):
    return jnp.sum(jnp.abs(jnp.linalg.eigvals(x)))  # LAPACK geev


def schur(x):  # LAPACK gees (JAX has no derivative of schur: the gradient flows around it)
    t, z = jax.scipy.linalg.schur(jax.lax.stop_gradient(x))
    return jnp.sum(t**2) * jnp.sum(jnp.sin(x)) + jnp.sum(jnp.abs(z))


def hessenberg(x):  # LAPACK gehrd, at a symbolic batch: JAX's lowering needs n constant
    h = jax.scipy.linalg.hessenberg(jax.lax.stop_gradient(x))
    return jnp.sum(h**2) * jnp.sum(jnp.sin(x))


def tridiagonal(x):  # LAPACK sytrd
    _, d, e, _ = jax.lax.linalg.tridiagonal(jax.lax.stop_gradient(_spd(x)))
    return (jnp.sum(d) + jnp.sum(e**2)) * jnp.sum(jnp.sin(x))


def tridiagonal_solve(x):  # LAPACK gtsv
    dl, d, du = 0.1 * x[:, 0], 4.0 + x[:, 1] ** 2, 0.1 * x[:, 2]
    return jnp.sum(jax.lax.linalg.tridiagonal_solve(dl, d, du, x) ** 2)


# name -> (function, argument spec templates with "n" symbolic, sizes of n to run)
CASES = {
    "eig": (eig, ["f32[n,n]"]),
    "schur": (schur, ["f32[n,n]"]),
    "hessenberg": (hessenberg, ["f32[n,4,4]"]),
    "tridiagonal": (tridiagonal, ["f32[n,n]"]),
    "tridiagonal_solve": (tridiagonal_solve, ["f32[n,3]"]),
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


# ----------------------------------------------------------------------------- the shape rule, per kernel

_SQUARE = np.linspace(-1, 1, 2 * 4 * 4, dtype=np.float32).reshape(2, 4, 4) + 3 * np.eye(4, dtype=np.float32)
# kernel -> a function whose lowering calls it, for a [2, 4, 4] float32 input (complex: its complex64 twin)
KERNELS = {
    "geev": lambda x: jnp.linalg.eig(x)[1],
    "gees": lambda x: jax.scipy.linalg.schur(x)[1],
    "gehrd": jax.scipy.linalg.hessenberg,
    "sytrd": lambda x: jax.lax.linalg.tridiagonal(x)[3],
    "gtsv": lambda x: jax.lax.linalg.tridiagonal_solve(x[..., 0], x[..., 1], x[..., 2], x),
    "getrf": lambda x: jax.scipy.linalg.lu_factor(x)[0],
    "potrf": lambda x: jnp.linalg.cholesky(_spd(x)),
    "geqrf": lambda x: jnp.linalg.qr(x)[1],
    "syevd": lambda x: jnp.linalg.eigh(x)[1],
    "gesdd": lambda x: jnp.linalg.svd(x)[0],
    "trsm": lambda x: jax.scipy.linalg.solve_triangular(x, x),
}


def _kernel_calls(fn, dtype, platform="cpu", prefix="lapack_"):
    from vjpsplit_cli.trust.mlirprobe import probe

    exp = jexport.export(jax.jit(fn), platforms=[platform])(jax.ShapeDtypeStruct(_SQUARE.shape, dtype))
    return [c for c in probe(exp.mlir_module_serialized)["calls"] if c["target"].startswith(prefix)]


@pytest.mark.parametrize("dtype", [np.float32, np.complex64])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_each_lapack_kernel_is_vouched_for_as_jax_lowers_it_and_refused_with_a_smaller_result(kernel, dtype):
    from vjpsplit_cli.trust.custom_calls import lapack_shapes_ok

    calls = _kernel_calls(KERNELS[kernel], dtype)
    letter = "s" if dtype == np.float32 else "c"
    names = {"sytrd": "hetrd", "syevd": "heevd"}.get(kernel, kernel) if letter == "c" else kernel
    assert any(c["target"] == f"lapack_{letter}{names}_ffi" for c in calls), [c["target"] for c in calls]
    for call in calls:
        assert lapack_shapes_ok(call), call
        for i, (elt, dims) in enumerate(call["results"]):
            if dims:  # one element short in the last dim: the kernel would write past its end
                smaller = [*call["results"][:i], [elt, [*dims[:-1], dims[-1] - 1]], *call["results"][i + 1 :]]
                assert not lapack_shapes_ok({**call, "results": smaller}), (call["target"], i)
        batchless = {**call, "results": [[elt, dims[1:]] if dims else [elt, dims] for elt, dims in call["results"]]}
        assert not lapack_shapes_ok(batchless), call["target"]  # results for one matrix of the two


def test_gehrd_and_gees_attributes_are_held_to_what_jax_passes():
    from vjpsplit_cli.trust.custom_calls import lapack_shapes_ok

    (gehrd,) = _kernel_calls(KERNELS["gehrd"], np.float32)
    config = gehrd["attrs"]["mhlo.backend_config"]
    assert lapack_shapes_ok(gehrd) and "high = 4 : i32" in config
    for forged in (config.replace("high = 4", "high = 9"), config.replace("low = 1", "low = 0"), "{}"):
        assert not lapack_shapes_ok({**gehrd, "attrs": {"mhlo.backend_config": forged}}), forged
    (gees,) = _kernel_calls(KERNELS["gees"], np.float32)
    config = gees["attrs"]["mhlo.backend_config"]
    assert lapack_shapes_ok(gees) and "sort = 78 : ui8" in config
    sorting = config.replace("sort = 78", "sort = 83")  # 'S': LAPACK would call a select function JAX never gives
    assert not lapack_shapes_ok({**gees, "attrs": {"mhlo.backend_config": sorting}})


@pytest.mark.parametrize("dtype", [np.float32, np.complex64])
def test_cusolver_sytrd_is_vouched_for_as_jax_lowers_it_for_cuda_and_lapack_only_kernels_are_not(dtype):
    from vjpsplit_cli.trust.custom_calls import lapack_shapes_ok

    (call,) = _kernel_calls(KERNELS["sytrd"], dtype, platform="cuda", prefix="cusolver_")
    assert call["target"] == "cusolver_sytrd_ffi" and lapack_shapes_ok(call)
    short = [*call["results"][:2], [call["results"][2][0], [2, 2]], *call["results"][3:]]
    assert not lapack_shapes_ok({**call, "results": short})
    # cuSOLVER's geev returns other buffers than LAPACK's: LAPACK's shapes under its name are not vouched for
    (geev,) = _kernel_calls(KERNELS["geev"], dtype)
    assert not lapack_shapes_ok({**geev, "target": "cusolver_geev_ffi"})
