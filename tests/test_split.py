"""split(): numerics against jax.vjp, residuals by reference, no re-evaluation, retracing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import MODELS, assert_trees_close, mlp, mlp_inputs, ref_vjp

import vjpsplit_cli as vs


@pytest.mark.parametrize("name", sorted(MODELS))
def test_split_matches_jax_vjp(name):
    fn, make = MODELS[name]
    args = make()
    fwd, bwd = vs.split(fn)
    out, res = fwd(*args)
    ref_out, ref_grads = ref_vjp(fn, args)
    assert_trees_close(out, ref_out)
    ct = jax.tree_util.tree_map(jnp.ones_like, out)
    assert_trees_close(bwd(res, ct), ref_grads)


def test_scalar_output_default_cotangent_is_one():
    params, x = mlp_inputs()
    fwd, bwd = vs.split(mlp)
    _, res = fwd(params, x)
    assert_trees_close(bwd(res), jax.grad(mlp, argnums=(0, 1))(params, x))


def test_non_scalar_output_requires_cotangent():
    fn, make = MODELS["convnet"]
    fwd, bwd = vs.split(fn)
    _, res = fwd(*make())
    with pytest.raises(vs.VjpsplitError, match="cotangent is required"):
        bwd(res)


@pytest.mark.parametrize("wrt,expect", [(0, "single"), ("x", "single"), ([1], "tuple"), (("params", "x"), "tuple")])
def test_wrt_forms(wrt, expect):
    params, x = mlp_inputs()
    fwd, bwd = vs.split(mlp, wrt=wrt)
    _, res = fwd(params, x)
    g = bwd(res)
    names = ["params", "x"]
    pos = [wrt] if isinstance(wrt, (int, str)) else list(wrt)
    pos = [names.index(p) if isinstance(p, str) else p for p in pos]
    ref = jax.grad(mlp, argnums=tuple(pos))(params, x)
    if expect == "single":
        assert_trees_close(g, ref[0])
    else:
        assert isinstance(g, tuple) and len(g) == len(pos)
        assert_trees_close(g, ref)


def test_integer_inputs_get_float0_zeros_like_jax_vjp():
    def f(x, idx, flag):
        return jnp.sum(jnp.where(flag, x[idx] ** 2, 0.0))

    x = jnp.arange(5.0)
    idx = jnp.array([0, 3], jnp.int32)
    flag = jnp.array([True, False])
    fwd, bwd = vs.split(f)
    _, res = fwd(x, idx, flag)
    gx, gi, gf = bwd(res)
    _, vjp = jax.vjp(f, x, idx, flag)
    rx, ri, rf = vjp(jnp.float32(1))
    np.testing.assert_allclose(gx, rx)
    assert gi.dtype == ri.dtype == jax.dtypes.float0 and gi.shape == (2,)
    assert gf.dtype == rf.dtype == jax.dtypes.float0


def test_has_aux_with_integer_aux():
    def f(x, w):
        y = x @ w
        return jnp.sum(y**2), {"argmax": jnp.argmax(y, -1), "mean": jnp.mean(y)}

    params, x = mlp_inputs()
    w = params["w1"]
    fwd, bwd = vs.split(f, has_aux=True)
    out, res, aux = fwd(x, w)
    ref_out, vjp, ref_aux = jax.vjp(f, x, w, has_aux=True)
    assert_trees_close(aux, ref_aux)
    assert_trees_close(out, ref_out)
    assert_trees_close(bwd(res), vjp(jnp.float32(1)))


def test_has_aux_without_a_pair_is_one_line():
    fwd, _ = vs.split(lambda x: jnp.sum(x), has_aux=True)
    with pytest.raises(vs.VjpsplitError) as e:
        fwd(jnp.ones(3))
    assert e.value.args[0].endswith("<lambda> must return a pair (out, aux); it returned f32[]")


def test_integer_output_leaves_take_no_cotangent():
    def f(x):
        return {"y": jnp.sin(x), "i": jnp.argmax(x)}

    x = jnp.linspace(0.0, 1.0, 4)
    fwd, bwd = vs.split(f)
    out, res = fwd(x)
    g = bwd(res, {"y": jnp.ones(4), "i": out["i"]})  # an int leaf's entry is ignored
    assert_trees_close(g, (jnp.cos(x),))


def test_backward_never_evaluates_the_forward():
    calls = {"n": 0}

    def count():
        calls["n"] += 1

    def f(params, x):
        jax.debug.callback(count)
        return mlp(params, x)

    params, x = mlp_inputs()
    fwd, bwd = vs.split(f)
    out, res = fwd(params, x)
    jax.block_until_ready(out)
    jax.effects_barrier()
    assert calls["n"] == 1
    for _ in range(3):
        jax.block_until_ready(bwd(res))
    jax.effects_barrier()
    assert calls["n"] == 1, "the backward ran the forward's callback: it re-evaluated the forward"
    # The same backward under an outer jit: still nothing of the forward.
    jax.block_until_ready(jax.jit(bwd)(res))
    jax.effects_barrier()
    assert calls["n"] == 1


def test_input_backed_residuals_are_the_input_arrays():
    params, x = mlp_inputs()
    params = jax.tree_util.tree_map(jnp.asarray, params)
    x = jnp.asarray(x)
    fwd, _ = vs.split(mlp)
    _, res = fwd(params, x)
    flat = jax.tree_util.tree_leaves((params, x))
    assert res.inputs, "the MLP's backward needs its weights"
    for leaf in res.inputs.values():
        assert any(leaf is a for a in flat), "an input-backed residual was copied"
    stored_ids = {id(a) for a in res.stored.values()}
    assert not stored_ids & {id(a) for a in flat}


def test_retraces_for_new_shapes_and_stays_cached():
    params, _ = mlp_inputs()
    fwd, bwd = vs.split(mlp)
    for batch in (1, 7, 300, 7):
        x = np.random.default_rng(batch).normal(size=(batch, 6)).astype(np.float32)
        _, res = fwd(params, x)
        g = bwd(res)
        assert_trees_close(g, jax.grad(mlp, argnums=(0, 1))(params, x))
    assert fwd.trace_count() == 3  # 1, 7, 300; the second 7 hit jit's cache


def test_fwd_and_bwd_are_jittable():
    params, x = mlp_inputs()
    fwd, bwd = vs.split(mlp)

    @jax.jit
    def step(params, x):
        _, res = fwd(params, x)
        return bwd(res)

    assert_trees_close(step(params, x), jax.grad(mlp, argnums=(0, 1))(params, x))
    out, res = jax.jit(fwd)(params, x)
    assert_trees_close(jax.jit(bwd)(res), jax.grad(mlp, argnums=(0, 1))(params, x))


def test_f1_f2_b2_b1_schedule_in_memory():
    params, x = mlp_inputs(batch=8)
    fwd, bwd = vs.split(mlp, wrt="params")
    _, r1 = fwd(params, x[:4])
    _, r2 = fwd(params, x[4:])
    g2 = bwd(r2, jnp.float32(0.5))
    g1 = bwd(r1, jnp.float32(0.5))
    total = jax.tree_util.tree_map(jnp.add, g1, g2)
    assert_trees_close(total, jax.grad(mlp)(params, x), rtol=1e-4)


@pytest.mark.parametrize("ext", ["npz", "msgpack"])
@pytest.mark.parametrize("self_contained", [False, True])
def test_split_residuals_round_trip_through_files(tmp_path, ext, self_contained):
    params, x = mlp_inputs()
    fwd, bwd = vs.split(mlp)
    _, res = fwd(params, x)
    path = tmp_path / f"res.{ext}"
    vs.save_residuals(path, res, self_contained=self_contained)
    loaded = vs.load_residuals(path, inputs=None if self_contained else (params, x))
    assert_trees_close(bwd(loaded), bwd(res))


def test_split_residuals_without_inputs_are_refused(tmp_path):
    params, x = mlp_inputs()
    fwd, _ = vs.split(mlp)
    _, res = fwd(params, x)
    vs.save_residuals(tmp_path / "r.npz", res)
    with pytest.raises(vs.VjpsplitError, match="inputs"):
        vs.load_residuals(tmp_path / "r.npz")


def test_bwd_rejects_foreign_objects():
    _, bwd = vs.split(mlp)
    with pytest.raises(vs.VjpsplitError, match="residuals returned by this split"):
        bwd({"not": "residuals"})


@pytest.mark.parametrize("policy", ["everything", "dots", "nothing", "names:hidden"])
def test_policies_give_equal_gradients(policy):
    from jax.ad_checkpoint import checkpoint_name

    def f(params, x):
        h = checkpoint_name(jnp.tanh(x @ params["w1"] + params["b1"]), "hidden")
        return jnp.mean((h @ params["w2"]) ** 2)

    params, x = mlp_inputs()
    fwd, bwd = vs.split(f, policy=policy)
    _, res = fwd(params, x)
    assert_trees_close(bwd(res), jax.grad(f, argnums=(0, 1))(params, x))


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(vs.VjpsplitError, match="unknown policy"):
        vs.split(mlp, policy="some")


def test_residuals_are_immutable_pytrees_keyed_by_file_keys():
    import jax.numpy as jnp

    def f(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    w, x = np.ones((3, 2), np.float32), np.ones((4, 3), np.float32)
    art = vs.export(f, w, x, platforms="cpu", weights="w")
    _, res = art.fwd(w, x)
    _, res2 = vs.split(f)[0](w, x)
    _, inter = art.bwd_input(res)
    assert type(res) is vs.Residuals and type(res2) is vs.SplitResiduals and isinstance(res2, vs.Residuals)
    for value in (res, res2, inter):
        with pytest.raises(AttributeError, match="immutable"):
            value.dims = {}
        with pytest.raises(TypeError):
            value.stored["r/0"] = None  # read-only mapping
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(res)[0]]
    assert paths == [f"['{k}']" for k in res.stored] + [f"['in/{k}']" for k in res.inputs]
    inter_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(inter)[0]]
    assert inter_paths[0] == "['c/0']" and all(p.startswith(("['c/", "['r/", "['in/")) for p in inter_paths)
    # A pytree round trip keeps the type, keys and order.
    again = jax.tree_util.tree_map(lambda a: a, res2)
    assert type(again) is vs.SplitResiduals and list(again.stored) == list(res2.stored)
    moved = res.replace(dims={"b": 7})
    assert moved.dims == {"b": 7} and res.dims == {} and moved.stored["r/0"] is res.stored["r/0"]


def test_residual_mappings_are_pytrees_that_pickle_and_copy():
    import copy
    import pickle

    w, x = np.ones((3, 2), np.float32), np.ones((4, 3), np.float32)
    art = vs.export(lambda w, x: jnp.sum(jnp.tanh(x @ w)), w, x, platforms="cpu")
    _, res = art.fwd(w, x)
    placed = jax.device_put(res.stored)  # a mapping of arrays, as a dict would be
    assert list(placed) == list(res.stored) and all(isinstance(v, jax.Array) for v in placed.values())
    for again in (pickle.loads(pickle.dumps(res.stored)), copy.copy(res.stored), copy.deepcopy(res.stored)):
        assert type(again) is type(res.stored) and list(again) == list(res.stored)
        with pytest.raises(TypeError, match="read-only"):
            again["r/0"] = None
