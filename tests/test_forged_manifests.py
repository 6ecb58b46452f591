"""Forged manifests (issue 27): re-fingerprinted, as a forger would; each refused in one line naming the file.

No raw exception text travels in the message, and strings from the file never
break the error line (a newline in an argument name is escaped, as ``inspect`` does).
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from click.testing import CliRunner
from clihelp import opts

import vjpsplit_cli as vs
from vjpsplit_cli.artifact.manifest import MAGIC, fingerprint_json
from vjpsplit_cli.cli import main

EVIL = "x\nerror: all good"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("forged")
    s = jax.ShapeDtypeStruct
    art = vs.export(
        lambda w, x: jnp.sum(jnp.tanh(x @ w)),
        s((4, 3), np.float32),
        s((5, 4), np.float32),
        arg_names=("w", "x"),
        platforms="cpu",
    )
    rng = np.random.default_rng(0)
    vs.save_arrays(d / "in.npz", {"w": rng.normal(size=(4, 3)).astype(np.float32), "x": np.ones((5, 4), np.float32)})
    return d, msgpack.unpackb(art.to_bytes()[len(MAGIC) :], raw=False)


def _forge(top, edit) -> bytes:
    top = copy.deepcopy(top)
    edit(top["manifest"])
    top["manifest"]["fingerprint"] = fingerprint_json(top["manifest"], top)
    return MAGIC + msgpack.packb(top, use_bin_type=True)


def _set(field, value):
    return lambda m: m.__setitem__(field, value)


def _backed_to(key):
    def edit(m):
        next(r for r in m["residuals"] if r["input_backed"])["key"] = key

    return edit


def _rename_arg(m, old, new):
    """Rename an argument everywhere it appears: a consistent forgery that passes every reference check."""
    m["arg_names"] = [new if n == old else n for n in m["arg_names"]]
    m["wrt"] = [new if n == old else n for n in m["wrt"]]
    m["structure"]["args"] = {new if k == old else k: v for k, v in m["structure"]["args"].items()}
    for leaf in m["inputs"] + m["grads"]:
        leaf["key"] = new if leaf["key"] == old else leaf["key"]
    for leaf in m["residuals"]:
        leaf["key"] = f"in/{new}" if leaf["key"] == f"in/{old}" else leaf["key"]


FORGERIES = {
    "input-backed residual for no input": (_backed_to("in/zzz"), "'in/zzz' names no input"),
    "gradient for no input": (lambda m: m["grads"][0].__setitem__("key", "zzz"), "gradient 'zzz' names no input"),
    "gradient twice": (lambda m: m["grads"].append(dict(m["grads"][0])), "a gradient appears twice"),
    "wrt names no argument": (_set("wrt", ["zz"]), "differentiated argument 'zz' is not an argument"),
    "structure of no argument": (lambda m: m["structure"].__setitem__("args", {}), "does not describe every argument"),
    "inputs of a wrong type": (_set("inputs", 5), "'inputs' has the wrong type"),
    "grads missing": (lambda m: m.pop("grads"), "'grads' is missing"),
    "a newline in a key": (lambda m: m["inputs"][0].__setitem__("key", EVIL), "names no input"),
}


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    for raw in ("KeyError", "TypeError", "AttributeError", "ValueError", "Traceback"):
        assert raw not in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("case", sorted(FORGERIES))
def test_a_forged_manifest_is_one_line_naming_the_artifact_file(made, tmp_path, case):
    d, top = made
    edit, needle = FORGERIES[case]
    path = tmp_path / "forged.vjps"
    path.write_bytes(_forge(top, edit))
    with pytest.raises(vs.VjpsplitError) as e:
        vs.load(path, cache_dir=None)
    msg = _one_line(str(e.value))
    assert msg.startswith(f"{path}: malformed artifact manifest (") and needle in msg, msg
    r = CliRunner().invoke(main, ["run-fwd", str(path), *opts(inputs=d / "in.npz", residuals=tmp_path / "r.npz")])
    err = _one_line(r.stderr)
    assert r.exit_code == 1 and err.startswith(f"error: {path}: malformed artifact manifest"), err
    assert not (tmp_path / "r.npz").exists()


def test_an_argument_name_with_a_newline_never_breaks_the_error_line(made, tmp_path):
    d, top = made
    path = tmp_path / "evil.vjps"
    path.write_bytes(_forge(top, lambda m: _rename_arg(m, "x", EVIL)))
    art = vs.load(path, cache_dir=None)  # consistent: it loads, and its argument is named EVIL
    assert art.manifest.arg_names[1] == EVIL
    with pytest.raises(vs.VjpsplitError) as e:
        art.run_fwd_arrays({"w": np.ones((4, 3), np.float32)})
    assert "\n" not in str(e.value) and "x\\nerror: all good" in str(e.value)
    r = CliRunner().invoke(main, ["run-fwd", str(path), *opts(inputs=d / "in.npz", residuals=tmp_path / "r.npz")])
    err = _one_line(r.stderr)
    assert r.exit_code == 1 and err.startswith("error: ") and "x\\nerror: all good" in err, err  # escaped
    r = CliRunner().invoke(main, ["inspect", str(path)])
    assert r.exit_code == 0 and "x\\nerror: all good" in r.stdout and "\nerror: all good" not in r.stdout
