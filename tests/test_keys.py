"""File keys of any pytree, typed PRNG keys, and export's refusals that name the leaf."""

from __future__ import annotations

import json
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from clihelp import opts

import vjpsplit_cli as vs
from vjpsplit_cli.cli import main
from vjpsplit_cli.files.trees import (
    decode_structure,
    encode_structure,
    escape_segment,
    flatten_with_keys,
    split_key,
    structure_keys,
    unescape_segment,
    unflatten_keys,
)


@pytest.mark.parametrize("name", ["mlp/~/linear_0", "100%", "%2F", "a%25b/c", "plain", "~", "%", "//"])
def test_segments_round_trip(name):
    seg = escape_segment(name)
    assert "/" not in seg
    assert unescape_segment(seg) == name


def test_haiku_names_are_one_segment_each():
    tree = {"mlp/~/linear_0": {"w": 1.0, "b": 2.0}, "embed": {"w": 3.0}}
    keys = [k for k, _ in flatten_with_keys("params", tree)]
    assert keys == ["params/embed/w", "params/mlp%2F~%2Flinear_0/b", "params/mlp%2F~%2Flinear_0/w"]
    assert split_key(keys[1]) == ["params", "mlp/~/linear_0", "b"]
    assert unflatten_keys(dict(flatten_with_keys("", tree))) == tree


class Pair(typing.NamedTuple):
    a: typing.Any
    b: typing.Any


def test_structure_of_user_nodes_and_int_keys():
    tree = {"opt": {0: Pair(1.0, None), 1: [2.0, (3.0,)]}, "n": None}
    node = encode_structure(tree)
    assert json.loads(json.dumps(node)) is not None  # plain JSON
    leaves = jax.tree_util.tree_leaves(tree)
    keys = structure_keys("s", node)
    assert keys == [k for k, _ in flatten_with_keys("s", tree)]
    back = decode_structure(node, iter(leaves))
    # Without the class, the NamedTuple is a dict keyed by its fields; int keys stay ints.
    assert back == {"opt": {0: {"a": 1.0, "b": None}, 1: [2.0, (3.0,)]}, "n": None}


def test_keys_that_cannot_be_written_are_refused_by_name():
    with pytest.raises(vs.VjpsplitError, match=r"dict key \(1, 2\) of type tuple.*use str or int"):
        flatten_with_keys("params", {(1, 2): 1.0})
    with pytest.raises(vs.VjpsplitError, match="empty dict key"):
        flatten_with_keys("params", {"": 1.0})
    with pytest.raises(vs.VjpsplitError, match="params: jax cannot flatten it"):
        flatten_with_keys("params", {1: 1.0, "a": 2.0})


def test_int_dict_keys_and_slashes_through_an_artifact_and_files(tmp_path):
    def loss(params, x):
        h = jnp.tanh(x @ params["net/~/lin"]["w%"])
        return jnp.sum(h * params["scales"][3])

    params = {"net/~/lin": {"w%": np.ones((4, 3), np.float32)}, "scales": {3: np.full((3,), 2.0, np.float32)}}
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    art = vs.loads(vs.export(loss, params, x, platforms="cpu").to_bytes())
    assert [leaf.key for leaf in art.manifest.inputs] == ["params/net%2F~%2Flin/w%25", "params/scales/3", "x"]
    out, res = art.fwd(params, x)
    ref = jax.grad(loss, argnums=(0, 1))(params, x)
    g = art.bwd(res)
    np.testing.assert_allclose(g[0]["scales"][3], ref[0]["scales"][3], rtol=1e-6)
    # From files, without the caller's structure: int keys come back as ints (the manifest knows).
    vs.save_residuals(tmp_path / "r.npz", res, self_contained=True)
    g2 = art.bwd(vs.load_residuals(tmp_path / "r.npz"))
    assert set(g2[0]) == {"net/~/lin", "scales"} and set(g2[0]["scales"]) == {3}
    np.testing.assert_allclose(g2[0]["net/~/lin"]["w%"], ref[0]["net/~/lin"]["w%"], rtol=1e-6)
    # np.load lists exactly the escaped keys of the gradients.
    vs.save_arrays(tmp_path / "in.npz", dict(flatten_with_keys("params", params)) | {"x": x})
    runner = CliRunner()
    art.save(tmp_path / "a.vjps")
    r = runner.invoke(
        main,
        [
            "run-fwd",
            str(tmp_path / "a.vjps"),
            *opts(inputs=tmp_path / "in.npz", residuals=tmp_path / "res.npz"),
        ],
    )
    assert r.exit_code == 0, r.output
    r = runner.invoke(
        main,
        [
            "run-bwd",
            str(tmp_path / "a.vjps"),
            *opts(residuals=tmp_path / "res.npz", inputs=tmp_path / "in.npz", grads=tmp_path / "g.npz"),
        ],
    )
    assert r.exit_code == 0, r.output
    with np.load(tmp_path / "g.npz") as f:
        assert sorted(f.files) == ["params/net%2F~%2Flin/w%25", "params/scales/3", "x"]
        np.testing.assert_allclose(f["params/scales/3"], ref[0]["scales"][3], rtol=1e-6)


