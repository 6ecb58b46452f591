"""A newcomer's first hour: template files, global options anywhere, errors that point at the fix."""

from __future__ import annotations

import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from clihelp import opts

import vjpsplit_cli as vs
from vjpsplit_cli.cli import main

MODEL = textwrap.dedent(
    """
    import jax, jax.numpy as jnp

    def loss(params, x, labels):
        h = jnp.tanh(x @ params["w"] + params["b"])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(h), labels[:, None], 1))

    def shapes():
        s = jax.ShapeDtypeStruct
        return {"w": s((6, 3), jnp.float32), "b": s((3,), jnp.float32)}

    def noisy(w, x, key):
        return jnp.sum((x @ w) * jax.random.normal(key, (x.shape[0], 2), jnp.bfloat16).astype(jnp.float32))

    def key_spec():
        return jax.ShapeDtypeStruct((), jax.random.key(0).dtype)

    def vector(x):
        return {"y": jnp.sin(x), "n": jnp.argmax(x)}
    """
)


def ref_loss(params, x, labels):
    h = jnp.tanh(x @ params["w"] + params["b"])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(h), labels[:, None], 1))


def cli(*args, env=None):
    r = CliRunner().invoke(main, [str(a) for a in args], env=env)
    return r.exit_code, r.output.strip()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("newcomer")
    (d / "model.py").write_text(MODEL)
    code, out = cli(
        "export",
        d / "model.py:loss",
        "--shapes",
        f"params=@{d / 'model.py'}:shapes",
        "--shapes",
        "x=f32[b,6]",
        "--shapes",
        "labels=i32[b]",
        "--platforms",
        "cpu",
        "-o",
        d / "m.vjps",
    )
    assert code == 0, out
    return d


