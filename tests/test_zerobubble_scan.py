"""Zero bubble inside scan: scanned layers and recurrent cells split into B and W like unscanned ones.

For each model: bwd_input + bwd_weight equal the fused backward and jax.vjp; bwd_input's
StableHLO holds no weight-gradient dot_general (a dot whose result has a weight's shape, no
batch dim); pipelines of such stages under ZB-H1 and ZB-V equal value_and_grad.
"""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from jax import export as jexport
from jax.extend import core as jcore
from models import assert_trees_close

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.artifact.report import weight_part_bytes
from vjpsplit_cli.cli import main
from vjpsplit_cli.tracing.fission import cut_inside
from vjpsplit_cli.tracing.jaxprs import iter_eqns
from vjpsplit_cli.files.sizes import format_bytes_terms, total_bytes

D, T, LAYERS = 12, 5, 4


# -- models ------------------------------------------------------------------------------------------
def scanned_mlp(params, x):
    """Stacked weights: LAYERS dense layers under one scan (scan over layers)."""

    def layer(h, p):
        return jnp.tanh(h @ p["w"] + p["b"]), None

    h, _ = jax.lax.scan(layer, x, params)
    return h


def remat_mlp(params, x):
    """The same layers with a checkpointed body that calls a nested jit."""
    dense = jax.jit(lambda h, w, b: h @ w + b)

    @jax.checkpoint
    def layer(h, p):  # relu is a custom_jvp: its recompute in the backward binds one
        return jax.nn.relu(dense(h, p["w"], p["b"])), None

    h, _ = jax.lax.scan(layer, x, params)
    return h


def jit_layers(params, x):
    """No scan: each layer a nested jit, which the backward holds as a jit equation."""
    dense = jax.jit(lambda h, w, b: jnp.tanh(h @ w + b))
    for i in range(LAYERS):
        x = dense(x, params["w"][i], params["b"][i])
    return x


def gru(params, x):
    """Shared weights over time: x is (batch, time, features), the output h_t for every t."""

    def cell(h, xt):
        z = jax.nn.sigmoid(xt @ params["wz"] + h @ params["uz"] + params["bz"])
        r = jax.nn.sigmoid(xt @ params["wr"] + h @ params["ur"])
        c = jnp.tanh(xt @ params["wh"] + (r * h) @ params["uh"])
        h = (1 - z) * h + z * c
        return h, h

    h0 = jnp.zeros((x.shape[0], D), x.dtype)
    _, hs = jax.lax.scan(cell, h0, jnp.swapaxes(x, 0, 1))
    return jnp.swapaxes(hs, 0, 1)


def lstm(params, x):
    """An LSTM over time with one fused gate matrix (shared weights)."""

    def cell(carry, xt):
        h, c = carry
        g = jnp.concatenate([xt, h], axis=-1) @ params["w"] + params["b"]
        i, f, o, u = jnp.split(g, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(u)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    zeros = jnp.zeros((x.shape[0], D), x.dtype)
    _, hs = jax.lax.scan(cell, (zeros, zeros), jnp.swapaxes(x, 0, 1))
    return jnp.swapaxes(hs, 0, 1)


def _flax_stage():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.MultiHeadDotProductAttention(num_heads=2, deterministic=True)(nn.LayerNorm()(x))
            x = x + h
            h = nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(x))))
            return x + h, None

    class Stage(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)
            x, _ = stack()(x, None)
            return x

    model = Stage()
    params = model.init(jax.random.key(0), jnp.zeros((1, T, D)))["params"]
    return lambda params, x: model.apply({"params": params}, x), params


def _init(name, rng):
    normal = lambda *shape: (rng.normal(size=shape) / np.sqrt(shape[0])).astype(np.float32)  # noqa: E731
    if name in ("scanned_mlp", "remat_mlp", "jit_layers"):
        return {"w": normal(LAYERS, D, D) * np.sqrt(LAYERS), "b": normal(LAYERS, D) * 0.1}
    if name == "gru":
        return {k: normal(D, D) for k in ("wz", "uz", "wr", "ur", "wh", "uh")} | {"bz": normal(D) * 0.1}
    if name == "lstm":
        return {"w": normal(2 * D, 4 * D), "b": normal(4 * D) * 0.1}
    raise KeyError(name)


