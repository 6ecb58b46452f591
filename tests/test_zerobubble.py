"""Zero-bubble split backward: bwd_input + bwd_weight equal the single backward; B does no dW matmuls."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from clihelp import opts
from jax import export as jexport
from models import assert_trees_close

import vjpsplit_cli as vs
from vjpsplit_cli.cli import main

SIZES = (6, 8, 8, 3)


def stage(params, x):
    """A pipeline stage: three dense layers."""
    h = x
    for w, b in params:
        h = jnp.tanh(h @ w + b)
    return h


def stage_inputs(batch=5, seed=0):
    rng = np.random.default_rng(seed)
    params = [
        ((rng.normal(size=(a, c)) / np.sqrt(a)).astype(np.float32), rng.normal(size=c).astype(np.float32))
        for a, c in zip(SIZES[:-1], SIZES[1:])
    ]
    return params, rng.normal(size=(batch, SIZES[0])).astype(np.float32)


def specs():
    (b,) = jexport.symbolic_shape("b")
    s = jax.ShapeDtypeStruct
    return (
        [(s((a, c), jnp.float32), s((c,), jnp.float32)) for a, c in zip(SIZES[:-1], SIZES[1:])],
        s((b, SIZES[0]), jnp.float32),
    )


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    path = tmp_path_factory.mktemp("zb") / "stage.vjps"
    vs.export(stage, *specs(), weights="params").save(path)
    return vs.load(path)


@pytest.mark.parametrize("batch", [1, 7, 300])
def test_split_backward_equals_single_backward(art, batch):
    params, x = stage_inputs(batch)
    out, res = art.fwd(params, x)
    ct = np.random.default_rng(batch).normal(size=np.shape(out)).astype(np.float32)
    full_params, full_x = art.bwd(res, ct)
    grads_in, inter = art.bwd_input(res, ct)
    grads_w = art.bwd_weight(res, inter)
    assert set(grads_in) == {"x"} and set(grads_w) == {"params"}
    assert_trees_close(grads_in["x"], full_x, rtol=1e-6, atol=1e-6)
    assert_trees_close(grads_w["params"], full_params, rtol=1e-6, atol=1e-6)
    _, vjp = jax.vjp(stage, params, x)
    ref_params, ref_x = vjp(ct)
    assert_trees_close(grads_w["params"], ref_params, rtol=1e-5, atol=1e-5)
    assert_trees_close(grads_in["x"], ref_x, rtol=1e-5, atol=1e-5)


def _dots(art, module: str) -> int:
    """Matmuls in one platform's lowering of an exported module (the text holds one copy per platform)."""
    n = len(re.findall(r"stablehlo\.dot_general", art._exps[module].mlir_module()))
    assert n % len(art.manifest.platforms) == 0
    return n // len(art.manifest.platforms)


def test_input_part_does_no_weight_gradient_matmuls(art):
    full, b, w = _dots(art, "bwd"), _dots(art, "bwd_input"), _dots(art, "bwd_weight")
    n_layers = len(SIZES) - 1
    assert full == 2 * n_layers  # dW and dx per layer
    assert w == n_layers  # every dW = h^T . dy lives in the weight part...
    assert b == n_layers  # ...and the input part only propagates dx
    assert b + w == full


def test_manifest_and_inspect_describe_the_split(art, tmp_path):
    m = art.manifest
    assert m.weights == ("params",) and m.intermediates and m.splits_backward
    assert not vs.export(stage, *specs()).manifest.splits_backward  # without weights=: one backward
    assert all(leaf.key.startswith("c/") for leaf in m.intermediates)
    art.save(tmp_path / "a.vjps")
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "a.vjps")])
    assert "split backward: weights params" in r.stdout and "intermediates:" in r.stdout


