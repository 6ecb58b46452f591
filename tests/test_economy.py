"""Policies, memory budgets and residual accounting (issue: residual economy)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from clihelp import opts
from jax import export as jexport
from models import MODELS, assert_trees_close, ref_vjp

import vjpsplit_cli as vs
from vjpsplit_cli.cli import main
from vjpsplit_cli.files.sizes import parse_at, parse_bytes
from vjpsplit_cli.tracing.choice import choose_policy
from vjpsplit_cli.tracing.policies import plan_policies, policy_cost

POLICIES = ["everything", "dots", "nothing", "names:hidden"]


def structs(tree):
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), tree)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["mlp", "convnet", "attention"])
def test_every_policy_gives_the_same_gradients(name, policy):
    fn, make = MODELS[name]
    args = make()
    ref_out, ref_grads = ref_vjp(fn, args)
    ct = jax.tree_util.tree_map(np.ones_like, ref_out)
    fwd, bwd = vs.split(fn, policy=policy)
    _, res = fwd(*args)
    assert_trees_close(bwd(res, ct), ref_grads)
    art = vs.export(fn, *map(structs, args), policy=policy, platforms="cpu")
    assert art.manifest.policy == policy
    _, res = art.fwd(*args)
    assert_trees_close(art.bwd(res, ct), ref_grads)


def big_mlp(params, x):
    h = x
    for i, (w, b) in enumerate(params):
        h = h @ w + b
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    return jnp.mean(jax.nn.logsumexp(h, axis=-1))


def big_mlp_specs(batch=256, sizes=(784, 1024, 1024, 10)):
    s = jax.ShapeDtypeStruct
    params = [(s((a, b), jnp.float32), s((b,), jnp.float32)) for a, b in zip(sizes[:-1], sizes[1:])]
    return params, s((batch, sizes[0]), jnp.float32)


def test_stored_bytes_strictly_ordered_on_the_mlp():
    costs = {c.policy: c for c in plan_policies(big_mlp, *big_mlp_specs(), flops=False)}
    assert costs["nothing"].stored_bytes < costs["dots"].stored_bytes < costs["everything"].stored_bytes
    assert costs["nothing"].stored_arrays == 0 and costs["nothing"].stored_bytes == 0
    # What is not stored is recomputed: the backward grows as the forward keeps less.
    assert costs["everything"].backward_ops < costs["dots"].backward_ops <= costs["nothing"].backward_ops


def test_default_residual_file_is_at_most_055x_raw_vjp_leaves(tmp_path):
    params_s, x_s = big_mlp_specs()
    rng = np.random.default_rng(0)
    params = [(rng.normal(size=w.shape).astype(np.float32) * 0.03, np.zeros(b.shape, np.float32)) for w, b in params_s]
    x = rng.normal(size=x_s.shape).astype(np.float32)
    raw = sum(np.asarray(leaf).nbytes for leaf in jax.tree_util.tree_leaves(jax.vjp(big_mlp, params, x)[1]))
    art = vs.export(big_mlp, params_s, x_s, platforms="cpu")
    _, res = art.fwd(params, x)
    for ext in ("npz", "msgpack"):
        vs.save_residuals(tmp_path / f"r.{ext}", res)
        size = (tmp_path / f"r.{ext}").stat().st_size
        assert size <= 0.55 * raw, (size, raw, size / raw)
    arrays, _ = vs.load_arrays(tmp_path / "r.npz")
    assert sum(a.nbytes for a in arrays.values()) == res.stored_nbytes


def test_memory_budget_picks_least_recompute_that_fits():
    costs = {c.policy: c.stored_bytes for c in plan_policies(big_mlp, *big_mlp_specs(batch=32), flops=False)}
    specs = big_mlp_specs(batch=32)
    assert choose_policy(big_mlp, *specs, memory_budget=costs["everything"])[0] == "everything"
    assert choose_policy(big_mlp, *specs, memory_budget=costs["everything"] - 1)[0] == "dots"
    assert choose_policy(big_mlp, *specs, memory_budget=costs["dots"] - 1)[0] == "nothing"
    with pytest.raises(vs.VjpsplitError, match=r"no policy fits .* the smallest is 'dots'"):
        choose_policy(big_mlp, *specs, memory_budget=1024, policies=("everything", "dots"))


def test_memory_budget_with_symbolic_dims_needs_sizes():
    (b,) = jexport.symbolic_shape("b")
    params, _ = big_mlp_specs()
    x = jax.ShapeDtypeStruct((b, 784), jnp.float32)
    with pytest.raises(vs.VjpsplitError, match="--at"):
        vs.export(big_mlp, params, x, memory_budget="2.2MiB", platforms="cpu")
    art = vs.export(big_mlp, params, x, memory_budget="2.2MiB", at={"b": 256}, platforms="cpu")
    assert art.manifest.policy == "dots"  # at b=256 everything stores 2.5 MiB, dots 2.0 MiB


def test_split_with_memory_budget_matches_gradients():
    params_s, x_s = big_mlp_specs(batch=8, sizes=(16, 32, 4))
    rng = np.random.default_rng(1)
    params = [(rng.normal(size=w.shape).astype(np.float32), np.zeros(b.shape, np.float32)) for w, b in params_s]
    x = rng.normal(size=x_s.shape).astype(np.float32)
    fwd, bwd = vs.split(big_mlp, memory_budget=0)
    _, res = fwd(params, x)
    assert res.stored == {}  # only "nothing" stores 0 bytes
    assert_trees_close(bwd(res), jax.grad(big_mlp, argnums=(0, 1))(params, x), rtol=1e-4)


def test_policy_and_budget_are_exclusive():
    with pytest.raises(vs.VjpsplitError, match="not both"):
        vs.split(big_mlp, policy="dots", memory_budget="1MiB")


@pytest.mark.parametrize(
    "text,value",
    [
        ("1048576", 2**20),
        ("64MiB", 64 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("2 KiB", 2048),
        ("10kb", 10_000),
        (4096, 4096),
    ],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["lots", "64 parsecs", "-1", ""])
def test_parse_bytes_rejects(text):
    with pytest.raises(vs.VjpsplitError, match="not a size"):
        parse_bytes(text)


def test_parse_at():
    assert parse_at(["b=256", "t=8,h=2"]) == {"b": 256, "t": 8, "h": 2}
    for bad in (["b"], ["b=x"], ["b=0"]):
        with pytest.raises(vs.VjpsplitError):
            parse_at(bad)


def test_policy_cost_symbolic_formula():
    (b,) = jexport.symbolic_shape("b")
    params, _ = big_mlp_specs(sizes=(8, 16, 4))
    cost = policy_cost(big_mlp, params, jax.ShapeDtypeStruct((b, 8), jnp.float32))
    assert cost.stored_bytes is None and cost.backward_flops is None
    at = policy_cost(big_mlp, params, jax.ShapeDtypeStruct((b, 8), jnp.float32), at={"b": 10})
    from vjpsplit_cli.files.sizes import evaluate_terms

    # With b symbolic, scalars like 1/b are residuals; with b known they fold into constants.
    assert 0 <= evaluate_terms(cost.stored_terms, {"b": 10}) - at.stored_bytes <= 8
    assert at.backward_flops and at.backward_flops > 0


MODULE = """
import jax, jax.numpy as jnp
def loss(w1, w2, x):
    return jnp.mean(jnp.tanh(jnp.tanh(x @ w1) @ w2) ** 2)