def test_shapes_from_a_file_unescape_keys(tmp_path):
    def loss(params, x):
        return jnp.sum(x @ params["a/b"]["w"])

    vs.save_arrays(tmp_path / "p.npz", {"a%2Fb/w": np.ones((3, 2), np.float32)})
    (tmp_path / "m.py").write_text(
        "import jax.numpy as jnp\ndef loss(params, x):\n    return jnp.sum(x @ params['a/b']['w'])\n"
    )
    r = CliRunner().invoke(
        main,
        [
            "export",
            f"{tmp_path / 'm.py'}:loss",
            "--shapes",
            f"params={tmp_path / 'p.npz'}",
            "--shapes",
            "x=f32[b,3]",
            "--platforms",
            "cpu",
            "-o",
            str(tmp_path / "a.vjps"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert [leaf.key for leaf in vs.load(tmp_path / "a.vjps").manifest.inputs] == ["params/a%2Fb/w", "x"]


# -- typed PRNG keys -----------------------------------------------------------------------------
def _noisy(x, key):
    """Dropout-like noise from a typed key; returns the loss and the next key (aux)."""
    key, sub = jax.random.split(key)
    keep = jax.random.bernoulli(sub, 0.7, x.shape)
    return jnp.sum(jnp.where(keep, jnp.sin(x), 0.0)), key


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_keys_as_input_and_aux(impl, tmp_path):
    x = np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4)
    key = jax.random.key(3, impl=impl)
    b = jax.export.symbolic_shape("b")[0]
    art = vs.export(
        _noisy,
        jax.ShapeDtypeStruct((b, 4), jnp.float32),
        jax.ShapeDtypeStruct((), key.dtype),
        wrt=0,
        has_aux=True,
        platforms="cpu",
    )
    art = vs.loads(art.to_bytes())
    leaf = art.manifest.inputs[1]
    assert (leaf.key, leaf.dtype, leaf.prng_impl) == ("key", "uint32", impl)
    assert leaf.shape == tuple(jax.random.key_data(key).shape)
    assert art.manifest.outputs[1].prng_impl == impl
    out, res, aux = art.fwd(x, key)
    (ref_out, ref_aux), ref_g = jax.value_and_grad(_noisy, has_aux=True)(x, key)
    np.testing.assert_allclose(out, ref_out, rtol=1e-6)
    assert aux.dtype == key.dtype
    np.testing.assert_array_equal(jax.random.key_data(aux), jax.random.key_data(ref_aux))
    np.testing.assert_allclose(art.bwd(res), ref_g, rtol=1e-6)
    # The CLI reads key data from the inputs file and writes key data to the outputs file.
    art.save(tmp_path / "a.vjps")
    vs.save_arrays(tmp_path / "in.npz", {"x": x, "key": np.asarray(jax.random.key_data(key))})
    r = CliRunner().invoke(
        main,
        [
            "run-fwd",
            str(tmp_path / "a.vjps"),
            *opts(inputs=tmp_path / "in.npz", residuals=tmp_path / "r.npz", outputs=tmp_path / "o.npz"),
        ],
    )
    assert r.exit_code == 0, r.output
    outs, _ = vs.load_arrays(tmp_path / "o.npz")
    np.testing.assert_array_equal(outs["aux"], jax.random.key_data(ref_aux))
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "a.vjps"), "--json"])
    assert json.loads(r.output)["inputs"][1]["prng_impl"] == impl