@pytest.mark.parametrize("fmt", ["npz", "msgpack"])
@pytest.mark.parametrize("fill", ["zeros", "ones", "normal"])
def test_template_inputs_run_as_written_and_give_jax_grad(work, tmp_path, fmt, fill):
    inputs = tmp_path / f"in.{fmt}"
    code, out = cli("template", work / "m.vjps", "-o", inputs, "--at", "b=4", "--fill", fill)
    assert code == 0, out
    assert out == f"wrote {inputs}: 4 arrays for the inputs of {work / 'm.vjps'} at b=4, filled with {fill}"
    arrays, _ = vs.load_arrays(inputs)
    m = vs.load(work / "m.vjps").manifest
    assert {k: (a.dtype.name, a.shape) for k, a in arrays.items()} == {
        leaf.key: (leaf.dtype, tuple(4 if d == "b" else d for d in leaf.shape)) for leaf in m.inputs
    }
    if fill == "zeros":
        assert all(not a.any() for a in arrays.values())
    if fill == "ones":
        assert all((a == 1).all() for a in arrays.values())
    if fill == "normal":
        assert arrays["x"].std() > 0.1 and ((arrays["labels"] >= 0) & (arrays["labels"] < 8)).all()
    assert cli("run-fwd", work / "m.vjps", "--inputs", inputs, "--residuals", tmp_path / f"r.{fmt}")[0] == 0
    ct = tmp_path / f"ct.{fmt}"
    assert cli("template", work / "m.vjps", "-o", ct, "--what", "cotangents", "--fill", "ones")[0] == 0
    assert list(vs.load_arrays(ct)[0]) == ["out"]
    code, out = cli(
        "run-bwd",
        work / "m.vjps",
        *opts(residuals=tmp_path / f"r.{fmt}", inputs=inputs, cotangents=ct, grads=tmp_path / "g.npz"),
    )
    assert code == 0, out
    g, _ = vs.load_arrays(tmp_path / "g.npz")
    params = {"w": arrays["params/w"], "b": arrays["params/b"]}
    ref = jax.grad(ref_loss, argnums=(0, 1))(params, arrays["x"], arrays["labels"])
    np.testing.assert_allclose(g["params/w"], ref[0]["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g["x"], ref[1], rtol=1e-5, atol=1e-6)


def test_template_gives_typed_keys_as_key_data_and_bf16(work, tmp_path):
    spec = f"@{work / 'model.py'}:key_spec"
    assert (
        cli(
            "export",
            work / "model.py:noisy",
            "--shapes",
            "w=bf16[6,2]",
            "--shapes",
            "x=f32[n,6]",
            "--shapes",
            f"key={spec}",
            "--platforms",
            "cpu",
            "-o",
            tmp_path / "k.vjps",
        )[0]
        == 0
    )
    art = vs.load(tmp_path / "k.vjps")
    arrays = vs.template(art, at={"n": 3}, fill="normal", seed=1)
    assert arrays["key"].dtype == np.uint32 and arrays["key"].shape == jax.random.key_data(jax.random.key(0)).shape
    assert arrays["w"].dtype == jnp.bfloat16 and arrays["x"].shape == (3, 6)
    assert np.array_equal(arrays["key"], vs.template(art, at=["n=3"], fill="normal", seed=1)["key"])
    vs.save_arrays(tmp_path / "in.npz", arrays)
    assert (
        cli(
            "run-fwd",
            tmp_path / "k.vjps",
            *opts(inputs=tmp_path / "in.npz", residuals=tmp_path / "r.npz", outputs=tmp_path / "o.npz"),
        )[0]
        == 0
    )
    o, _ = vs.load_arrays(tmp_path / "o.npz")
    key = jax.random.wrap_key_data(arrays["key"])
    noise = jax.random.normal(key, (3, 2), jnp.bfloat16).astype(jnp.float32)
    ref = jnp.sum((arrays["x"] @ arrays["w"].astype(np.float32)) * noise)
    np.testing.assert_allclose(o["out"], ref, rtol=2e-2)


def test_template_cotangents_cover_integer_outputs(work, tmp_path):
    assert (
        cli(
            "export", work / "model.py:vector", "--shapes", "x=f32[4]", "--platforms", "cpu", "-o", tmp_path / "v.vjps"
        )[0]
        == 0
    )
    cts = vs.template(tmp_path / "v.vjps", what="cotangents", fill="ones")
    assert sorted(cts) == ["out/n", "out/y"] and cts["out/y"].dtype == np.float32
    vs.save_arrays(tmp_path / "in.npz", {"x": np.arange(4, dtype=np.float32)})
    vs.save_arrays(tmp_path / "ct.npz", cts)
    assert (
        cli("run-fwd", tmp_path / "v.vjps", "--inputs", tmp_path / "in.npz", "--residuals", tmp_path / "r.npz")[0] == 0
    )
    assert (
        cli(
            "run-bwd",
            tmp_path / "v.vjps",
            *opts(
                residuals=tmp_path / "r.npz",
                inputs=tmp_path / "in.npz",
                cotangents=tmp_path / "ct.npz",
                grads=tmp_path / "g.npz",
            ),
        )[0]
        == 0
    )
    np.testing.assert_allclose(vs.load_arrays(tmp_path / "g.npz")[0]["x"], np.cos(np.arange(4)), rtol=1e-6)


@pytest.mark.parametrize(
    "args, says",
    [
        ((), "the inputs have symbolic dims b; give their sizes with --at b=4"),
        (("--at", "c=3"), "--at c: no such symbolic dim in"),
        (("--at", "b=3,c=3"), "--at c: no such symbolic dim in"),
        (("--what", "grads"), "'grads' is not one of 'inputs', 'cotangents'"),
    ],
)
def test_template_usage_errors_name_the_problem(work, tmp_path, args, says):
    code, out = cli("template", work / "m.vjps", "-o", tmp_path / "in.npz", *args)
    assert code == 2 and says in out and len(out.splitlines()) == 1, out
    assert not (tmp_path / "in.npz").exists()


def test_template_refuses_to_overwrite_its_artifact(work, tmp_path):
    code, out = cli("template", work / "m.vjps", "-o", work / "m.vjps", "--at", "b=2")
    assert code == 2 and vs.load(work / "m.vjps")


def test_global_options_go_before_or_after_the_command(work, tmp_path):
    vs.save_template(tmp_path / "in.npz", work / "m.vjps", at={"b": 2})
    cache = tmp_path / "cache"
    env = {"VJPSPLIT_CACHE_DIR": str(cache)}
    run = ["run-fwd", work / "m.vjps", "--inputs", tmp_path / "in.npz", "--residuals", tmp_path / "r.npz"]
    assert cli(*run, "--no-cache", env=env)[0] == 0
    assert cli("--no-cache", *run, env=env)[0] == 0
    assert not cache.exists()
    assert cli(*run, env=env)[0] == 0
    assert (cache / "executables").is_dir()
    # --debug after the command shows the traceback, as before it.
    bad = ["run-bwd", work / "m.vjps", "--residuals", tmp_path / "in.npz", "--grads", tmp_path / "g.npz"]
    for args in ([*bad, "--debug"], ["--debug", *bad]):
        code, out = cli(*args)
        assert code == 1 and "Traceback" in out and out.splitlines()[-1].startswith("error: ")
    code, out = cli(*bad)
    assert code == 1 and "Traceback" not in out


def test_a_shapes_mistake_names_the_entry_not_jax(work):
    code, out = cli(
        "export",
        work / "model.py:loss",
        "--shapes",
        f"params=@{work / 'model.py'}:shapes",
        "--shapes",
        "x=f32[b,7]",
        "--shapes",
        "labels=i32[b]",
        "-o",
        work / "bad.vjps",
    )
    assert code == 1 and len(out.splitlines()) == 1, out
    assert "x=f32[b,7]" in out and "labels=" not in out and "fix those --shapes entries" in out
    assert "Error" not in out and "(7,)" not in out and "[7]" in out
    code, out = cli(
        "plan",
        work / "model.py:loss",
        "--shapes",
        f"params=@{work / 'model.py'}:shapes",
        "--shapes",
        "x=f32[b,6]",
        "--shapes",
        "labels=i32[c]",
    )
    assert code == 1 and "x=f32[b,6] and labels=i32[c] do not fit" in out and "(c, 1)" not in out, out
    assert not (work / "bad.vjps").exists()


@pytest.mark.parametrize("command", ["plan", "export", "inspect"])
def test_unknown_at_names_are_usage_errors(work, command):
    shapes = ["--shapes", f"params=@{work / 'model.py'}:shapes", "--shapes", "x=f32[b,6]", "--shapes", "labels=i32[b]"]
    args = {
        "plan": ["plan", work / "model.py:loss", *shapes],
        "export": ["export", work / "model.py:loss", *shapes, "-o", work / "x.vjps"],
        "inspect": ["inspect", work / "m.vjps"],
    }[command]
    code, out = cli(*args, "--at", "batch=256")
    assert code == 2 and "--at batch: no such symbolic dim" in out and "symbolic dims are b" in out, out
    assert "{" not in out and "at=" not in out


def test_plan_and_inspect_count_stored_residuals_alike(work):
    code, out = cli(
        "plan",
        work / "model.py:loss",
        "--shapes",
        f"params=@{work / 'model.py'}:shapes",
        "--shapes",
        "x=f32[b,6]",
        "--shapes",
        "labels=i32[b]",
        "--at",
        "b=256",
        "--policies",
        "everything",
        "--json",
    )
    assert code == 0, out
    plan = json.loads(out)[0]
    code, out = cli("inspect", work / "m.vjps", "--json", "--at", "b=256")
    info = json.loads(out)
    assert plan["stored_arrays"] == sum(not r["input_backed"] for r in info["residuals"])
    assert plan["stored_bytes"] == info["stored_residual_bytes_at"]


def test_messages_use_right_plurals_and_say_what_was_left_out(work, tmp_path):
    vs.save_template(tmp_path / "in.npz", work / "m.vjps", at={"b": 2})
    code, out = cli(
        "run-fwd",
        work / "m.vjps",
        *opts(inputs=tmp_path / "in.npz", residuals=tmp_path / "r.npz", outputs=tmp_path / "o.npz"),
    )
    assert code == 0 and out.endswith("o.npz: 1 output") and "1 outputs" not in out
    assert "input-backed residuals left out, run-bwd reads them from --inputs" in out, out
    code, out = cli("inspect", work / "m.vjps")
    assert "(wrt: params, x; no gradient for labels: integer or bool)" in out


def test_every_help_ends_with_examples_and_says_file():
    for name in main.commands:
        code, out = cli(name, "--help")
        assert code == 0 and "Examples:" in out and f"vjpsplit {name}" in out.split("Examples:")[1], name
        assert " PATH" not in out, name
    code, out = cli("--help")
    assert "..." not in out.split("Commands:")[1].split("\n\n")[0]


def test_policy_auto_says_it_is_timing_before_it_waits(work, tmp_path):
    code, out = cli(
        "export",
        work / "model.py:loss",
        "--shapes",
        f"params=@{work / 'model.py'}:shapes",
        "--shapes",
        "x=f32[b,6]",
        "--shapes",
        "labels=i32[b]",
        "--policy",
        "auto",
        "--at",
        "b=8",
        "--platforms",
        "cpu",
        "-o",
        tmp_path / "a.vjps",
    )
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == "policy auto: compiling and timing fwd+bwd of each policy at b=8 (about a second each)..."
    assert lines[1].startswith("auto chose ")


def test_python_export_errors_from_tracing_carry_no_exception_type():
    with pytest.raises(vs.VjpsplitError) as e:
        vs.export(
            lambda w, x: jnp.sum(x @ w),
            jax.ShapeDtypeStruct((4, 3), jnp.float32),
            jax.ShapeDtypeStruct((2, 5), jnp.float32),
            platforms="cpu",
        )
    message = str(e.value)
    assert message.startswith("cannot export the forward: ") and "[5]" in message and "[4]" in message, message
    assert "Error" not in message and "(5,)" not in message and len(message.splitlines()) == 1