"""


@pytest.fixture()
def module_dir(tmp_path, monkeypatch):
    (tmp_path / "econ_model.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


SHAPES = ["--shapes", "w1=f32[16,32]", "--shapes", "w2=f32[32,8]", "--shapes", "x=f32[b,16]"]


def test_cli_plan_table_and_json(module_dir):
    r = CliRunner().invoke(main, ["plan", "econ_model:loss", *SHAPES, "--at", "b=64", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [row["policy"] for row in rows] == ["everything", "dots", "nothing"]
    assert rows[0]["stored_bytes"] > rows[1]["stored_bytes"] > rows[2]["stored_bytes"] == 0
    assert all(row["backward_flops"] > 0 for row in rows)
    r = CliRunner().invoke(main, ["plan", "econ_model:loss", *SHAPES])
    assert r.exit_code == 0 and "·b" in r.stdout and "pass --at" in r.stdout


def test_cli_export_with_budget_and_inspect_at(module_dir):
    rows = json.loads(CliRunner().invoke(main, ["plan", "econ_model:loss", *SHAPES, "--at", "b=64", "--json"]).stdout)
    budget = rows[1]["stored_bytes"]  # exactly what dots stores
    r = CliRunner().invoke(
        main,
        [
            "export",
            "econ_model:loss",
            *SHAPES,
            *opts(memory_budget=budget, at="b=64", platforms="cpu"),
            "-o",
            "a.vjps",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "chose policy dots" in r.stderr
    r = CliRunner().invoke(main, ["inspect", "a.vjps", "--json", "--at", "b=64"])
    d = json.loads(r.stdout)
    assert d["policy"] == "dots" and d["stored_residual_bytes_at"] == budget
    r = CliRunner().invoke(main, ["inspect", "a.vjps", "--at", "b=64"])
    assert "at b=64" in r.stdout
    r = CliRunner().invoke(
        main, ["export", "econ_model:loss", *SHAPES, "--memory-budget", "1MiB", "--policy", "dots", "-o", "b.vjps"]
    )
    assert r.exit_code == 2 and "not both" in r.stderr
