"""What ``export`` is pointed at (issue 27): a target JAX cannot trace, and ``--shapes`` files that are not there."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from click.testing import CliRunner

import vjpsplit_cli as vs
from vjpsplit_cli.cli import main


@pytest.fixture()
def ws(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.py").write_text(
        "import jax.numpy as jnp\ndef f(w, x):\n    return jnp.sum(x @ w)\nclass K:\n    pass\nnotfn = 3\n"
    )
    return tmp_path


def _one_line(r, code):
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == code and len(lines) == 1 and lines[0].startswith("error: "), (r.exit_code, r.stderr)
    return lines[0]


@pytest.mark.parametrize(
    "target, what",
    [
        ("numpy:sin", "is a NumPy ufunc (numpy.sin), which JAX cannot trace; use jax.numpy.sin"),
        ("numpy:sum", "is a NumPy function (numpy.sum)"),
        ("m.py:K", "is a class (K), not a function"),
        ("m.py:notfn", "is an object of type int, not a function"),
    ],
)
@pytest.mark.parametrize("command", ["export", "plan"])
def test_a_target_that_is_not_a_traceable_function_is_one_error_saying_what_it_is(ws, target, what, command):
    out = ["-o", "o.vjps"] if command == "export" else []
    r = CliRunner().invoke(main, [command, target, "--shapes", "x=f32[3]", *out])
    err = _one_line(r, 1)
    assert f"error: {target} {what}" in err and "needs a Python function that JAX can trace" in err, err
    assert "--shapes do not fit" not in err and "weak reference" not in err
    assert not (ws / "o.vjps").exists()


def test_the_python_api_refuses_a_numpy_ufunc_by_what_it_is():
    with pytest.raises(vs.VjpsplitError, match=r"it is a NumPy ufunc \(numpy\.sin\).*jax\.numpy\.sin"):
        vs.export(np.sin, jax.ShapeDtypeStruct((3,), np.float32), platforms="cpu")


@pytest.mark.parametrize("spec, why", [("MISSING.NPZ", "no such"), ("adir.npz", "is a directory")])
@pytest.mark.parametrize("command", ["export", "plan"])
def test_shapes_naming_a_missing_or_unreadable_file_is_a_usage_error(ws, spec, why, command):
    (ws / "adir.npz").mkdir()
    out = ["-o", "o.vjps"] if command == "export" else []
    r = CliRunner().invoke(main, [command, "m.py:f", "--shapes", f"w={spec}", "--shapes", "x=f32[2,4]", *out])
    err = _one_line(r, 2)
    assert f"--shapes w={spec}: " in err and why in err, err
    assert not (ws / "o.vjps").exists()


def test_shapes_from_a_damaged_file_is_still_a_file_error(ws):
    (ws / "empty.npz").write_bytes(b"")
    r = CliRunner().invoke(
        main, ["export", "m.py:f", "--shapes", "w=empty.npz", "--shapes", "x=f32[2,4]", "-o", "o.vjps"]
    )
    assert "empty.npz" in _one_line(r, 1)
