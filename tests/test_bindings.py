"""Residuals are bound to the inputs they need, intermediates to their residuals, dims to reality.

Each slip here used to give wrong gradients with exit 0 (or allocate without
bound): one microbatch's residuals with another's inputs, one microbatch's
intermediates with another's residuals, a residuals file whose dims were edited.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from clihelp import opts

import vjpsplit_cli as vs
from vjpsplit_cli.cli import main


def loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)


def sq_sum(x):
    # No stored residual mentions b: only the recorded dims say how big x's gradient is.
    return jnp.sum(x) ** 2


@pytest.fixture(scope="module")
def art():
    b = jax.export.symbolic_shape("b")[0]
    return vs.export(
        loss,
        jax.ShapeDtypeStruct((4, 3), jnp.float32),
        jax.ShapeDtypeStruct((b, 4), jnp.float32),
        weights="w",
        platforms="cpu",
    )


def _mb(seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(5, 4)).astype(np.float32)


def _cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output.strip()


@pytest.mark.parametrize("fmt", ["npz", "msgpack"])
def test_run_bwd_refuses_another_microbatchs_inputs(art, tmp_path, fmt):
    art.save(tmp_path / "a.vjps")
    for i in (1, 2):
        w, x = _mb(i)
        vs.save_arrays(tmp_path / f"in{i}.{fmt}", {"w": w, "x": x})
        assert (
            _cli(
                "run-fwd",
                tmp_path / "a.vjps",
                *opts(inputs=tmp_path / f"in{i}.{fmt}", residuals=tmp_path / f"r{i}.{fmt}"),
            )[0]
            == 0
        )
    code, out = _cli(
        "run-bwd",
        tmp_path / "a.vjps",
        *opts(residuals=tmp_path / f"r1.{fmt}", inputs=tmp_path / f"in2.{fmt}", grads=tmp_path / "g.npz"),
    )
    assert code == 1 and len(out.splitlines()) == 1
    assert f"in2.{fmt}: input 'w' differs from the one the forward that wrote" in out and "same microbatch" in out
    assert not (tmp_path / "g.npz").exists()
    # The right pair runs and gives jax.grad's gradients.
    assert (
        _cli(
            "run-bwd",
            tmp_path / "a.vjps",
            *opts(residuals=tmp_path / f"r1.{fmt}", inputs=tmp_path / f"in1.{fmt}", grads=tmp_path / "g.npz"),
        )[0]
        == 0
    )
    g, _ = vs.load_arrays(tmp_path / "g.npz")
    ref = jax.grad(loss, argnums=(0, 1))(*_mb(1))
    np.testing.assert_allclose(g["w"], ref[0], rtol=1e-5, atol=1e-7)
    # --no-verify skips the check (and then computes with what it was given).
    assert (
        _cli(
            "run-bwd",
            tmp_path / "a.vjps",
            *opts(
                residuals=tmp_path / f"r1.{fmt}",
                no_verify=True,
                inputs=tmp_path / f"in2.{fmt}",
                grads=tmp_path / "g2.npz",
            ),
        )[0]
        == 0
    )


def test_load_residuals_refuses_other_inputs_in_python(art, tmp_path):
    w1, x1 = _mb(1)
    _, res = art.fwd(w1, x1)
    vs.save_residuals(tmp_path / "r.npz", res)
    w2 = w1.copy()
    w2[0, 0] += 1.0
    with pytest.raises(vs.VjpsplitError, match="input 'w' differs"):
        vs.load_residuals(tmp_path / "r.npz", inputs=(w2, x1), artifact=art)
    g = art.bwd(vs.load_residuals(tmp_path / "r.npz", inputs=(w1, x1), artifact=art))
    np.testing.assert_allclose(g[0], jax.grad(loss)(w1, x1), rtol=1e-5, atol=1e-7)


def test_split_residual_files_are_bound_too(tmp_path):
    fwd, bwd = vs.split(loss)
    w1, x1 = _mb(1)
    _, res = fwd(w1, x1)
    vs.save_residuals(tmp_path / "r.msgpack", res)
    with pytest.raises(vs.VjpsplitError, match="differs"):
        vs.load_residuals(tmp_path / "r.msgpack", inputs=_mb(2))
    g = bwd(vs.load_residuals(tmp_path / "r.msgpack", inputs=(w1, x1)))
    np.testing.assert_allclose(g[0], jax.grad(loss)(w1, x1), rtol=1e-5, atol=1e-7)


def test_weight_part_refuses_another_runs_intermediates(art, tmp_path):
    res1 = art.fwd(*_mb(1))[1]
    res2 = art.fwd(*_mb(2))[1]
    _, inter1 = art.bwd_input(res1)
    with pytest.raises(vs.VjpsplitError, match="made from other residuals"):
        art.bwd_weight(res2, inter1)
    np.testing.assert_allclose(art.bwd_weight(res1, inter1)["w"], jax.grad(loss)(*_mb(1)), rtol=1e-5, atol=1e-7)


def test_cli_weight_part_refuses_another_runs_intermediates(art, tmp_path):
    art.save(tmp_path / "a.vjps")
    for i in (1, 2):
        w, x = _mb(i)
        vs.save_arrays(tmp_path / f"in{i}.npz", {"w": w, "x": x})
        assert (
            _cli(
                "run-fwd",
                tmp_path / "a.vjps",
                *opts(inputs=tmp_path / f"in{i}.npz", residuals=tmp_path / f"r{i}.npz", self_contained=True),
            )[0]
            == 0
        )
        assert (
            _cli(
                "run-bwd",
                tmp_path / "a.vjps",
                *opts(
                    residuals=tmp_path / f"r{i}.npz",
                    part="input",
                    intermediates=tmp_path / f"c{i}.npz",
                    grads=tmp_path / f"gx{i}.npz",
                ),
            )[0]
            == 0
        )
    code, out = _cli(
        "run-bwd",
        tmp_path / "a.vjps",
        *opts(
            residuals=tmp_path / "r2.npz", part="weight", intermediates=tmp_path / "c1.npz", grads=tmp_path / "gw.npz"
        ),
    )
    assert code == 1 and "c1.npz: the intermediates were made from other residuals" in out
    assert not (tmp_path / "gw.npz").exists()
    assert (
        _cli(
            "run-bwd",
            tmp_path / "a.vjps",
            *opts(
                residuals=tmp_path / "r1.npz",
                part="weight",
                intermediates=tmp_path / "c1.npz",
                grads=tmp_path / "gw.npz",
            ),
        )[0]
        == 0
    )


def test_edited_dims_are_refused_before_anything_is_allocated(tmp_path):
    b = jax.export.symbolic_shape("b")[0]
    a = vs.export(sq_sum, jax.ShapeDtypeStruct((b, 1000), jnp.float32), platforms="cpu")
    _, res = a.fwd(np.ones((3, 1000), np.float32))
    assert res.stored == {} or all("b" not in str(v.shape) for v in res.stored.values())
    vs.save_residuals(tmp_path / "r.msgpack", res, self_contained=True)
    arrays, meta = vs.load_arrays(tmp_path / "r.msgpack")
    forged = {**meta, "dims": {"b": 2**39}}
    forged.pop("crc32", None)
    vs.save_arrays(tmp_path / "forged.msgpack", arrays, forged)
    with pytest.raises(vs.VjpsplitError, match=r"recorded dims \(b=549755813888\) .* more than this host's"):
        a.bwd(vs.load_residuals(tmp_path / "forged.msgpack"))
    vs.save_arrays(tmp_path / "forged2.msgpack", arrays, {**forged, "dims": {"b": 2**60}})
    with pytest.raises(vs.VjpsplitError, match="'dims' has the wrong type or range"):
        vs.load_residuals(tmp_path / "forged2.msgpack")


@pytest.mark.parametrize(
    "field, value",
    [
        ("fingerprint", 5),
        ("arg_names", "w"),
        ("dims", {"b": "3"}),
        ("needs_inputs", [1]),
        ("input_crc32", {"w": -1}),
        ("residuals_id", 7),
    ],
)
def test_malformed_metadata_names_the_field(art, tmp_path, field, value):
    _, res = art.fwd(*_mb(1))
    vs.save_residuals(tmp_path / "r.npz", res)
    arrays, meta = vs.load_arrays(tmp_path / "r.npz")
    vs.save_arrays(tmp_path / "bad.npz", arrays, {**meta, field: value})
    with pytest.raises(vs.VjpsplitError, match=f"malformed metadata: '{field}'"):
        vs.load_residuals(tmp_path / "bad.npz", inputs=_mb(1))


def test_forged_self_contained_flag_is_a_clear_error_naming_the_file(art, tmp_path):
    _, res = art.fwd(*_mb(1))
    vs.save_residuals(tmp_path / "r.npz", res)
    arrays, meta = vs.load_arrays(tmp_path / "r.npz")
    vs.save_arrays(tmp_path / "forged.npz", arrays, {**meta, "self_contained": True, "needs_inputs": []})
    with pytest.raises(vs.VjpsplitError, match=r"forged.npz: the residuals need input 'w'.*pass the forward's inputs"):
        art.bwd(vs.load_residuals(tmp_path / "forged.npz"))


def tanh_w(w, x):
    # The backward reads w and the stored tanh(x), never x itself.
    return jnp.sum(jnp.tanh(x) * w)


@pytest.fixture(scope="module")
def tanh_art():
    b = jax.export.symbolic_shape("b")[0]
    return vs.export(
        tanh_w, jax.ShapeDtypeStruct((3,), jnp.float32), jax.ShapeDtypeStruct((b, 3), jnp.float32), platforms="cpu"
    )


def _tanh_inputs(batch, seed=0):
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(3,)).astype(np.float32), "x": rng.normal(size=(batch, 3)).astype(np.float32)}


def test_an_input_the_backward_never_reads_is_still_bound(tanh_art):
    assert "x" not in [r.key.removeprefix("in/") for r in tanh_art.manifest.residuals if r.input_backed]


@pytest.mark.parametrize("fmt", ["npz", "msgpack"])
@pytest.mark.parametrize("other", ["batch", "content"])
def test_run_bwd_refuses_an_unread_input_of_another_microbatch(tanh_art, tmp_path, fmt, other):
    tanh_art.save(tmp_path / "a.vjps")
    vs.save_arrays(tmp_path / f"in8.{fmt}", _tanh_inputs(8))
    mine = _tanh_inputs(8)
    theirs = _tanh_inputs(4) if other == "batch" else {"w": mine["w"], "x": mine["x"] + 1}
    vs.save_arrays(tmp_path / f"other.{fmt}", theirs)
    assert (
        _cli("run-fwd", tmp_path / "a.vjps", "--inputs", tmp_path / f"in8.{fmt}", "--residuals", tmp_path / f"r.{fmt}")[
            0
        ]
        == 0
    )
    code, out = _cli(
        "run-bwd",
        tmp_path / "a.vjps",
        *opts(residuals=tmp_path / f"r.{fmt}", inputs=tmp_path / f"other.{fmt}", grads=tmp_path / "g.npz"),
    )
    assert code == 1 and len(out.splitlines()) == 1, out
    assert f"other.{fmt}: input 'x'" in out and "same microbatch" in out and "--no-verify" in out
    if other == "batch":
        assert "is f32[4,3], but the forward that wrote" in out and "ran on f32[8,3]" in out
    assert not (tmp_path / "g.npz").exists()
    # The same microbatch runs, with jax.grad's gradients (x's at batch 8).
    assert (
        _cli(
            "run-bwd",
            tmp_path / "a.vjps",
            *opts(residuals=tmp_path / f"r.{fmt}", inputs=tmp_path / f"in8.{fmt}", grads=tmp_path / "g.npz"),
        )[0]
        == 0
    )
    g, _ = vs.load_arrays(tmp_path / "g.npz")
    ref = jax.grad(tanh_w, argnums=(0, 1))(mine["w"], mine["x"])
    np.testing.assert_allclose(g["x"], ref[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g["w"], ref[0], rtol=1e-5, atol=1e-6)
    # --no-verify is the documented way out: it skips the binding too.
    assert (
        _cli(
            "run-bwd",
            tmp_path / "a.vjps",
            *opts(
                residuals=tmp_path / f"r.{fmt}",
                no_verify=True,
                inputs=tmp_path / f"other.{fmt}",
                grads=tmp_path / "g2.npz",
            ),
        )[0]
        == 0
    )


def test_self_contained_residuals_are_bound_to_inputs_given_anyway(tanh_art, tmp_path):
    tanh_art.save(tmp_path / "a.vjps")
    vs.save_arrays(tmp_path / "in8.npz", _tanh_inputs(8))
    vs.save_arrays(tmp_path / "in4.npz", _tanh_inputs(4))
    assert (
        _cli(
            "run-fwd",
            tmp_path / "a.vjps",
            *opts(inputs=tmp_path / "in8.npz", self_contained=True, residuals=tmp_path / "r.npz"),
        )[0]
        == 0
    )
    assert (
        _cli("run-bwd", tmp_path / "a.vjps", "--residuals", tmp_path / "r.npz", "--grads", tmp_path / "g.npz")[0] == 0
    )
    code, out = _cli(
        "run-bwd",
        tmp_path / "a.vjps",
        *opts(residuals=tmp_path / "r.npz", inputs=tmp_path / "in4.npz", grads=tmp_path / "g2.npz"),
    )
    assert code == 1 and "in4.npz: input 'x' is f32[4,3]" in out


def test_python_api_binds_every_input(tanh_art, tmp_path):
    mine, theirs = _tanh_inputs(8), _tanh_inputs(4)
    _, res = tanh_art.fwd(mine["w"], mine["x"])
    vs.save_residuals(tmp_path / "r.npz", res)
    with pytest.raises(vs.VjpsplitError, match=r"input 'x' is f32\[4,3\], but the forward"):
        vs.load_residuals(tmp_path / "r.npz", inputs=(mine["w"], theirs["x"]), artifact=tanh_art)
    with pytest.raises(vs.VjpsplitError, match="input 'x' differs"):
        vs.load_residuals(tmp_path / "r.npz", inputs={"w": mine["w"], "x": mine["x"] * 2}, artifact=tanh_art)
    # verify=False skips the binding, as --no-verify does.
    vs.load_residuals(tmp_path / "r.npz", inputs=(mine["w"], theirs["x"]), artifact=tanh_art, verify=False)
    g = tanh_art.bwd(vs.load_residuals(tmp_path / "r.npz", inputs=(mine["w"], mine["x"]), artifact=tanh_art))
    np.testing.assert_allclose(g[1], jax.grad(tanh_w, 1)(mine["w"], mine["x"]), rtol=1e-5, atol=1e-6)


def test_split_residual_files_bind_unread_inputs(tmp_path):
    fwd, bwd = vs.split(tanh_w)
    mine = _tanh_inputs(8)
    _, res = fwd(mine["w"], mine["x"])
    vs.save_residuals(tmp_path / "r.npz", res)
    with pytest.raises(vs.VjpsplitError, match="input '1' differs"):
        vs.load_residuals(tmp_path / "r.npz", inputs=(mine["w"], mine["x"] + 1))
    g = bwd(vs.load_residuals(tmp_path / "r.npz", inputs=(mine["w"], mine["x"])))
    np.testing.assert_allclose(g[1], jax.grad(tanh_w, 1)(mine["w"], mine["x"]), rtol=1e-5, atol=1e-6)
