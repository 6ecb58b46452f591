"""policy="auto", the serialized-executable cache of the CLI, and the artifact's checked-once residuals.

No wall-clock asserts: auto's timings decide only which valid policy it picks;
these tests check that the pick is valid, fits the budget, is recorded as a
concrete policy, and gives jax.grad's gradients.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from clihelp import opts

import vjpsplit_cli as vs
from vjpsplit_cli.artifact.execcache import compiled_call, entry_key
from vjpsplit_cli.cli import main
from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.tracing.choice import choose_auto
from vjpsplit_cli.tracing.policies import POLICIES, policy_cost


def loss(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return jnp.mean(jnp.tanh(h @ params["w2"]) ** 2)


def make(batch=16):
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(8, 32)).astype(np.float32),
        "b1": np.zeros(32, np.float32),
        "w2": rng.normal(size=(32, 4)).astype(np.float32),
    }
    return params, rng.normal(size=(batch, 8)).astype(np.float32)


def specs_of(*args):
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)


def assert_grads_equal(got, want):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["measure", "estimate"])
def test_auto_picks_a_fixed_policy_and_says_why(method):
    choice = choose_auto(loss, *specs_of(*make()), method=method, seconds_per_candidate=0.01)
    assert choice.policy in POLICIES
    assert choice.method == ("measured" if method == "measure" else "estimated")
    assert set(choice.seconds) == set(POLICIES) and all(t > 0 for t in choice.seconds.values())
    assert choice.seconds[choice.policy] <= 1.01 * min(choice.seconds.values())
    assert choice.reason.startswith(f"auto chose {choice.policy}")
    assert all(p in choice.reason for p in POLICIES)
    json.dumps(choice.to_json())


def test_auto_respects_the_memory_budget():
    specs = specs_of(*make())
    stored = {p: policy_cost(loss, *specs, policy=p, flops=False).stored_bytes for p in POLICIES}
    assert stored["everything"] > stored["dots"] > stored["nothing"] == 0
    for budget in (stored["dots"], stored["dots"] - 1, 0):
        choice = choose_auto(loss, *specs, memory_budget=budget, seconds_per_candidate=0.01)
        assert choice.stored_bytes[choice.policy] <= budget
        assert all(stored[p] <= budget for p in choice.seconds)  # only fitting candidates were timed
    assert choose_auto(loss, *specs, memory_budget=0).policy == "nothing"
    assert "over the budget" in choose_auto(loss, *specs, memory_budget=0).reason


def test_auto_needs_sizes_for_symbolic_dims():
    (b,) = jax.export.symbolic_shape("b")
    params, _ = make()
    specs = (specs_of(params)[0], jax.ShapeDtypeStruct((b, 8), jnp.float32))
    with pytest.raises(VjpsplitError, match="--at"):
        choose_auto(loss, *specs)
    assert choose_auto(loss, *specs, at={"b": 16}, seconds_per_candidate=0.01).policy in POLICIES


def test_split_auto_gives_jax_grad():
    params, x = make()
    fwd, bwd = vs.split(loss, policy="auto", memory_budget="1MiB")
    out, res = fwd(params, x)
    np.testing.assert_allclose(out, loss(params, x), rtol=1e-6)
    assert_grads_equal(bwd(res), jax.grad(loss, argnums=(0, 1))(params, x))


def test_export_auto_records_the_concrete_policy_and_gives_jax_grad(tmp_path):
    params, x = make()
    (b,) = jax.export.symbolic_shape("b")
    specs = (specs_of(params)[0], jax.ShapeDtypeStruct((b, 8), jnp.float32))
    art = vs.export(loss, *specs, policy="auto", at={"b": 16}, memory_budget=0, platforms="cpu")
    assert art.manifest.policy == "nothing"  # the only one that stores 0 bytes
    art = vs.export(loss, *specs, policy="auto", at={"b": 16}, platforms="cpu")
    assert art.manifest.policy in POLICIES
    art.save(tmp_path / "a.vjps")
    art = vs.load(tmp_path / "a.vjps")
    assert art.manifest.policy in POLICIES
    out, res = art.fwd(params, x)
    assert_grads_equal(art.bwd(res), jax.grad(loss, argnums=(0, 1))(params, x))


MODEL = textwrap.dedent(
    """
    import jax, jax.numpy as jnp

    def loss(w, x):
        return jnp.mean(jnp.tanh(jax.nn.relu(x @ w)) ** 2)
    """
)


def test_cli_auto_export_and_plan(tmp_path, monkeypatch):
    (tmp_path / "m.py").write_text(MODEL)
    monkeypatch.chdir(tmp_path)
    shapes = ["--shapes", "w=f32[8,16]", "--shapes", "x=f32[b,8]"]
    r = CliRunner().invoke(
        main,
        [
            "export",
            "m.py:loss",
            *shapes,
            *opts(policy="auto", at="b=32", memory_budget="0", platforms="cpu"),
            "-o",
            "a.vjps",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "auto chose nothing within 0 B at b=32" in r.stderr
    r = CliRunner().invoke(main, ["inspect", "a.vjps", "--json"])
    assert json.loads(r.stdout)["policy"] == "nothing"
    r = CliRunner().invoke(
        main, ["plan", "m.py:loss", *shapes, "--at", "b=32", "--policies", "everything,dots,nothing,auto"]
    )
    assert r.exit_code == 0, r.output
    assert "auto chose " in r.stdout and "measured" in r.stdout
    r = CliRunner().invoke(main, ["plan", "m.py:loss", *shapes, "--policies", "auto"])
    assert r.exit_code == 1 and "--at" in r.stderr


# ------------------------------------------------------------------ the executable cache


def test_executable_cache_round_trip_and_corrupt_entries(tmp_path, monkeypatch):
    from jax.experimental import serialize_executable as se

    loads = []  # every entry the cache deserializes: proves which calls loaded and which compiled
    real_load = se.deserialize_and_load
    monkeypatch.setattr(se, "deserialize_and_load", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    params, x = make()
    (b,) = jax.export.symbolic_shape("b")
    art = vs.export(loss, specs_of(params)[0], jax.ShapeDtypeStruct((b, 8), jnp.float32), platforms="cpu")
    flat = list(jax.tree_util.tree_leaves((params, x)))
    call = art._calls["fwd"]
    want = call(*flat)
    d = str(tmp_path / "exe")
    first = compiled_call(call, flat, ("fp", "fwd"), d)  # compiles and saves
    (entry,) = os.listdir(d)
    assert entry == entry_key(flat, ("fp", "fwd")) + ".exe"
    assert loads == []
    second = compiled_call(call, flat, ("fp", "fwd"), d)  # loads
    assert loads == [1]
    for got in (first(*flat), second(*flat)):
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    path = os.path.join(d, entry)
    if not os.path.exists(path):  # an entry that failed to run (see execcache._guarded) was dropped: remake it
        compiled_call(call, flat, ("fp", "fwd"), d)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF  # a flipped byte fails the entry's SHA-256: ignored, recompiled, rewritten
    open(path, "wb").write(bytes(data))
    loads.clear()
    third = compiled_call(call, flat, ("fp", "fwd"), d)
    np.testing.assert_array_equal(np.asarray(third(*flat)[0][0]), np.asarray(want[0][0]))
    assert loads == [] and open(path, "rb").read() != bytes(data)  # not loaded; recompiled and rewritten
    open(path, "wb").write(b"garbage")
    np.testing.assert_array_equal(
        np.asarray(compiled_call(call, flat, ("fp", "fwd"), d)(*flat)[0][0]), np.asarray(want[0][0])
    )
    assert loads == []
    compiled_call(call, flat, ("fp", "fwd"), d)
    assert loads == [1]  # the rewritten entry is good again
    loads.clear()
    os.chmod(path, 0o666)  # writable by others: never loaded
    np.testing.assert_array_equal(
        np.asarray(compiled_call(call, flat, ("fp", "fwd"), d)(*flat)[0][0]), np.asarray(want[0][0])
    )
    assert loads == []
    # Other shapes are another entry.
    compiled_call(call, [*flat[:-1], np.ones((3, 8), np.float32)], ("fp", "fwd"), d)
    assert len([n for n in os.listdir(d) if n.endswith(".exe")]) == 2


def test_cli_runs_the_same_with_a_warm_and_a_corrupt_executable_cache(tmp_path):
    (tmp_path / "m.py").write_text(MODEL)
    env = {**os.environ, "VJPSPLIT_CACHE_DIR": str(tmp_path / "cache")}
    cli = [sys.executable, "-m", "vjpsplit_cli"]

    def run(*args):
        r = subprocess.run(cli + list(args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r

    run(
        "export", "m.py:loss", "--shapes", "w=f32[8,16]", "--shapes", "x=f32[b,8]", "--platforms", "cpu", "-o", "a.vjps"
    )
    rng = np.random.default_rng(1)
    np.savez(
        tmp_path / "in.npz", w=rng.normal(size=(8, 16)).astype(np.float32), x=rng.normal(size=(5, 8)).astype(np.float32)
    )
    grads = []
    inodes = []  # an entry is rewritten (a new inode) only when it was not loaded
    for round_ in range(3):
        run("run-fwd", "a.vjps", "--inputs", "in.npz", "--residuals", "r.npz", "--outputs", "o.npz")
        run("run-bwd", "a.vjps", "--inputs", "in.npz", "--residuals", "r.npz", "--grads", "g.npz")
        with np.load(tmp_path / "g.npz") as z:
            grads.append({k: z[k] for k in z.files})
        exe = tmp_path / "cache" / "executables"
        entries = sorted(exe.glob("*.exe"))
        assert len(entries) == 2  # forward and backward
        assert all(e.stat().st_size > 100 for e in entries)
        inodes.append([e.stat().st_ino for e in entries])
        if round_ == 1:
            assert inodes[1] == inodes[0]  # the warm run loaded both entries
            for e in entries:
                e.write_bytes(e.read_bytes()[:100])  # truncated: ignored, recompiled
    assert inodes[2] != inodes[1]  # the truncated entries were not loaded: compiled and written anew
    for g in grads[1:]:
        for k in g:
            np.testing.assert_array_equal(g[k], grads[0][k])


# ------------------------------------------------------------------ residuals checked once


def test_changed_residuals_are_checked_again():
    params, x = make()
    art = vs.export(loss, *specs_of(params, x), platforms="cpu")
    out, res = art.fwd(params, x)
    want = art.bwd(res)
    key = next(k for k, v in res.stored.items() if v.dtype == np.float32 and v.ndim == 2)
    changed = res.replace(stored={**res.stored, key: np.asarray(res.stored[key]).astype(np.float64)})
    assert changed.residuals_id == res.residuals_id  # the same forward run, other arrays: checked again
    with pytest.raises(VjpsplitError, match="expected"):
        art.bwd(changed)
    back = changed.replace(stored={**changed.stored, key: changed.stored[key].astype(np.float32)})
    assert_grads_equal(art.bwd(back), want)  # numpy now: checked, accepted
