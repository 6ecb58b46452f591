"""Symbolic dims given only inside expressions (issue 50): solved from the arrays' sizes wherever vjpsplit reads dims.

``f32[b0, 2*b1]``, ``f32[b + 4]``: jax.export solves such dims from the shapes it is
called with, and so does vjpsplit, for the artifact's calls, residual and
intermediates files, ``template --at``, ``inspect --at`` and the CLI. Sizes that fit
no whole, positive dim, and shapes that leave a dim open, are one line naming the
dim and the equations. Dims are parsed by ``files.dimtext``, never evaluated by Python.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from clihelp import opts
from jax import export as jexport

import vjpsplit_cli as vs
from vjpsplit_cli.cli import main
from vjpsplit_cli.files import dims, dimtext
from vjpsplit_cli.files.shapes import eval_dim

# Dims as jax.export prints them, built with its public arithmetic, and their values in Python's.
EXPRESSIONS = [
    lambda b, c: 2 * c - b,
    lambda b, c: b - 2 * c,
    lambda b, c: 3 - b,
    lambda b, c: b * c * c,
    lambda b, c: b // 2,
    lambda b, c: b % 3,
    lambda b, c: (b - 3) // 2,
    lambda b, c: -(b // 2),
    lambda b, c: 2 * (b // 3) * c,
    lambda b, c: (b * c) // 2,
    lambda b, c: b // c,
    lambda b, c: b * b * b,
    lambda b, c: (b + 1) * (c + 1),
    lambda b, c: (2 - b) // 3,
    lambda b, c: 2 * b + 4,
]


@pytest.mark.parametrize("i", range(len(EXPRESSIONS)))
def test_evaluate_agrees_with_jax_on_the_dims_it_prints(i):
    b, c = jexport.symbolic_shape("b, c")
    text = str(EXPRESSIONS[i](b, c))
    for bv, cv in [(1, 1), (2, 7), (5, 3), (10, 4)]:
        assert dimtext.evaluate(text, {"b": bv, "c": cv}) == EXPRESSIONS[i](bv, cv), text
    assert dimtext.evaluate(text, {"c": 1}) is None or "b" not in text  # an unsized name: no value


def test_max_min_and_non_negative_as_jax_prints_them():
    assert dimtext.evaluate("max(b - 3, 0)", {"b": 2}) == 0
    assert dimtext.evaluate("max(b, c)", {"b": 2, "c": 5}) == 5
    assert dimtext.evaluate("min(b, 4)", {"b": 7}) == 4
    assert dimtext.evaluate("non_negative(b - 3)", {"b": 5}) == 2
    assert dimtext.evaluate("b^2 + 1", {"b": 3}) == eval_dim("b^2 + 1", {"b": 3}) == 10


@pytest.mark.parametrize(
    "text",
    ["(" * 40 + "b" + ")" * 40, "b^999", "b @ c", "floordiv(b)", "__import__('os')", "b" + " + b" * 200],
)
def test_text_it_does_not_read_is_left_unevaluated(text):
    assert dimtext.parse(text) is None and eval_dim(text, {"b": 2, "c": 3}) is None


def test_the_solver_gives_each_dim_from_one_linear_equation_at_a_time():
    eq = dims.Equation
    assert dims.solve([eq("x dim 0", "b0", 3), eq("x dim 1", "2*b1", 8)]) == {"b0": 3, "b1": 4}
    # b2 from 4*b2, then b1 from b1 + 2*b2; b1*b1 + 16 is only checked (by the caller)
    got = dims.solve([eq("x dim 0", "b1 + 2*b2", 16), eq("x dim 1", "4*b2", 24), eq("x dim 2", "b1*b1 + 16", 32)])
    assert got == {"b1": 4, "b2": 6}
    with pytest.raises(vs.VjpsplitError, match="'c' cannot be worked out"):  # jax.export solves no b*c for c either
        dims.solve([eq("x dim 0", "b", 3), eq("x dim 1", "b*c", 12)])
    assert dims.solve([eq("x dim 0", "- b + 10", 7)]) == {"b": 3}


@pytest.mark.parametrize(
    "dim, size, message",
    [
        ("2*b + 4", 9, "x dim 0 is 9, but the shape gives it as 2*b + 4: no whole number 'b' solves 2*b + 4 = 9"),
        ("b + 4", 4, "so symbolic dim 'b' would be 0; symbolic dims are >= 1"),
        (
            "b*c",
            12,
            "symbolic dims 'b', 'c' cannot be worked out from the shapes, as b*c = 12 (x dim 0) leaves them open",
        ),
        ("b + c", 12, "as b + c = 12 (x dim 0) leaves them open"),
    ],
)
def test_sizes_no_dim_fits_and_shapes_that_leave_a_dim_open_are_one_line(dim, size, message):
    with pytest.raises(vs.VjpsplitError, match=re.escape(message)):
        dims.solve([dims.Equation("x dim 0", dim, size)])


def test_the_dims_an_artifact_lists_keep_their_order_plain_ones_first():
    assert dims.solvable([("x", ("b + c", "c")), ("y", ("b",))]) == ("c", "b")  # as before: c, then b
    assert dims.solvable([("x", ("2*k", 3)), ("y", ("b", "2*k"))]) == ("b", "k")


def _spec(text):
    return jax.ShapeDtypeStruct(jexport.symbolic_shape(text), np.float32)


def test_export_refuses_dims_no_input_shape_gives_before_tracing():
    traced = []

    def f(x):
        traced.append(1)
        return jnp.sum(x)

    with pytest.raises(
        vs.VjpsplitError, match=r"symbolic dims 'b', 'c' cannot be worked out .* b\*c \(input 'x' dim 0\)"
    ):
        vs.export(f, _spec("b*c"), platforms="cpu")
    # As jax.export solves: b*c gives c only as an integer times c, not once b is known.
    with pytest.raises(vs.VjpsplitError, match=r"symbolic dim 'c' cannot be worked out .* b\*c \(input 'x' dim 0\)"):
        vs.export(f, _spec("b*c, b"), platforms="cpu")
    assert not traced
    art = vs.export(f, _spec("b, 2*c + b"), platforms="cpu")  # c from 2*c + b, once b is known
    assert art.manifest.dim_vars == ("b", "c") and traced


def draws(x):
    """A jax.random draw shaped like ``x``: its dims given as b0, 2*b1."""
    return jnp.sum(jax.random.normal(jax.random.key(1), x.shape) * jnp.sin(x))


@pytest.fixture(scope="module")
def even():
    return vs.export(draws, _spec("b0, 2*b1"), platforms="cpu")


def _x(shape):
    return np.random.default_rng(sum(shape)).normal(size=shape).astype(np.float32)


def test_calls_solve_the_dims_and_refuse_sizes_that_fit_none_naming_the_input(even):
    art = vs.loads(even.to_bytes(), cache_dir=None)
    for shape in [(2, 6), (3, 4)]:
        out, res = art.fwd(_x(shape))
        assert res.dims == {"b0": shape[0], "b1": shape[1] // 2}
        value, grad = jax.value_and_grad(draws)(_x(shape))
        np.testing.assert_allclose(out, value, rtol=1e-5)
        np.testing.assert_allclose(art.bwd(res)[0], grad, rtol=1e-5)
    with pytest.raises(vs.VjpsplitError, match=r"^args: input 'x' dim 1 is 5, but the shape gives it as 2\*b1") as e:
        art.fwd(_x((2, 5)))
    assert "\n" not in str(e.value)


def test_residual_files_and_their_dims_round_trip(even, tmp_path):
    art = vs.loads(even.to_bytes(), cache_dir=None)
    x = _x((3, 8))
    _, res = art.fwd(x)
    vs.save_residuals(tmp_path / "r.npz", res)
    loaded = vs.load_residuals(tmp_path / "r.npz", inputs=(x,))
    assert loaded.dims == {"b0": 3, "b1": 4}
    np.testing.assert_allclose(art.bwd(loaded)[0], jax.grad(draws)(x), rtol=1e-5)
    with pytest.raises(vs.VjpsplitError, match="input 'x'"):  # another microbatch's inputs
        art.bwd(vs.load_residuals(tmp_path / "r.npz", inputs=(_x((3, 6)),)))


def weighted(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def test_a_split_backward_binds_intermediates_at_solved_dims(tmp_path):
    scope = jexport.SymbolicScope()
    w_spec, x_spec = (
        jax.ShapeDtypeStruct(jexport.symbolic_shape(t, scope=scope), np.float32) for t in ("2*k, 3", "b, 2*k")
    )
    art = vs.export(weighted, w_spec, x_spec, platforms="cpu", weights="w")
    assert art.manifest.dim_vars == ("b", "k")  # plain dims first, as artifacts always listed them
    art = vs.loads(art.to_bytes(), cache_dir=None)
    for k, b in [(1, 3), (3, 2)]:
        w, x = _x((2 * k, 3)), _x((b, 2 * k))
        _, res = art.fwd(w, x)
        grads, inter = art.bwd_input(res)
        vs.save_intermediates(tmp_path / "i.npz", inter, self_contained=True)
        w_grads = art.bwd_weight(vs.load_intermediates(tmp_path / "i.npz"))
        gw, gx = jax.grad(weighted, argnums=(0, 1))(w, x)
        np.testing.assert_allclose(grads["x"], gx, rtol=1e-5)
        np.testing.assert_allclose(w_grads["w"], gw, rtol=1e-5)


def test_the_cli_templates_runs_and_inspects_at_solved_dims(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.py").write_text(
        "import jax, numpy as np\nfrom jax import export\nimport sys\nsys.path.insert(0, %r)\n"
        "from test_dim_expressions import draws\n"
        "X = jax.ShapeDtypeStruct(export.symbolic_shape('b0, 2*b1'), np.float32)\n"
        % str(__import__("pathlib").Path(__file__).parent)
    )
    cli = CliRunner()
    r = cli.invoke(main, ["export", "m.py:draws", *opts(shapes="x=@m:X", platforms="cpu"), "-o", "a.vjps"])
    assert r.exit_code == 0, r.stderr
    r = cli.invoke(main, ["template", "a.vjps", "-o", "in.npz", "--at", "b0=2", "--fill", "normal"])
    assert r.exit_code == 2 and "give their sizes with --at b1=4" in r.stderr, r.stderr  # the name, not 2*b1
    r = cli.invoke(main, ["template", "a.vjps", "-o", "in.npz", "--at", "b0=2,b1=3", "--fill", "normal"])
    assert r.exit_code == 0, r.stderr
    x = vs.load_arrays("in.npz")[0]["x"]
    assert x.shape == (2, 6)
    r = cli.invoke(main, ["run-fwd", "a.vjps", *opts(inputs="in.npz", residuals="r.npz", outputs="o.npz")])
    assert r.exit_code == 0, r.stderr
    r = cli.invoke(main, ["run-bwd", "a.vjps", *opts(inputs="in.npz", residuals="r.npz", grads="g.npz")])
    assert r.exit_code == 0, r.stderr
    value, grad = jax.value_and_grad(draws)(x)
    np.testing.assert_allclose(vs.load_arrays("o.npz")[0]["out"], value, rtol=1e-5)
    np.testing.assert_allclose(vs.load_arrays("g.npz")[0]["x"], grad, rtol=1e-5)
    r = cli.invoke(main, ["inspect", "a.vjps", "--json", "--at", "b0=2,b1=3"])
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["dim_vars"] == ["b0", "b1"] and report["inputs"][0]["shape"] == ["b0", "2*b1"]
    table = cli.invoke(main, ["inspect", "a.vjps", "--at", "b0=2,b1=3"]).stdout
    assert "= 96 B at b0=2, b1=3" in table, table  # two stored f32[2, 6], sized through 2*b1
    vs.save_arrays("odd.npz", {"x": np.zeros((2, 5), np.float32)})
    r = cli.invoke(main, ["run-fwd", "a.vjps", *opts(inputs="odd.npz", residuals="r2.npz")])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and "no whole number 'b1' solves 2*b1 = 5" in lines[0], r.stderr
    assert not (tmp_path / "r2.npz").exists()


def stage(params, x):
    return jnp.tanh(x @ params)


def test_auto_schedules_size_a_stage_s_microbatch_through_solved_dims():
    from vjpsplit_cli.pipeline.training.autoplan import microbatch_bytes

    scope = jexport.SymbolicScope()
    p = jax.ShapeDtypeStruct((3, 4), np.float32)
    solved = vs.export(stage, p, jax.ShapeDtypeStruct(jexport.symbolic_shape("2*b, 3", scope=scope), np.float32))
    plain = vs.export(stage, p, jax.ShapeDtypeStruct(jexport.symbolic_shape("c, 3"), np.float32))
    x = np.zeros((6, 3), np.float32)
    (held,) = microbatch_bytes([solved], (x, []))
    assert [held] == microbatch_bytes([plain], (x, [])) and held >= 6 * 4 * 4  # tanh's f32[6, 4] at least
