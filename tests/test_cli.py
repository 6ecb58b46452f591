"""The command line, end to end: subprocesses from a foreign directory, and every bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

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
        h = jnp.tanh(x @ params["layers"][0]["w"] + params["layers"][0]["b"])
        logits = h @ params["layers"][1]["w"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

    def shapes():
        s = jax.ShapeDtypeStruct
        return {"layers": [{"w": s((6, 8), jnp.float32), "b": s((8,), jnp.float32)},
                           {"w": s((8, 3), jnp.float32)}]}

    def with_aux(x, w):
        y = x @ w
        return jnp.sum(y ** 2), {"mean": jnp.mean(y), "argmax": jnp.argmax(y, -1)}

    def vector(x):
        return {"a": jnp.sin(x), "n": jnp.argmax(x)}

    def printing(x):
        jax.debug.print("x {}", x)
        return jnp.sum(x)

    def broken(x):
        raise RuntimeError("model bug")
    """
)


def ref_loss(params, x, labels):
    h = jnp.tanh(x @ params["layers"][0]["w"] + params["layers"][0]["b"])
    logits = h @ params["layers"][1]["w"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))


def make_inputs(batch=5, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    return {
        "params/layers/0/w": f(6, 8),
        "params/layers/0/b": f(8),
        "params/layers/1/w": f(8, 3),
        "x": f(batch, 6),
        "labels": rng.integers(0, 3, batch).astype(np.int32),
    }


def as_tree(flat):
    params = {
        "layers": [{"w": flat["params/layers/0/w"], "b": flat["params/layers/0/b"]}, {"w": flat["params/layers/1/w"]}]
    }
    return params, flat["x"], flat["labels"]


def cli(*args, cwd=None):
    """Run the real console script in a subprocess."""
    exe = Path(sys.executable).parent / "vjpsplit"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "vjpsplit_cli.cli"]
    return subprocess.run(cmd + [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A workspace: the user's module in src/, an exported artifact, inputs, and a run dir without the module."""
    root = tmp_path_factory.mktemp("cli")
    src = root / "src"
    src.mkdir()
    (src / "model.py").write_text(MODEL)
    r = cli(
        "export",
        "model:loss",
        "--shapes",
        "params=@model:shapes",
        "--shapes",
        "x=f32[b,6]",
        "--shapes",
        "labels=i32[b]",
        "-o",
        root / "loss.vjps",
        cwd=src,
    )
    assert r.returncode == 0, r.stderr
    run = root / "run"
    run.mkdir()
    vs.save_arrays(run / "inputs.npz", make_inputs())
    vs.save_arrays(run / "inputs7.msgpack", make_inputs(batch=7, seed=1))
    return root, src, run


def test_end_to_end_in_subprocesses_without_user_code(ws):
    root, _, run = ws
    assert not (run / "model.py").exists()
    for inputs, res, ext in (("inputs.npz", "res.npz", "npz"), ("inputs7.msgpack", "res.msgpack", "msgpack")):
        r = cli(
            "run-fwd", root / "loss.vjps", "--inputs", inputs, "--residuals", res, "--outputs", f"out.{ext}", cwd=run
        )
        assert r.returncode == 0, r.stderr
        r = cli(
            "run-bwd", root / "loss.vjps", "--residuals", res, "--inputs", inputs, "--grads", f"grads.{ext}", cwd=run
        )
        assert r.returncode == 0, r.stderr
        flat, _ = vs.load_arrays(run / inputs)
        grads, _ = vs.load_arrays(run / f"grads.{ext}")
        outs, _ = vs.load_arrays(run / f"out.{ext}")
        value, (gp, gx) = jax.value_and_grad(ref_loss, argnums=(0, 1))(*as_tree(flat))
        np.testing.assert_allclose(outs["out"], value, rtol=1e-5)
        assert sorted(grads) == ["params/layers/0/b", "params/layers/0/w", "params/layers/1/w", "x"]
        np.testing.assert_allclose(grads["params/layers/0/w"], gp["layers"][0]["w"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(grads["params/layers/1/w"], gp["layers"][1]["w"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(grads["x"], gx, rtol=1e-5, atol=1e-6)


def test_self_contained_residuals_need_no_inputs(ws, tmp_path):
    root, _, run = ws
    r = cli(
        "run-fwd",
        root / "loss.vjps",
        *opts(inputs=run / "inputs.npz", residuals=tmp_path / "r.msgpack", self_contained=True),
    )
    assert r.returncode == 0, r.stderr
    r = cli("run-bwd", root / "loss.vjps", "--residuals", tmp_path / "r.msgpack", "--grads", tmp_path / "g.npz")
    assert r.returncode == 0, r.stderr
    g, _ = vs.load_arrays(tmp_path / "g.npz")
    _, gx = jax.grad(ref_loss, argnums=(0, 1))(*as_tree(make_inputs()))
    np.testing.assert_allclose(g["x"], gx, rtol=1e-5, atol=1e-6)


def test_inspect_json_and_table(ws):
    root, _, _ = ws
    r = cli("inspect", root / "loss.vjps", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for key in ("inputs", "outputs", "residuals", "grads", "platforms", "policy", "fingerprint", "versions"):
        assert key in d
    assert {"key": "x", "dtype": "float32", "shape": ["b", 6]} in d["inputs"]
    assert d["nr_devices"] == 1 and d["mesh"] is None  # sharded artifacts: tests/sharded
    assert d["outputs"] == [{"key": "out", "dtype": "float32", "shape": []}]
    assert all(set(e) == {"key", "dtype", "shape", "input_backed"} for e in d["residuals"])
    assert any(e["input_backed"] for e in d["residuals"]) and not all(e["input_backed"] for e in d["residuals"])
    assert "labels" not in [g["key"] for g in d["grads"]]  # integer input: no gradient entry
    assert d["platforms"] == ["cpu", "cuda", "tpu"] and d["policy"] == "everything"
    r = cli("inspect", root / "loss.vjps")
    assert r.returncode == 0
    for word in ("residuals:", "input-backed (not stored)", "stored total:", "params/layers/0/w", "f32[b,6]", "jax "):
        assert word in r.stdout


def run_cli(*args, cwd=None):
    """In-process CliRunner: fast, and stderr is kept apart from stdout."""
    old = os.getcwd()
    try:
        if cwd:
            os.chdir(cwd)
        return CliRunner().invoke(main, [str(a) for a in args])
    finally:
        os.chdir(old)


def assert_clean_error(result, *needles, code=1):
    assert result.exit_code == code, (result.exit_code, result.output, result.stderr)
    err = result.stderr.strip()
    assert "Traceback" not in result.output + result.stderr
    if code == 1:
        assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    for n in needles:
        assert str(n) in err, (n, err)


def test_has_aux_and_wrt_via_cli(ws, tmp_path):
    _, src, _ = ws
    r = run_cli(
        "export",
        "model:with_aux",
        "--has-aux",
        "--wrt",
        "w",
        "--shapes",
        "x=f32[b,3]",
        "--shapes",
        "w=f32[3,2]",
        "--platforms",
        "cpu",
        "-o",
        tmp_path / "aux.vjps",
        cwd=src,
    )
    assert r.exit_code == 0, r.output
    x, w = np.ones((4, 3), np.float32), np.arange(6, dtype=np.float32).reshape(3, 2)
    vs.save_arrays(tmp_path / "in.npz", {"x": x, "w": w})
    r = run_cli(
        "run-fwd",
        tmp_path / "aux.vjps",
        *opts(inputs=tmp_path / "in.npz", residuals=tmp_path / "r.npz", outputs=tmp_path / "o.npz"),
    )
    assert r.exit_code == 0, r.output
    outs, _ = vs.load_arrays(tmp_path / "o.npz")
    assert sorted(outs) == ["aux/argmax", "aux/mean", "out"] and outs["aux/argmax"].dtype == np.int32
    r = run_cli(
        "run-bwd",
        tmp_path / "aux.vjps",
        *opts(residuals=tmp_path / "r.npz", inputs=tmp_path / "in.npz", grads=tmp_path / "g.npz"),
    )
    assert r.exit_code == 0, r.output
    g, _ = vs.load_arrays(tmp_path / "g.npz")
    assert list(g) == ["w"]
    np.testing.assert_allclose(g["w"], jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w), rtol=1e-5)


def test_vector_output_needs_cotangents_then_uses_them(ws, tmp_path):
    _, src, _ = ws
    assert run_cli("export", "model:vector", "--shapes", "x=f32[n]", "-o", tmp_path / "v.vjps", cwd=src).exit_code == 0
    x = np.linspace(0, 1, 5, dtype=np.float32)
    vs.save_arrays(tmp_path / "in.npz", {"x": x})
    args = ("--residuals", tmp_path / "r.npz", "--inputs", tmp_path / "in.npz", "--grads", tmp_path / "g.npz")
    assert (
        run_cli(
            "run-fwd", tmp_path / "v.vjps", "--inputs", tmp_path / "in.npz", "--residuals", tmp_path / "r.npz"
        ).exit_code
        == 0
    )
    assert_clean_error(run_cli("run-bwd", tmp_path / "v.vjps", *args), "cotangents are required", "out/a")
    assert not (tmp_path / "g.npz").exists()
    ct = np.arange(5, dtype=np.float32)
    vs.save_arrays(tmp_path / "ct.msgpack", {"out/a": ct, "out/n": np.int32(0)})
    r = run_cli("run-bwd", tmp_path / "v.vjps", *args, "--cotangents", tmp_path / "ct.msgpack")
    assert r.exit_code == 0, r.output
    np.testing.assert_allclose(vs.load_arrays(tmp_path / "g.npz")[0]["x"], np.cos(x) * ct, rtol=1e-6)


def test_shapes_from_an_array_file(ws, tmp_path):
    _, src, run = ws
    r = run_cli(
        "export",
        "model:loss",
        "--shapes",
        f"params={run / 'inputs.npz'}",
        "--shapes",
        "x=f32[b,6]",
        "--shapes",
        "labels=i32[b]",
        "--platforms",
        "cpu",
        "-o",
        tmp_path / "f.vjps",
        cwd=src,
    )
    assert r.exit_code == 0, r.output
    assert [leaf.key for leaf in vs.load(tmp_path / "f.vjps").manifest.inputs][:3] == [
        "params/layers/0/b",
        "params/layers/0/w",
        "params/layers/1/w",
    ]


def test_module_given_as_a_file_path(ws, tmp_path):
    _, src, _ = ws
    r = run_cli(
        "export", src / "model.py:vector", "--shapes", "x=f32[3]", "--platforms", "cpu", "-o", tmp_path / "p.vjps"
    )
    assert r.exit_code == 0, r.output


# --- bad input: one line, exit 1, no traceback, no partial output ------------------------------


@pytest.fixture()
def bad(ws, tmp_path):
    """Files for the bad-input cases, plus the good ones to pair them with."""
    root, _, run = ws
    good = make_inputs()
    files = {}
    files["random"] = tmp_path / "random.npz"
    files["random"].write_bytes(os.urandom(300))
    files["dtype"] = tmp_path / "dtype.npz"
    vs.save_arrays(files["dtype"], {**good, "x": good["x"].astype(np.float16)})
    files["shape"] = tmp_path / "shape.npz"
    vs.save_arrays(files["shape"], {**good, "params/layers/0/w": good["params/layers/0/w"][:5]})
    files["unknown"] = tmp_path / "unknown.npz"
    vs.save_arrays(files["unknown"], {**good, "extra": np.zeros(2)})
    files["missing"] = tmp_path / "missing.npz"
    vs.save_arrays(files["missing"], {k: v for k, v in good.items() if k != "labels"})
    files["batch"] = tmp_path / "batch.npz"
    vs.save_arrays(files["batch"], {**good, "labels": good["labels"][:2]})
    return root / "loss.vjps", run / "inputs.npz", files


@pytest.mark.parametrize(
    "case,needles",
    [
        ("random", ["random.npz"]),
        ("dtype", ["dtype.npz", "input 'x'", "expected f32[b,6]", "f16[5,6]"]),
        ("shape", ["shape.npz", "input 'params/layers/0/w'", "expected f32[6,8]", "f32[5,8]"]),
        ("unknown", ["unknown.npz", "unknown input key 'extra'"]),
        ("missing", ["missing.npz", "missing input key 'labels'"]),
        ("batch", ["batch.npz", "input 'labels'", "b=5", "i32[2]"]),
    ],
)
def test_run_fwd_bad_inputs(bad, tmp_path, case, needles):
    art, _, files = bad
    r = run_cli(
        "run-fwd",
        art,
        *opts(inputs=files[case], residuals=tmp_path / "out_r.npz", outputs=tmp_path / "out_o.npz"),
    )
    assert_clean_error(r, *needles)
    assert not (tmp_path / "out_r.npz").exists() and not (tmp_path / "out_o.npz").exists()
    assert not list(tmp_path.glob(".*tmp"))


def test_run_fwd_missing_inputs_file(bad, tmp_path):
    art, _, _ = bad
    r = run_cli("run-fwd", art, "--inputs", tmp_path / "nope.npz", "--residuals", tmp_path / "r.npz")
    assert_clean_error(r, "nope.npz", "no such")


# Random bytes from a fixed seed: the same test ids in every process that collects them (pytest-xdist).
@pytest.mark.parametrize(
    "content", [b"", b"VJPSPLIT\x00garbage", np.random.default_rng(0).bytes(64)], ids=["empty", "header", "random"]
)
def test_bad_artifact_file(bad, tmp_path, content):
    _, inputs, _ = bad
    p = tmp_path / "broken.vjps"
    p.write_bytes(content)
    for args in (("inspect", p), ("run-fwd", p, "--inputs", inputs, "--residuals", tmp_path / "r.npz")):
        assert_clean_error(run_cli(*args), "broken.vjps")
    assert not (tmp_path / "r.npz").exists()


def test_residuals_from_another_artifact(ws, tmp_path):
    root, src, run = ws
    assert (
        run_cli("export", "model:vector", "--shapes", "x=f32[n]", "-o", tmp_path / "other.vjps", cwd=src).exit_code == 0
    )
    vs.save_arrays(tmp_path / "vin.npz", {"x": np.ones(3, np.float32)})
    assert (
        run_cli(
            "run-fwd",
            tmp_path / "other.vjps",
            *opts(inputs=tmp_path / "vin.npz", residuals=tmp_path / "other_r.npz"),
        ).exit_code
        == 0
    )
    r = run_cli(
        "run-bwd",
        root / "loss.vjps",
        *opts(residuals=tmp_path / "other_r.npz", inputs=run / "inputs.npz", grads=tmp_path / "g.npz"),
    )
    assert_clean_error(r, "other_r.npz", "another artifact")
    assert not (tmp_path / "g.npz").exists()


def test_run_bwd_bad_residuals_and_cotangents(ws, tmp_path):
    root, _, run = ws
    art = root / "loss.vjps"
    assert run_cli("run-fwd", art, "--inputs", run / "inputs.npz", "--residuals", tmp_path / "r.npz").exit_code == 0
    g = tmp_path / "g.npz"
    # inputs left out of the residuals and not given
    assert_clean_error(run_cli("run-bwd", art, "--residuals", tmp_path / "r.npz", "--grads", g), "r.npz", "--inputs")
    # a residual with the wrong dtype
    arrays, meta = vs.load_arrays(tmp_path / "r.npz")
    key = next(k for k, v in arrays.items() if v.dtype == np.float32 and v.ndim == 2)
    vs.save_arrays(tmp_path / "r_bad.npz", {**arrays, key: arrays[key].astype(np.float64)}, meta)
    assert_clean_error(
        run_cli("run-bwd", art, "--residuals", tmp_path / "r_bad.npz", "--inputs", run / "inputs.npz", "--grads", g),
        "r_bad.npz",
        f"residual '{key}'",
        "expected f32",
    )
    assert_clean_error(
        run_cli(
            "run-bwd",
            art,
            *opts(residuals=tmp_path / "r_bad.npz", inputs=run / "inputs.npz", grads=g, no_verify=True),
        ),
        "r_bad.npz",
        f"residual '{key}'",
        "expected f32",
    )
    # a residual missing
    vs.save_arrays(tmp_path / "r_miss.npz", {k: v for k, v in arrays.items() if k != key}, meta)
    assert_clean_error(
        run_cli(
            "run-bwd",
            art,
            *opts(residuals=tmp_path / "r_miss.npz", inputs=run / "inputs.npz", grads=g, no_verify=True),
        ),
        "r_miss.npz",
        f"missing residual key '{key}'",
    )
    # a plain array file is not a residuals file
    assert_clean_error(
        run_cli("run-bwd", art, "--residuals", run / "inputs.npz", "--grads", g), "inputs.npz", "not a residuals file"
    )
    # cotangent with the wrong shape / an unknown key
    vs.save_arrays(tmp_path / "ct.npz", {"out": np.ones(3, np.float32)})
    assert_clean_error(
        run_cli(
            "run-bwd",
            art,
            *opts(residuals=tmp_path / "r.npz", inputs=run / "inputs.npz", cotangents=tmp_path / "ct.npz", grads=g),
        ),
        "ct.npz",
        "cotangent 'out'",
    )
    vs.save_arrays(tmp_path / "ct2.npz", {"out": np.float32(1), "aux": np.float32(1)})
    assert_clean_error(
        run_cli(
            "run-bwd",
            art,
            *opts(residuals=tmp_path / "r.npz", inputs=run / "inputs.npz", cotangents=tmp_path / "ct2.npz", grads=g),
        ),
        "ct2.npz",
        "unknown cotangent key 'aux'",
    )
    assert not g.exists()


def test_existing_output_survives_a_failed_run(ws, tmp_path):
    root, _, run = ws
    art = root / "loss.vjps"
    target = tmp_path / "r.npz"
    target.write_bytes(b"previous")
    vs.save_arrays(tmp_path / "bad.npz", {"x": np.ones(2)})
    assert_clean_error(run_cli("run-fwd", art, "--inputs", tmp_path / "bad.npz", "--residuals", target))
    assert target.read_bytes() == b"previous"


@pytest.mark.parametrize(
    "args,needles",
    [
        (["model:nope", "--shapes", "x=f32[3]"], ["no attribute 'nope'"]),
        (["nomodule:loss", "--shapes", "x=f32[3]"], ["cannot import module 'nomodule'"]),
        (["model:printing", "--shapes", "x=f32[3]"], ["host callback"]),
        (["model:broken", "--shapes", "x=f32[3]"], ["model bug"]),
        (["model:vector", "--shapes", "x=f32[3]", "--platforms", "cpu,gpu9"], ["unknown platform 'gpu9'"]),
        (["model:vector", "--shapes", "x=f32[3]", "--policy", "most"], ["unknown policy 'most'"]),
    ],
)
def test_export_errors(ws, tmp_path, args, needles):
    _, src, _ = ws
    out = tmp_path / "a.vjps"
    assert_clean_error(run_cli("export", *args, "-o", out, cwd=src), *needles)
    assert not out.exists()


@pytest.mark.parametrize(
    "args,needle",
    [
        (["model:vector", "--shapes", "x=f33[3]"], "unknown dtype 'f33'"),
        (["model:vector", "--shapes", "x=f32[3"], "not DTYPE[DIMS]"),
        (["model:vector", "--shapes", "x=f32[non_negative]"], "'non_negative' in 'f32[non_negative]' is reserved"),
        (["model:vector", "--shapes", "x=f32[mod]"], "'mod' in 'f32[mod]' is reserved"),
        (["model:vector", "--shapes", "y=f32[3]"], "not a parameter"),
        (["model:loss", "--shapes", "x=f32[3,6]"], "missing --shapes for parameter(s) params, labels"),
        (["model:vector"], "Missing option '--shapes'"),
        (["vector", "--shapes", "x=f32[3]"], "not MODULE:FN"),
        (["model:vector", "--shapes", "x=missing.npz"], "--shapes x=missing.npz: no such --shapes arrays file"),
        # The option and its value as given, then the reason (not the path again, as normalised: missing.npz).
        (["model:vector", "--shapes", "x=./missing.npz"], "--shapes x=./missing.npz: no such --shapes arrays file"),
        (["model:vector", "--shapes", "x=f32[3]", "--at", "b=x"], "'--at': 'b=x' is not NAME=SIZE"),
        (["model:vector", "--shapes", "x=f32[3]", "--at", "b=0"], "'--at': b=0: symbolic dims are >= 1"),
    ],
)
def test_usage_errors_exit_2(ws, tmp_path, args, needle):
    _, src, _ = ws
    r = run_cli("export", *args, "-o", tmp_path / "a.vjps", cwd=src)
    assert r.exit_code == 2, r.output
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "a.vjps").exists()


def test_debug_shows_the_traceback(ws, tmp_path):
    _, src, _ = ws
    r = cli("--debug", "export", "model:broken", "--shapes", "x=f32[3]", "-o", tmp_path / "a.vjps", cwd=src)
    assert r.returncode == 1 and "Traceback" in r.stderr and "model bug" in r.stderr
    r = cli("export", "model:broken", "--shapes", "x=f32[3]", "-o", tmp_path / "a.vjps", cwd=src)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith("error: ")


def test_missing_platform_at_run_time(ws, tmp_path):
    _, src, _ = ws
    assert (
        run_cli(
            "export", "model:vector", "--shapes", "x=f32[3]", "--platforms", "tpu", "-o", tmp_path / "tpu.vjps", cwd=src
        ).exit_code
        == 0
    )
    vs.save_arrays(tmp_path / "in.npz", {"x": np.ones(3, np.float32)})
    r = run_cli("run-fwd", tmp_path / "tpu.vjps", "--inputs", tmp_path / "in.npz", "--residuals", tmp_path / "r.npz")
    assert_clean_error(r, "tpu.vjps", "exported for tpu only", "--platforms")


@pytest.mark.parametrize("ext", ["npz", "msgpack"])
def test_a_flipped_bit_in_residual_data_is_caught(ws, tmp_path, ext):
    root, _, run = ws
    art = root / "loss.vjps"
    res = tmp_path / f"r.{ext}"
    assert run_cli("run-fwd", art, "--inputs", run / "inputs.npz", "--residuals", res).exit_code == 0
    arrays, _ = vs.load_arrays(res)
    big = max(arrays.values(), key=lambda a: a.nbytes)
    data = bytearray(res.read_bytes())
    at = bytes(data).find(big.tobytes()[:64])  # somewhere inside that array's payload
    assert at > 0
    data[at + 5] ^= 0x10
    res.write_bytes(bytes(data))
    r = run_cli("run-bwd", art, "--residuals", res, "--inputs", run / "inputs.npz", "--grads", tmp_path / "g.npz")
    assert_clean_error(r, res.name, "array '", "fails its CRC-32 check")
    assert not (tmp_path / "g.npz").exists()


@pytest.mark.parametrize("mode", ["cache", "no-cache-flag", "env-off"])
def test_persistent_compilation_cache(ws, tmp_path, mode):
    root, _, run = ws
    cache = tmp_path / "cache"
    env = {**os.environ, "VJPSPLIT_CACHE_DIR": "off" if mode == "env-off" else str(cache)}
    flags = ["--no-cache"] if mode == "no-cache-flag" else []
    exe = [
        sys.executable,
        "-m",
        "vjpsplit_cli",
        *flags,
        "run-fwd",
        str(root / "loss.vjps"),
        *opts(inputs=run / "inputs.npz", residuals=tmp_path / "r.npz"),
    ]
    r = subprocess.run(exe, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    entries = list(cache.iterdir()) if cache.exists() else []
    if mode == "cache":
        assert entries, "run-fwd compiled nothing into the cache"
    else:
        assert not entries