@functools.lru_cache(maxsize=None)  # exporting dominates; tests never mutate what it returns
def model(name):
    """(fn, params, the x spec with a symbolic batch, an x of batch 6)."""
    rng = np.random.default_rng(0)
    (b,) = jexport.symbolic_shape("b")
    if name == "flax_transformer":
        fn, params = _flax_stage()
        params = jax.tree_util.tree_map(np.asarray, params)
    else:
        fn, params = globals()[name], jax.tree_util.tree_map(lambda a: a.astype(np.float32), _init(name, rng))
    x_shape = (6, D) if name in ("scanned_mlp", "remat_mlp", "jit_layers") else (6, T, D)
    x_spec = jax.ShapeDtypeStruct((b, *x_shape[1:]), jnp.float32)
    return fn, params, x_spec, rng.normal(size=x_shape).astype(np.float32)


@functools.lru_cache(maxsize=None)
def exported(name, wrt=("params", "x")):
    fn, params, x_spec, _ = model(name)
    spec = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    return vs.export(fn, spec, x_spec, wrt=wrt, weights="params", platforms="cpu")


MODELS = ["scanned_mlp", "remat_mlp", "jit_layers", "gru", "lstm", "flax_transformer"]


# -- StableHLO: which dot_generals each part holds -----------------------------------------------------
def dot_results(art, module: str) -> list[tuple]:
    """Result shapes of the dot_generals in one exported module ('?' for a symbolic dim)."""
    text = art._exps[module].mlir_module()
    shapes = re.findall(r"stablehlo\.dot_general.*?->\s*tensor<([^>]*)>", text)
    return [tuple(d if d == "?" else int(d) for d in s.split("x")[:-1]) for s in shapes]


def weight_gradient_shapes(params) -> set[tuple]:
    """Shapes a weight-gradient matmul can produce: a weight (or one layer's slice of it), in either order."""
    out = set()
    for leaf in jax.tree_util.tree_leaves(params):
        shape = tuple(np.shape(leaf))
        for k in range(len(shape) - 1):
            tail = shape[k:]
            out |= {tail, tail[::-1]}
            if len(tail) > 2:  # a kernel (in, heads, dim) is contracted as (in, heads*dim)
                out |= {(tail[0], int(np.prod(tail[1:]))), (int(np.prod(tail[:-1])), tail[-1])}
                out |= {(int(np.prod(tail[1:])), tail[0]), (tail[-1], int(np.prod(tail[:-1])))}
    return out


@pytest.mark.parametrize("name", MODELS)
def test_input_part_holds_no_weight_gradient_dot(name):
    art = exported(name)
    _, params, _, _ = model(name)
    wshapes = weight_gradient_shapes(params)
    fused, b, w = dot_results(art, "bwd"), dot_results(art, "bwd_input"), dot_results(art, "bwd_weight")
    assert any(s in wshapes for s in fused), "the fused backward has weight-gradient dots to move"
    assert not [s for s in b if s in wshapes or "?" not in s], f"weight-gradient dots left in bwd_input: {b}"
    assert w and all("?" not in s for s in w), f"bwd_weight's dots should all contract the batch: {w}"
    # Each weight-gradient dot of the fused loop body is one dot (batched or iteration-contracted) in W.
    # (The fused jit_layers calls one nested function, with one dot in its text, once per layer.)
    assert len(w) == (LAYERS if name == "jit_layers" else len([s for s in fused if "?" not in s]))


def _check_split(name, wrt, batch=6, seed=1):
    art = exported(name, wrt)
    fn, params, _, x = model(name)
    x = x[:batch]
    out, res = art.fwd(params, x)
    ct = np.random.default_rng(seed).normal(size=np.shape(out)).astype(np.float32)
    fused = art.bwd(res, ct)
    grads_in, inter = art.bwd_input(res, ct)
    grads_w = art.bwd_weight(res, inter)
    _, vjp = jax.vjp(fn, params, x)
    ref_params, ref_x = vjp(ct)
    fused_params = fused[0] if isinstance(fused, tuple) else fused
    assert_trees_close(grads_w["params"], fused_params, rtol=1e-5, atol=1e-5)
    assert_trees_close(grads_w["params"], ref_params, rtol=1e-4, atol=1e-5)
    if "x" in wrt:
        assert set(grads_in) == {"x"}
        assert_trees_close(grads_in["x"], fused[1], rtol=1e-5, atol=1e-5)
        assert_trees_close(grads_in["x"], ref_x, rtol=1e-4, atol=1e-5)
    else:
        assert grads_in == {}


@pytest.mark.parametrize("name", MODELS)
def test_split_equals_fused_backward_and_vjp(name):
    _check_split(name, ("params", "x"))


