"""Real models from flax (linen, nnx), equinox, haiku and optax through split, artifacts and the CLI.

Every case is checked against ``jax.value_and_grad`` on the same inputs: the
loss, the aux, and every gradient leaf by its file key, at two batch sizes of
one symbolic-batch artifact.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import model_zoo
import numpy as np
import pytest
from click.testing import CliRunner
from clihelp import opts

import vjpsplit_cli as vs
from vjpsplit_cli.cli import main
from vjpsplit_cli.files.trees import flatten_with_keys

CASES = model_zoo.cases()
LIBRARIES = {"flax.linen": "flax", "flax.nnx": "flax", "optax": "optax", "equinox": "equinox", "dm-haiku": "haiku"}


def _missing(case) -> list[str]:
    mods = {LIBRARIES[part.strip()] for part in case.library.split("+") if part.strip() in LIBRARIES}
    return sorted(m for m in mods if importlib.util.find_spec(m) is None)


def _params(cases):
    out = []
    for c in cases:
        missing = _missing(c)
        # Only on the oldest jax, where a library may not install; CI's newest jax has them all.
        marks = [pytest.mark.skip(reason=f"{', '.join(missing)} not installed")] if missing else []
        out.append(pytest.param(c, id=c.name, marks=marks))
    return out


def _names(case) -> list[str]:
    return list(inspect.signature(case.loss).parameters)


def _wrt_positions(case) -> tuple[int, ...]:
    names = _names(case)
    wrt = (case.wrt,) if isinstance(case.wrt, str) else tuple(case.wrt)
    return tuple(names.index(w) for w in wrt)


def _reference(case, args):
    """``((loss, aux), {grad file key: grad})`` from jax.value_and_grad."""
    pos = _wrt_positions(case)
    value, grads = jax.value_and_grad(case.loss, argnums=pos, has_aux=case.has_aux)(*args)
    loss, aux = value if case.has_aux else (value, None)
    names = _names(case)
    flat = {k: v for p, g in zip(pos, grads) for k, v in flatten_with_keys(names[p], g)}
    return loss, aux, flat


def _close(case, got, want, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=case.rtol, atol=case.atol, err_msg=what)


def _check_grads(case, grads, ref_flat):
    """``grads`` as split/Artifact return them (the arguments' own structure) against the reference."""
    names = _names(case)
    pos = _wrt_positions(case)
    per_arg = (grads,) if isinstance(case.wrt, str) else grads
    got = {}
    for p, g in zip(pos, per_arg):
        got.update(flatten_with_keys(names[p], g))
    assert set(got) == set(ref_flat)
    for k, v in ref_flat.items():
        assert got[k].dtype == v.dtype, k
        _close(case, got[k], v, k)


def _check_tree_types(case, grads, args):
    """Gradients come back in the arguments' own pytree types (NamedTuple, nnx.State, eqx Module...)."""
    per_arg = (grads,) if isinstance(case.wrt, str) else grads
    for p, g in zip(_wrt_positions(case), per_arg):
        assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(args[p])


@pytest.fixture(scope="module")
def artifacts():
    """One exported artifact per case (cpu only, symbolic batch), made on first use."""
    made = {}

    def get(case):
        if case.name not in made:
            specs = case.specs(jax.export.symbolic_shape("b")[0])
            made[case.name] = vs.export(case.loss, *specs, wrt=case.wrt, has_aux=case.has_aux, platforms="cpu")
        return made[case.name]

    return get


@pytest.mark.parametrize("case", _params(CASES))
def test_split_matches_value_and_grad(case):
    fwd, bwd = vs.split(case.loss, wrt=case.wrt, has_aux=case.has_aux)
    for n in (4, 6):
        args = case.args(n)
        loss, aux, ref = _reference(case, args)
        got = fwd(*args)
        _close(case, got[0], loss, "loss")
        if case.has_aux:
            jax.tree_util.tree_map(lambda a, b: _close(case, a, b, "aux"), got[2], aux)
        grads = bwd(got[1])
        _check_grads(case, grads, ref)
        _check_tree_types(case, grads, args)


@pytest.mark.parametrize("case", _params(CASES))
def test_artifact_matches_value_and_grad(case, artifacts, tmp_path):
    art = vs.loads(artifacts(case).to_bytes())  # as a fresh load sees it: no user class inside
    for n in (4, 6):
        args = case.args(n)
        loss, aux, ref = _reference(case, args)
        got = art.fwd(*args)
        _close(case, got[0], loss, "loss")
        if case.has_aux:
            assert jax.tree_util.tree_structure(got[2]) == jax.tree_util.tree_structure(aux)
            jax.tree_util.tree_map(lambda a, b: _close(case, a, b, "aux"), got[2], aux)
        grads = art.bwd(got[1])
        _check_grads(case, grads, ref)
        _check_tree_types(case, grads, args)
        # Through a residuals file: the inputs given to load_residuals restore the structure.
        vs.save_residuals(tmp_path / f"r{n}.msgpack", got[1])
        res = vs.load_residuals(tmp_path / f"r{n}.msgpack", inputs=args, artifact=art)
        again = art.bwd(res)
        _check_grads(case, again, ref)
        _check_tree_types(case, again, args)


def _input_arrays(case, args) -> dict:
    names = _names(case)
    return {
        k: np.asarray(jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v)
        for n, a in zip(names, args)
        for k, v in flatten_with_keys(n, a)
    }


def _invoke(args):
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def _run_cli(case, art_path, tmp_path, n, env_free=False):
    args = case.args(n)
    vs.save_arrays(tmp_path / f"in{n}.npz", _input_arrays(case, args))
    _invoke(
        [
            "run-fwd",
            str(art_path),
            *opts(
                inputs=tmp_path / f"in{n}.npz",
                residuals=tmp_path / f"res{n}.npz",
                outputs=tmp_path / f"out{n}.npz",
            ),
        ]
    )
    _invoke(
        [
            "run-bwd",
            str(art_path),
            *opts(
                residuals=tmp_path / f"res{n}.npz",
                inputs=tmp_path / f"in{n}.npz",
                grads=tmp_path / f"g{n}.npz",
            ),
        ]
    )
    return args


def _check_files(case, tmp_path, n, args):
    loss, aux, ref = _reference(case, args)
    outs, _ = vs.load_arrays(tmp_path / f"out{n}.npz")
    grads, _ = vs.load_arrays(tmp_path / f"g{n}.npz")
    _close(case, outs["out"], loss, "loss")
    if case.has_aux:
        for k, v in flatten_with_keys("aux", aux):
            _close(case, outs[k], v, k)
    assert set(grads) == set(ref)
    for k, v in ref.items():
        assert grads[k].dtype == v.dtype, k
        _close(case, grads[k], v, k)


@pytest.mark.parametrize("case", _params(CASES))
def test_cli_matches_value_and_grad(case, tmp_path):
    art_path = tmp_path / "model.vjps"
    cmd = ["export", f"{model_zoo.ZOO}:{case.loss.__name__}", "--platforms", "cpu", "-o", str(art_path)]
    for s in case.cli_shapes:
        cmd += ["--shapes", s]
    wrt = (case.wrt,) if isinstance(case.wrt, str) else case.wrt
    cmd += ["--wrt", ",".join(wrt)] + (["--has-aux"] if case.has_aux else [])
    _invoke(cmd)
    for n in (4, 6):
        args = _run_cli(case, art_path, tmp_path, n)
        _check_files(case, tmp_path, n, args)


# A process that cannot import any model library: the artifact must not need them.
_BLOCKER = textwrap.dedent(
    """
    import json, sys

    class _NoModelLibraries:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"flax", "equinox", "haiku", "optax", "model_zoo", "tests"}:
                raise ImportError(f"{name} is blocked in this process")
            return None

    sys.meta_path.insert(0, _NoModelLibraries())
    from vjpsplit_cli.cli import main
    for argv in json.loads(sys.argv[1]):  # every command in this one process
        try:
            main(argv, standalone_mode=False)
        except SystemExit as e:
            if e.code:
                raise
    """
)

_NO_LIBRARY_CASES = ("nnx_state", "equinox_mlp", "haiku_nested", "block_typed_key", "namedtuple_dataclass")


def test_artifacts_run_where_no_model_library_can_be_imported(artifacts, tmp_path):
    cases = [c for c in CASES if c.name in _NO_LIBRARY_CASES and not _missing(c)]
    assert cases, "no model library is installed"
    commands = []
    for case in cases:
        d = tmp_path / case.name
        d.mkdir()
        artifacts(case).save(d / "model.vjps")
        vs.save_arrays(d / "in.npz", _input_arrays(case, case.args(5)))
        commands += [
            [
                "run-fwd",
                str(d / "model.vjps"),
                *opts(inputs=d / "in.npz", residuals=d / "res5.npz", outputs=d / "out5.npz"),
            ],
            [
                "run-bwd",
                str(d / "model.vjps"),
                *opts(residuals=d / "res5.npz", inputs=d / "in.npz", grads=d / "g5.npz"),
            ],
        ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKER, json.dumps(commands)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    for case in cases:
        _check_files(case, tmp_path / case.name, 5, case.args(5))


def test_the_blocker_really_blocks(tmp_path):
    """Guard for the test above: in that process a model library import fails."""
    code = _BLOCKER.split("from vjpsplit_cli.cli import main")[0] + "import flax\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "blocked" in proc.stderr


def test_gradients_without_the_callers_structure_come_back_keyed_as_in_files(artifacts, tmp_path):
    """Loaded residuals and flat inputs: user classes come back as dicts keyed like the files."""
    case = next(c for c in CASES if c.name == "namedtuple_dataclass")
    art = vs.loads(artifacts(case).to_bytes())
    args = case.args(4)
    _, res = art.fwd(*args)
    vs.save_residuals(tmp_path / "r.npz", res)
    flat = _input_arrays(case, args)
    g = art.bwd(vs.load_residuals(tmp_path / "r.npz", inputs=flat))
    assert isinstance(g, dict) and set(g) == {"first", "second", "scale"}
    assert set(g["first"]) == {"w", "b"}
    _, _, ref = _reference(case, args)
    np.testing.assert_allclose(g["second"]["w"], ref["params/second/w"], rtol=1e-5)