@pytest.mark.parametrize("fmt", ["npz", "msgpack"])
def test_cli_parts(art, tmp_path, fmt):
    art.save(tmp_path / "a.vjps")
    params, x = stage_inputs(4)
    flat = {f"params/{i}/{j}": v for i, layer in enumerate(params) for j, v in enumerate(layer)}
    vs.save_arrays(tmp_path / f"in.{fmt}", {**flat, "x": x})
    vs.save_arrays(tmp_path / f"ct.{fmt}", {"out": np.ones((4, SIZES[-1]), np.float32)})
    run = lambda *a: CliRunner().invoke(main, [str(v) for v in a])  # noqa: E731
    a = tmp_path / "a.vjps"
    assert run("run-fwd", a, "--inputs", tmp_path / f"in.{fmt}", "--residuals", tmp_path / f"r.{fmt}").exit_code == 0
    common = ["--residuals", tmp_path / f"r.{fmt}", "--inputs", tmp_path / f"in.{fmt}"]
    r = run(
        "run-bwd",
        a,
        *common,
        *opts(
            cotangents=tmp_path / f"ct.{fmt}",
            part="input",
            intermediates=tmp_path / f"c.{fmt}",
            grads=tmp_path / f"gi.{fmt}",
        ),
    )
    assert r.exit_code == 0, r.output
    r = run(
        "run-bwd",
        a,
        *common,
        *opts(part="weight", intermediates=tmp_path / f"c.{fmt}", grads=tmp_path / f"gw.{fmt}"),
    )
    assert r.exit_code == 0, r.output
    r = run("run-bwd", a, *common, "--cotangents", tmp_path / f"ct.{fmt}", "--grads", tmp_path / f"g.{fmt}")
    assert r.exit_code == 0, r.output
    gi, _ = vs.load_arrays(tmp_path / f"gi.{fmt}")
    gw, meta = vs.load_arrays(tmp_path / f"gw.{fmt}")
    g, _ = vs.load_arrays(tmp_path / f"g.{fmt}")
    assert sorted(gi) == ["x"] and sorted(gw) == sorted(flat)
    for k in g:
        np.testing.assert_allclose({**gi, **gw}[k], g[k], rtol=1e-6, atol=1e-6)
    inter, imeta = vs.load_arrays(tmp_path / f"c.{fmt}")
    assert imeta["kind"] == "vjpsplit-intermediates" and imeta["fingerprint"] == art.manifest.fingerprint


def test_cli_part_errors(art, tmp_path):
    art.save(tmp_path / "a.vjps")
    run = lambda *a: CliRunner().invoke(main, [str(v) for v in a])  # noqa: E731
    params, x = stage_inputs(2)
    flat = {f"params/{i}/{j}": v for i, layer in enumerate(params) for j, v in enumerate(layer)}
    vs.save_arrays(tmp_path / "in.npz", {**flat, "x": x})
    assert (
        run(
            "run-fwd", tmp_path / "a.vjps", "--inputs", tmp_path / "in.npz", "--residuals", tmp_path / "r.npz"
        ).exit_code
        == 0
    )
    base = [
        "run-bwd",
        tmp_path / "a.vjps",
        *opts(residuals=tmp_path / "r.npz", inputs=tmp_path / "in.npz", grads=tmp_path / "g.npz"),
    ]
    r = run(*base, "--part", "weight")
    assert r.exit_code == 2 and "--intermediates" in r.stderr
    # intermediates that are not intermediates
    r = run(*base, "--part", "weight", "--intermediates", tmp_path / "in.npz")
    assert r.exit_code == 1 and "not an intermediates file" in r.stderr
    # an artifact without the split
    vs.export(stage, *specs(), platforms="cpu").save(tmp_path / "plain.vjps")
    assert (
        run(
            "run-fwd", tmp_path / "plain.vjps", "--inputs", tmp_path / "in.npz", "--residuals", tmp_path / "rp.npz"
        ).exit_code
        == 0
    )
    r = run(
        "run-bwd",
        tmp_path / "plain.vjps",
        *opts(
            residuals=tmp_path / "rp.npz",
            inputs=tmp_path / "in.npz",
            cotangents=tmp_path / "in.npz",
            part="input",
            intermediates=tmp_path / "c.npz",
            grads=tmp_path / "g.npz",
        ),
    )
    assert r.exit_code == 1 and "--weights" in r.stderr
    assert not (tmp_path / "g.npz").exists() and not (tmp_path / "c.npz").exists()


def test_weights_must_be_differentiated():
    with pytest.raises(vs.VjpsplitError, match="not differentiated"):
        vs.export(stage, *specs(), wrt="x", weights="params", platforms="cpu")


def test_weights_only_stage_still_walks_the_cotangent_back_in_b():
    # A pipeline's first stage: nobody needs its input gradient. B still propagates the cotangent
    # through the layers (the paper's B); W keeps only the weight-gradient matmuls.
    art = vs.export(stage, *specs(), wrt="params", weights="params", platforms="cpu")
    n_layers = len(SIZES) - 1
    full, b, w = _dots(art, "bwd"), _dots(art, "bwd_input"), _dots(art, "bwd_weight")
    assert (full, b, w) == (2 * n_layers - 1, n_layers - 1, n_layers)
    params, x = stage_inputs(7)
    out, res = art.fwd(params, x)
    ct = np.random.default_rng(3).normal(size=np.shape(out)).astype(np.float32)
    grads_in, inter = art.bwd_input(res, ct)
    assert grads_in == {}
    assert_trees_close(art.bwd_weight(res, inter)["params"], art.bwd(res, ct), rtol=1e-6, atol=1e-6)