@pytest.mark.parametrize("name", ["scanned_mlp", "gru"])
def test_first_stage_b_still_walks_the_cotangent_back(name):
    # Nobody needs the input gradient: B still runs the reverse scan (dx carry), W only contractions.
    art = exported(name, ("params",))
    b = dot_results(art, "bwd_input")
    assert b and all("?" in s for s in b)
    _check_split(name, ("params",), batch=3)


@pytest.mark.parametrize("name", MODELS)
def test_what_w_holds_is_no_larger_than_the_residuals_the_scan_reads(name, tmp_path):
    m = exported(name).manifest
    held = weight_part_bytes(m)
    stored = total_bytes(m.stored_residuals)
    stacks = [leaf for leaf in m.intermediates if "b" in leaf.shape]
    assert stacks, "B hands W the cotangents its contractions need"
    # Per microbatch (the b-proportional terms) B's stacks stay within the stored residuals and, but
    # under remat (which stores only each layer's input, which W reads too), so does all W holds.
    assert 0 < held["intermediates"]["b"] <= stored["b"], (held, stored)
    if name != "remat_mlp":
        assert held["total"]["b"] <= stored["b"], (held, stored)
    exported(name).save(tmp_path / "a.vjps")
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "a.vjps"), "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)["weight_part_bytes"]
    assert got == {k: format_bytes_terms(v) for k, v in held.items()} and "·b" in got["total"]
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "a.vjps")])
    assert f"held between B and W per microbatch: {got['total']}" in r.stdout


