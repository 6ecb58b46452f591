"""Artifacts through the Python API: numerics, symbolic shapes, file checks, refusals."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from jax import export as jexport
from models import MODELS, assert_trees_close, mlp, mlp_inputs, ref_vjp

import vjpsplit_cli as vs
from vjpsplit_cli.artifact.manifest import MAGIC


def structs(tree):
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), tree)


def batch_specs(args, name="b"):
    """Specs with the leading dim of the last argument (the batch) symbolic."""
    (b,) = jexport.symbolic_shape(name)
    *rest, x = args
    return (*map(structs, rest), jax.ShapeDtypeStruct((b, *x.shape[1:]), x.dtype))


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """One artifact per model, exported once with a symbolic batch, saved and loaded back."""
    d = tmp_path_factory.mktemp("arts")
    out = {}
    for name, (fn, make) in MODELS.items():
        args = make()
        specs = batch_specs(args) if name != "nested" else tuple(structs(a) for a in args)
        vs.export(fn, *specs).save(d / f"{name}.vjps")
        out[name] = vs.load(d / f"{name}.vjps")
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_artifact_matches_jax_vjp(artifacts, name):
    fn, make = MODELS[name]
    args = make()
    art = artifacts[name]
    out, res = art.fwd(*args)
    ref_out, ref_grads = ref_vjp(fn, args)
    assert_trees_close(out, ref_out)
    ct = jax.tree_util.tree_map(np.ones_like, ref_out)
    assert_trees_close(art.bwd(res, ct), ref_grads)


@pytest.mark.parametrize("batch", [1, 7, 300])
def test_one_artifact_serves_every_batch(artifacts, batch):
    params, x = mlp_inputs(batch=batch, seed=batch)
    out, res = artifacts["mlp"].fwd(params, x)
    assert res.dims == {"b": batch}
    np.testing.assert_allclose(out, mlp(params, x), rtol=1e-5)
    assert_trees_close(artifacts["mlp"].bwd(res), jax.grad(mlp, argnums=(0, 1))(params, x))


def test_manifest_describes_residuals_and_input_backed_weights(artifacts):
    m = artifacts["mlp"].manifest
    assert m.dim_vars == ("b",)
    assert {r.key for r in m.residuals if r.input_backed} >= {"in/params/w1", "in/params/w2", "in/x"}
    assert all(r.key.startswith("r/") for r in m.stored_residuals)
    assert any("b" in r.shape for r in m.stored_residuals)
    assert [g.key for g in m.grads] == ["params/b1", "params/w1", "params/w2", "x"]
    assert m.platforms == ("cpu", "cuda", "tpu")
    assert len(m.fingerprint) == 64


def test_backward_without_symbolic_inputs_exports():
    # The backward sees only a scalar residual and a scalar cotangent, yet must
    # produce f32[n]: the dims argument makes n solvable.
    (n,) = jexport.symbolic_shape("n")
    art = vs.export(lambda x: jnp.sum(x) ** 2, jax.ShapeDtypeStruct((n,), jnp.float32), wrt=0)
    for size in (1, 5):
        x = np.arange(size, dtype=np.float32)
        _, res = art.fwd(x)
        np.testing.assert_allclose(art.bwd(res), jax.grad(lambda x: jnp.sum(x) ** 2)(x))


def test_integer_inputs_and_outputs(tmp_path):
    def f(x, idx):
        y = x[idx] * 2.0
        return {"y": y, "i": jnp.argmax(y)}

    art = vs.export(f, jax.ShapeDtypeStruct((5,), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.int32))
    assert [g.key for g in art.manifest.grads] == ["x"]  # the int argument gets no entry
    assert [c.key for c in art.manifest.cotangent_leaves] == ["out/y"]
    x, idx = np.arange(5, dtype=np.float32), np.array([4, 0, 4], np.int32)
    out, res = art.fwd(x, idx)
    gx, gi = art.bwd(res, {"y": np.ones(3, np.float32), "i": np.int32(0)})
    _, vjp = jax.vjp(f, x, idx)
    rx, ri = vjp({"y": jnp.ones(3), "i": np.zeros((), jax.dtypes.float0)})
    np.testing.assert_allclose(gx, rx)
    assert gi.dtype == jax.dtypes.float0 and gi.shape == (3,)


def test_has_aux_artifact():
    def f(x):
        return jnp.sum(jnp.sin(x)), {"first": x[0] * 2, "n": jnp.argmax(x)}

    art = vs.export(f, jax.ShapeDtypeStruct((4,), jnp.float32), has_aux=True, wrt=0)
    x = np.linspace(0, 1, 4, dtype=np.float32)
    out, res, aux = art.fwd(x)
    assert set(aux) == {"first", "n"} and int(aux["n"]) == 3
    assert [o.key for o in art.manifest.outputs] == ["out", "aux/first", "aux/n"]
    np.testing.assert_allclose(art.bwd(res), np.cos(x), rtol=1e-6)


@pytest.mark.parametrize(
    "returns, says",
    [(lambda x: jnp.sum(x), "f32[]"), (lambda x: (jnp.sum(x), x, x), "a 3-tuple")],
    ids=["one-array", "three-tuple"],
)
def test_has_aux_without_a_pair_is_one_line(returns, says):
    with pytest.raises(vs.VjpsplitError) as e:
        vs.export(returns, jax.ShapeDtypeStruct((4,), jnp.float32), has_aux=True, platforms="cpu")
    assert e.value.args[0] == f"has_aux is set, so <lambda> must return a pair (out, aux); it returned {says}"


@pytest.mark.parametrize("ext", ["npz", "msgpack"])
@pytest.mark.parametrize("self_contained", [False, True])
def test_artifact_residual_files(artifacts, tmp_path, ext, self_contained):
    params, x = mlp_inputs(batch=3)
    art = artifacts["mlp"]
    _, res = art.fwd(params, x)
    path = tmp_path / f"res.{ext}"
    vs.save_residuals(path, res, self_contained=self_contained)
    _, meta = vs.load_arrays(path)
    assert meta["fingerprint"] == art.manifest.fingerprint
    assert bool(meta["needs_inputs"]) is not self_contained
    loaded = vs.load_residuals(path, inputs=None if self_contained else (params, x))
    assert_trees_close(art.bwd(loaded), art.bwd(res))


def test_residual_file_leaves_inputs_out_by_default(artifacts, tmp_path):
    params, x = mlp_inputs(batch=300)
    _, res = artifacts["mlp"].fwd(params, x)
    vs.save_residuals(tmp_path / "lean.npz", res)
    vs.save_residuals(tmp_path / "full.npz", res, self_contained=True)
    lean, _ = vs.load_arrays(tmp_path / "lean.npz")
    full, _ = vs.load_arrays(tmp_path / "full.npz")
    assert not any(k.startswith("in/") for k in lean)
    assert {"in/x", "in/params/w1", "in/params/w2"} <= set(full)
    assert (tmp_path / "lean.npz").stat().st_size < (tmp_path / "full.npz").stat().st_size


def test_residuals_from_another_artifact_are_refused(artifacts):
    params, x = mlp_inputs()
    _, res = artifacts["mlp"].fwd(params, x)
    with pytest.raises(vs.VjpsplitError, match="another artifact"):
        artifacts["convnet"].bwd(res)


def test_wrong_input_dtype_and_shape_name_the_leaf(artifacts):
    params, x = mlp_inputs()
    with pytest.raises(vs.VjpsplitError, match=r"input 'x': expected f32\[b,6\], got f16\[4,6\]"):
        artifacts["mlp"].fwd(params, x.astype(np.float16))
    with pytest.raises(vs.VjpsplitError, match=r"input 'params/w1': expected f32\[6,8\]"):
        artifacts["mlp"].fwd({**params, "w1": params["w1"][:5]}, x)
    with pytest.raises(vs.VjpsplitError, match="missing input key 'params/b1'"):
        artifacts["mlp"].fwd({k: v for k, v in params.items() if k != "b1"}, x)


def test_symbolic_dim_bound_consistently():
    (b,) = jexport.symbolic_shape("b")
    art = vs.export(
        lambda x, y: jnp.sum(x * y), jax.ShapeDtypeStruct((b,), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.float32)
    )
    with pytest.raises(vs.VjpsplitError, match=r"input 'y': expected f32\[b\] \(with b=3\), got f32\[4\]"):
        art.fwd(np.ones(3, np.float32), np.ones(4, np.float32))


def test_missing_platform_is_a_clean_error():
    art = vs.export(jnp.sin, jax.ShapeDtypeStruct((3,), jnp.float32), platforms="tpu")
    with pytest.raises(vs.VjpsplitError, match="exported for tpu only"):
        art.fwd(np.ones(3, np.float32))


def test_unknown_platform_refused():
    with pytest.raises(vs.VjpsplitError, match="unknown platform"):
        vs.export(jnp.sin, jax.ShapeDtypeStruct((3,), jnp.float32), platforms="gpu9")


def test_host_callbacks_refused_at_export():
    def f(x):
        jax.debug.print("x={}", x)
        return jnp.sum(x**2)

    with pytest.raises(vs.VjpsplitError, match="host callback"):
        vs.export(f, jax.ShapeDtypeStruct((3,), jnp.float32))


def _rewrite(path, mutate):
    data = path.read_bytes()
    top = msgpack.unpackb(data[len(MAGIC) :], raw=False)
    mutate(top)
    path.write_bytes(MAGIC + msgpack.packb(top, use_bin_type=True))


def test_tampered_module_fails_fingerprint(tmp_path):
    vs.export(jnp.sin, jax.ShapeDtypeStruct((3,), jnp.float32)).save(tmp_path / "a.vjps")

    def flip(top):
        b = bytearray(top["bwd"])
        b[len(b) // 2] ^= 0xFF
        top["bwd"] = bytes(b)

    _rewrite(tmp_path / "a.vjps", flip)
    with pytest.raises(vs.VjpsplitError, match="fingerprint mismatch"):
        vs.load(tmp_path / "a.vjps")


def test_newer_format_version_names_both_versions(tmp_path):
    vs.export(jnp.sin, jax.ShapeDtypeStruct((3,), jnp.float32)).save(tmp_path / "a.vjps")
    _rewrite(tmp_path / "a.vjps", lambda top: top["manifest"].update(format_version=vs.FORMAT_VERSION + 1))
    with pytest.raises(
        vs.VjpsplitError, match=rf"format version {vs.FORMAT_VERSION + 1} .*up to {vs.FORMAT_VERSION}.*upgrade"
    ):
        vs.load(tmp_path / "a.vjps")


@pytest.mark.parametrize("content", [b"", b"VJPSPLIT\x00", b"not an artifact", MAGIC + b"\xc1\xc1"])
def test_malformed_artifact_files(tmp_path, content):
    p = tmp_path / "bad.vjps"
    p.write_bytes(content)
    with pytest.raises(vs.VjpsplitError, match=str(p)):
        vs.load(p)


def test_truncated_artifact(tmp_path):
    vs.export(jnp.sin, jax.ShapeDtypeStruct((3,), jnp.float32)).save(tmp_path / "a.vjps")
    data = (tmp_path / "a.vjps").read_bytes()
    for cut in (len(MAGIC) + 3, len(data) // 2, len(data) - 1):
        (tmp_path / "t.vjps").write_bytes(data[:cut])
        with pytest.raises(vs.VjpsplitError, match="t.vjps"):
            vs.load(tmp_path / "t.vjps")


def test_manifest_is_a_frozen_versioned_dataclass():
    art = vs.export(jnp.sin, jax.ShapeDtypeStruct((3,), jnp.float32))
    m = art.manifest
    assert dataclasses.is_dataclass(m) and m.format_version == vs.FORMAT_VERSION
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.policy = "nothing"  # type: ignore[misc]
    assert m.jax_version == jax.__version__ and m.vjpsplit_version == vs.__version__
    assert vs.Manifest.from_json(m.to_json(), "x") == m


@pytest.mark.parametrize("policy", ["everything", "dots", "nothing"])
def test_policy_recorded_and_gradients_equal(policy):
    params, x = mlp_inputs()
    art = vs.export(mlp, *batch_specs((params, x)), policy=policy)
    assert art.manifest.policy == policy
    _, res = art.fwd(params, x)
    assert_trees_close(art.bwd(res), jax.grad(mlp, argnums=(0, 1))(params, x))


def test_future_calling_convention_names_both_versions(tmp_path):
    from vjpsplit_cli.artifact.manifest import fingerprint as _fingerprint

    art = vs.export(jnp.sin, jax.ShapeDtypeStruct((3,), jnp.float32))
    art.save(tmp_path / "a.vjps")

    def future(top):
        top["manifest"]["calling_convention_version"] = 99
        top["manifest"]["jax_version"] = "9.9.9"
        m = vs.Manifest.from_json(top["manifest"], "x")
        top["manifest"]["fingerprint"] = _fingerprint(m, top)

    _rewrite(tmp_path / "a.vjps", future)
    hi = jexport.maximum_supported_calling_convention_version
    with pytest.raises(
        vs.VjpsplitError,
        match=rf"jax 9\.9\.9 .*convention 99; this jax {jax.__version__} runs \d+\.\.{hi}; upgrade jax",
    ):
        vs.load(tmp_path / "a.vjps")


def test_module_without_the_old_device_count_field_runs(tmp_path, monkeypatch):
    # jax >= 0.9.1 no longer writes the 16-bit device count that jax <= 0.7 reads:
    # there such a module deserializes with nr_devices == 0 and Exported.call refuses it.
    real = jexport.deserialize
    monkeypatch.setattr(jexport, "deserialize", lambda b: dataclasses.replace(real(b), nr_devices=0))
    x = np.linspace(0, 1, 3, dtype=np.float32)
    vs.export(jnp.sin, jax.ShapeDtypeStruct((3,), jnp.float32), platforms="cpu").save(tmp_path / "s.vjps")
    art = vs.load(tmp_path / "s.vjps")
    out, res = art.fwd(x)
    assert_trees_close((out, art.bwd(res, jnp.ones(3, jnp.float32))), (jnp.sin(x), (jnp.cos(x),)))


@pytest.mark.parametrize("wrt", [5, "nope", [0, 0], True])
def test_bad_wrt_with_arg_names_is_refused(wrt):
    with pytest.raises(vs.VjpsplitError, match="wrt"):
        vs.export(
            lambda a, b: jnp.sum(a * b),
            jax.ShapeDtypeStruct((2,), jnp.float32),
            jax.ShapeDtypeStruct((2,), jnp.float32),
            arg_names=("a", "b"),
            wrt=wrt,
            platforms="cpu",
        )


def test_a_python_float_is_taken_for_a_bfloat16_scalar_input():
    # Python scalars are weakly typed: the artifact takes them at its own dtype, bfloat16 included.
    import ml_dtypes

    def f(w, s):
        return jnp.sum(w * s)

    w = np.ones(3, ml_dtypes.bfloat16)
    art = vs.export(f, w, jax.ShapeDtypeStruct((), jnp.bfloat16), platforms="cpu")
    out, _ = art.fwd(w, 2.0)
    assert float(out) == 6.0