def test_partition_reports_what_the_weight_part_reads():
    from vjpsplit_cli.tracing.zerobubble import partition

    def bwd(w, x, ct):  # dW = x^T ct needs x, not w; dx = ct w^T needs w
        return ct @ w.T, x.T @ ct

    closed = jax.make_jaxpr(bwd)(jnp.ones((3, 2)), jnp.ones((4, 3)), jnp.ones((4, 2)))
    part = partition(closed, weight_outs=[1], ct_invars=[2])
    # The weight part's inputs: w, x, then the boundary (the cotangent, passed through B).
    assert len(part.weight_part.jaxpr.invars) == 3 and part.n_boundary == 1
    assert part.weight_reads == (1, 2)


# -- residuals split by consumer: after B a stage keeps only W's share ---------------------------------
def test_weight_part_reads_a_strict_subset_of_the_residuals(art):
    m = art.manifest
    stored = [r.key for r in m.stored_residuals]
    assert m.format_version >= 3 and m.weight_reads_subset
    assert set(m.weight_residuals) < set(stored), "W should not need every residual (e.g. tanh derivatives)"
    assert set(m.weight_inputs) <= set(m.input_backed_keys)
    # dW of layer k reads that layer's input: the stage input x, then the activations.
    assert "x" in m.weight_inputs
    assert not any(k.startswith("params/") for k in m.weight_inputs), "W needs no weights to make weight gradients"


def test_bwd_weight_needs_only_the_intermediates(art):
    params, x = stage_inputs(9)
    out, res = art.fwd(params, x)
    ct = np.ones(np.shape(out), np.float32)
    want = art.bwd(res, ct)[0]
    _, inter = art.bwd_input(res, ct)
    assert set(inter.stored) == set(art.manifest.weight_residuals)
    assert sum(np.asarray(v).nbytes for v in inter.stored.values()) < res.stored_nbytes
    del res  # what a pipeline stage does after B
    got = art.bwd_weight(inter)["params"]
    assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
    assert type(got) is type(params) and type(got[0]) is type(params[0])  # the caller's own structure


def test_cli_weight_part_runs_from_the_intermediates_file_alone(art, tmp_path):
    params, x = stage_inputs(4)
    art.save(tmp_path / "a.vjps")
    inputs = vs.file_arrays(params=params, x=x)
    vs.save_arrays(tmp_path / "in.npz", inputs)
    vs.save_arrays(tmp_path / "ct.npz", {"out": np.ones((4, SIZES[-1]), np.float32)})
    run = CliRunner().invoke
    assert (
        run(
            main,
            [
                "run-fwd",
                str(tmp_path / "a.vjps"),
                *opts(inputs=tmp_path / "in.npz", residuals=tmp_path / "r.npz"),
            ],
        ).exit_code
        == 0
    )
    r = run(
        main,
        [
            "run-bwd",
            str(tmp_path / "a.vjps"),
            *opts(
                residuals=tmp_path / "r.npz",
                inputs=tmp_path / "in.npz",
                cotangents=tmp_path / "ct.npz",
                part="input",
                intermediates=tmp_path / "c.npz",
                grads=tmp_path / "gx.npz",
            ),
        ],
    )
    assert r.exit_code == 0, r.output
    with np.load(tmp_path / "c.npz") as f:
        keys = set(f.files)
    m = art.manifest
    assert keys == {leaf.key for leaf in m.intermediates} | set(m.weight_residuals)  # no other residual, no input
    # W: no --residuals; the inputs file supplies x, bound by its CRC-32.
    r = run(
        main,
        [
            "run-bwd",
            str(tmp_path / "a.vjps"),
            *opts(
                part="weight",
                intermediates=tmp_path / "c.npz",
                inputs=tmp_path / "in.npz",
                grads=tmp_path / "gw.npz",
            ),
        ],
    )
    assert r.exit_code == 0, r.output
    gw, _ = vs.load_arrays(tmp_path / "gw.npz")
    ref = jax.grad(lambda p: jnp.sum(stage(p, x)))(params)
    for k, v in vs.file_arrays(params=ref).items():
        np.testing.assert_allclose(gw[k], v, rtol=1e-5, atol=1e-6)
    # Another microbatch's inputs are refused by the intermediates' binding.
    vs.save_arrays(tmp_path / "in2.npz", vs.file_arrays(params=params, x=x + 1))
    r = run(
        main,
        [
            "run-bwd",
            str(tmp_path / "a.vjps"),
            *opts(
                part="weight",
                intermediates=tmp_path / "c.npz",
                inputs=tmp_path / "in2.npz",
                grads=tmp_path / "gw2.npz",
            ),
        ],
    )
    assert r.exit_code == 1 and "input 'x' differs" in r.output
    # Without --inputs the file says what it lacks.
    r = run(
        main,
        [
            "run-bwd",
            str(tmp_path / "a.vjps"),
            *opts(part="weight", intermediates=tmp_path / "c.npz", grads=tmp_path / "gw3.npz"),
        ],
    )
    assert r.exit_code == 1 and "leave out the inputs x" in r.output