def test_a_scan_whose_stacks_would_outgrow_its_residuals_stays_whole():
    # B's carry needs big_t = dh_t (x) x_t (8 x 64 per step), and so does W's contraction: emitting big_t
    # would hold 8x the scan's stacked residuals (x, 64 per step), so the scan is not cut.
    def bwd(v, xs, ct):
        def body(carry, x):
            dh, acc = carry
            big = dh[:, None] * x[None, :]
            return (big.sum(1), acc + big @ v), None

        (dh, acc), _ = jax.lax.scan(body, (ct, jnp.zeros((8, 4))), xs, reverse=True)
        return dh, acc

    args = (jnp.ones((64, 4)) * 0.1, jnp.linspace(0, 1, 3 * 64).reshape(3, 64), jnp.arange(8.0))
    closed = jax.make_jaxpr(bwd)(*args)
    cut = cut_inside(closed, needed_outs=[0])
    scans = [e for e in iter_eqns(cut) if e.primitive.name == "scan"]
    assert len(scans) == 1 and sum(e.primitive.name == "dot_general" for e in iter_eqns(scans[0].params["jaxpr"])) == 1
    assert_trees_close(tuple(jcore.jaxpr_as_fun(cut)(*args)), bwd(*args), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("merge", [True, False])
def test_cut_scan_sums_shared_weight_gradients_in_one_contraction(merge):
    # The GRU's shared-weight gradients: no loop in W, each one dot_general that contracts time and batch:
    # merged into one axis of time x batch rows (one GEMM), or as two axes (sharded stages, merge=False).
    fn, params, x_spec, x = model("gru")

    def bwd(p, x, ct):
        return jax.vjp(fn, p, x)[1](ct)

    args = (params, x, np.ones_like(x))
    closed = jax.make_jaxpr(bwd)(*args)
    n_params = len(jax.tree_util.tree_leaves(params))
    cut = cut_inside(closed, needed_outs=[n_params], merge=merge)
    top = [e for e in cut.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(top) == 6
    for e in top:
        (lc, rc), _ = e.params["dimension_numbers"]
        if merge:
            assert lc == rc == (0,) and all(v.aval.shape[0] == x.shape[0] * x.shape[1] for v in e.invars)
        else:
            assert lc == rc == (0, 1)
    assert_trees_close(
        jcore.jaxpr_as_fun(cut)(*jax.tree_util.tree_leaves(args)),
        jcore.jaxpr_as_fun(closed)(*jax.tree_util.tree_leaves(args)),
        rtol=1e-5,
        atol=1e-6,
    )


# -- pipelines of scanned stages -----------------------------------------------------------------------
def _head(params, x, labels):
    logits = x.reshape(x.shape[0], -1) @ params["w"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


@functools.lru_cache(maxsize=None)
def head_artifact(kind):
    _, _, x_spec, _ = model(kind)
    feat = int(np.prod(x_spec.shape[1:]))
    spec = {"w": jax.ShapeDtypeStruct((feat, 3), jnp.float32)}
    labels_spec = jax.ShapeDtypeStruct(x_spec.shape[:1], jnp.int32)
    return vs.export(_head, spec, x_spec, labels_spec, weights="params", platforms="cpu", wrt=("params", "x"))


def pipeline(kind, stages):
    """``stages - 1`` scanned stages of ``kind`` and a classifier head, exported for the split backward.

    Stages after the first share one artifact (same function and shapes), with their own parameters.
    """
    fn, p0, x_spec, x = model(kind)
    rng = np.random.default_rng(7)
    params = [jax.tree_util.tree_map(lambda a, i=i: (a * (1 + 0.1 * i)).astype(a.dtype), p0) for i in range(stages - 1)]
    feat = int(np.prod(x_spec.shape[1:]))
    params.append({"w": (rng.normal(size=(feat, 3)) / np.sqrt(feat)).astype(np.float32)})
    arts = [exported(kind, ("params",))] + [exported(kind)] * (stages - 2) + [head_artifact(kind)]
    x = np.concatenate([x, x[::-1] * 0.5])  # 12 rows: 4 microbatches of 3
    labels = rng.integers(0, 3, x.shape[0]).astype(np.int32)

    def whole(params, x, labels):
        for p in params[:-1]:
            x = fn(p, x)
        return _head(params[-1], x, labels)

    return arts, params, x, labels, whole


@pytest.mark.parametrize("kind", ["scanned_mlp", "gru", "flax_transformer"])
@pytest.mark.parametrize("schedule,stages", [("zbh1", 3), ("zbv", 4)])
def test_pipeline_of_scanned_stages_equals_value_and_grad(kind, schedule, stages):
    arts, params, x, labels, whole = pipeline(kind, stages)
    r = P.run(arts, params, x, [labels], microbatches=4, schedule=schedule)
    loss, grads = jax.value_and_grad(whole)(params, x, labels)
    np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
    # Three scanned stages of growing weights are ill-conditioned: float32 itself is off by
    # ~2.5e-4 of the largest gradient here, and jax 0.6.2 orders the stages' sums differently from
    # the whole model's. So both are held to the float64 truth: the pipeline must be as close to
    # it as one process's value_and_grad is (a wrong gradient is off by far more).
    truth = _float64_grads(whole, params, x, labels)
    scale = max(float(np.max(np.abs(t))) for t in jax.tree_util.tree_leaves(truth))
    ref_err, pipe_err = (_max_error(g, truth) / scale for g in (grads, r.grads))
    assert pipe_err <= 2 * ref_err + 2e-5, (pipe_err, ref_err)
    assert {e.kind for e in r.events} == {"F", "I", "W"}


def _float64_grads(whole, params, x, labels):
    """The gradients of ``whole`` in float64: the truth that both float32 computations approximate."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        p64 = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
        return jax.tree_util.tree_map(np.asarray, jax.grad(whole)(p64, np.asarray(x, np.float64), labels))
    finally:
        jax.config.update("jax_enable_x64", before)


def _max_error(got, want) -> float:
    return max(
        float(np.max(np.abs(np.asarray(g, np.float64) - w)))
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))
    )


def test_nested_scans_are_cut_through_both_loops():
    # Scan over layers, each layer an RNN scanned over time: W leaves both loops as one dot per weight,
    # batched over layers and contracting time and batch.
    def stage(params, x):  # x: (time, batch, features)
        def layer(h, p):
            def cell(c, xt):
                c = jnp.tanh(xt @ p["w"] + c @ p["u"])
                return c, c

            return jax.lax.scan(cell, jnp.zeros_like(h[0]), h)[1], None

        return jax.lax.scan(layer, x, params)[0]

    rng = np.random.default_rng(0)
    params = {k: (rng.normal(size=(3, D, D)) / 4).astype(np.float32) for k in ("w", "u")}
    x = rng.normal(size=(T, 2, D)).astype(np.float32)
    args = jax.tree_util.tree_leaves((params, x, np.ones_like(x)))
    closed = jax.make_jaxpr(lambda p, x, ct: jax.vjp(stage, p, x)[1](ct))(params, x, np.ones_like(x))
    cut = cut_inside(closed, needed_outs=[2])
    top = [e.outvars[0].aval.shape for e in cut.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert top == [(3, D, D), (3, D, D)]
    assert_trees_close(
        tuple(jcore.jaxpr_as_fun(cut)(*args)), tuple(jcore.jaxpr_as_fun(closed)(*args)), rtol=1e-5, atol=1e-5
    )