def test_a_key_of_another_impl_or_an_untyped_key_is_refused_by_name():
    x = np.ones((2, 4), np.float32)
    art = vs.export(_noisy, x, jax.random.key(0), wrt=0, has_aux=True, platforms="cpu")
    with pytest.raises(vs.VjpsplitError, match=r"input 'key': expected a threefry2x32 key, got a rbg key"):
        art.fwd(x, jax.random.key(0, impl="rbg"))
    # Key data is accepted as it is (that is what the CLI passes).
    out, _, _ = art.fwd(x, jax.random.key_data(jax.random.key(0)))
    np.testing.assert_allclose(out, _noisy(x, jax.random.key(0))[0], rtol=1e-6)
    legacy = vs.export(
        lambda x, k: jnp.sum(x * jax.random.normal(k, x.shape)), x, jax.random.PRNGKey(0), wrt=0, platforms="cpu"
    )
    assert legacy.manifest.inputs[1].prng_impl == "" and legacy.manifest.inputs[1].dtype == "uint32"
    with pytest.raises(vs.VjpsplitError, match=r"input 'k': got a typed PRNG key .*jax.random.key_data"):
        legacy.fwd(x, jax.random.key(0))


def test_typed_key_residuals_in_split_files(tmp_path):
    def f(x, key):
        # the key itself reaches the backward: jax.vjp keeps it as a residual
        return jnp.sum(jax.checkpoint(lambda x, k: jnp.sin(x) * jax.random.uniform(k, x.shape))(x, key))

    fwd, bwd = vs.split(f, wrt=0)
    x = np.ones((3,), np.float32)
    out, res = fwd(x, jax.random.key(1))
    vs.save_residuals(tmp_path / "r.msgpack", res, self_contained=True)
    g = bwd(vs.load_residuals(tmp_path / "r.msgpack"))
    np.testing.assert_allclose(g, jax.grad(f)(x, jax.random.key(1)), rtol=1e-6)


# -- refusals at export name the leaf --------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, match",
    [
        ({"w": "hello"}, r"input 'params/w': spec leaf 'hello' is not an array"),
        ({"w": np.array([object()], dtype=object)}, r"input 'params/w': dtype 'object' cannot be stored"),
        ({(1, 2): np.ones(2, np.float32)}, r"dict key \(1, 2\) of type tuple"),
        ({1: np.ones(2, np.float32), "a": np.ones(2, np.float32)}, r"params: jax cannot flatten it"),
    ],
)
def test_export_refuses_unsupported_leaves_by_key(spec, match):
    with pytest.raises(vs.VjpsplitError, match=match):
        vs.export(lambda params: 0.0, spec, platforms="cpu")


def test_fwd_refuses_a_missing_leaf_by_key():
    art = vs.export(
        lambda p: jnp.sum(p["a"] * p["b"]), {"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)}, platforms="cpu"
    )
    with pytest.raises(vs.VjpsplitError, match=r"missing input key 'p/b'"):
        art.fwd({"a": np.ones(2, np.float32)})
    with pytest.raises(vs.VjpsplitError, match=r"input 'p/b': expected f32\[2\], got i32\[2\]"):
        art.fwd({"a": np.ones(2, np.float32), "b": np.ones(2, np.int32)})
