"""export_stages: one function cut at stage_boundary marks (or by cost) into stage artifacts, run by every runner."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import assert_trees_close
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs, mean_over_microbatches, mlp, mlp_params, specs_like

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.pipeline.runtime.model import PreSplit


@pytest.fixture(scope="module")
def gpt_stages():
    params = gpt_params()
    return vs.export_stages(gpt, *gpt_specs(params), wrt="params", platforms="cpu"), params


def test_stage_boundary_changes_nothing_outside_export_stages():
    params, batch = gpt_params(), gpt_batch(4)

    def plain(params, tokens, mask, labels):  # gpt without the marks
        emb = jnp.take(params["embed"], tokens, axis=0)
        h = jnp.tanh(emb @ params["blocks"][0]["w"]) * mask[..., None]
        aux = jnp.mean(h**2)
        h = jnp.tanh(h @ params["blocks"][1]["w"]) + emb
        lp = jax.nn.log_softmax(h @ params["embed"].T)
        return -jnp.mean(jnp.take_along_axis(lp, labels[..., None], -1)) + 0.1 * aux

    want, want_g = jax.value_and_grad(plain)(params, *batch)
    got, got_g = jax.jit(jax.value_and_grad(gpt))(params, *batch)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert_trees_close(got_g, want_g, rtol=1e-6, atol=1e-7)
    stacked = tuple(np.stack([x, x]) for x in batch)
    np.testing.assert_allclose(jax.vmap(gpt, (None, 0, 0, 0))(params, *stacked), [want, want], rtol=1e-6)
    fwd, bwd = vs.split(gpt, wrt="params")
    out, res = fwd(params, *batch)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert_trees_close(bwd(res), want_g, rtol=1e-5, atol=1e-6)
    art = vs.export(gpt, *specs_like((params, *batch)), wrt="params", platforms="cpu")
    out, res = art.fwd(params, *batch)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert_trees_close(art.bwd(res), want_g, rtol=1e-5, atol=1e-6)
    assert vs.stage_boundary({"a": 1.0, "b": ()}) == {"a": 1.0, "b": ()}


def test_stages_read_exactly_what_they_use(gpt_stages):
    stages, _ = gpt_stages
    keys = stages.index.param_keys
    held = [[keys[i] for i in st.params] for st in stages.index.per_stage]
    assert held == [["params/embed"], ["params/blocks/0/w"], ["params/blocks/1/w"], ["params/embed"]]
    batch = [[stages.index.batch[i].key for i in st.batch] for st in stages.index.per_stage]
    assert batch == [["tokens"], ["mask"], [], ["labels"]]
    # stage 0 sends h (the embedding) and aux; stage 1 carries the embedding on to stage 2 (the skip),
    # once: the marked value and the unmarked one read later are one value
    assert [len(st.receives) for st in stages.index.per_stage] == [0, 2, 3, 2]
    assert [list(r.shape[:1]) for r in stages.index.per_stage[1].receives] == [
        [],
        ["b"],
    ]  # aux, and h with a symbolic batch
    for i, a in enumerate(stages):
        assert a.manifest.wrt == (("params",) if i == 0 else ("params", "x")) and a.manifest.weights == ("params",)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbh1", "zbv"])
def test_gpt_gradients_equal_value_and_grad(gpt_stages, schedule):
    stages, params = gpt_stages
    batch = gpt_batch(8)
    loss, grads = jax.value_and_grad(mean_over_microbatches, argnums=1)(gpt, params, batch, 4)
    r = P.run(stages, params, batch, microbatches=4, schedule=schedule)
    assert r.num_workers == (2 if schedule == "zbv" else 4)
    np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
    assert jax.tree_util.tree_structure(r.grads) == jax.tree_util.tree_structure(params)
    assert_trees_close(r.grads, grads, rtol=1e-4, atol=1e-6)


def test_symbolic_batch_runs_two_microbatch_sizes(gpt_stages):
    stages, params = gpt_stages
    for n, m in [(8, 4), (6, 2)]:  # microbatches of 2 and of 3
        batch = gpt_batch(n, seed=n)
        loss, grads = jax.value_and_grad(gpt)(params, *batch)
        r = P.run_inprocess(stages, params, batch, microbatches=m, schedule="1f1b")
        np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
        assert_trees_close(r.grads, grads, rtol=1e-4, atol=1e-6)


def test_save_load_round_trip_signed(gpt_stages, tmp_path):
    stages, params = gpt_stages
    key = tmp_path / "key"
    vs_keygen = __import__("vjpsplit_cli.trust.signing", fromlist=["generate_key"]).generate_key
    vs_keygen(key)
    stages.save(tmp_path / "gpt.stages", sign_key=key)
    assert sorted(p.name for p in (tmp_path / "gpt.stages").iterdir()) == [
        *[f"stage{k}.{e}" for k in range(4) for e in ("eval", "vjp")],  # each stage's evaluation program too
        "stages.json",
    ]
    back = vs.load_stages(tmp_path / "gpt.stages", trust=str(key) + ".pub")
    assert isinstance(back, vs.Stages) and len(back) == 4 and back.index.per_stage == stages.index.per_stage
    assert [p.sha256 for p in back.evaluation] == [p.sha256 for p in stages.evaluation]
    batch = gpt_batch(4)
    loss, grads = jax.value_and_grad(gpt)(params, *batch)
    r = P.run(back, params, batch, microbatches=2, schedule="zbh1")
    np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
    assert_trees_close(r.grads, grads, rtol=1e-4, atol=1e-6)
    index = tmp_path / "gpt.stages" / "stages.json"
    index.write_text(index.read_text().replace('"labels"', '"labelz"'))
    with pytest.raises(vs.VjpsplitError, match="signature does not verify"):
        vs.load_stages(tmp_path / "gpt.stages", trust=str(key) + ".pub")


def test_list_of_artifacts_form_still_works(gpt_stages):
    stages, params = gpt_stages
    batch = gpt_batch(4)
    per_stage = stages.stage_params(params)
    r1 = P.run(stages, params, batch, microbatches=2)
    r2 = P.run_inprocess(list(stages), per_stage, PreSplit(stages.stage_batch(batch, 2)), microbatches=2)
    np.testing.assert_allclose(r1.loss, r2.loss)
    assert len(r2.grads) == 4


def test_refusals(gpt_stages):
    stages, params = gpt_stages
    specs = gpt_specs(params)

    def in_scan(params, x):
        def body(c, _):
            return vs.stage_boundary(c @ params), None

        return jnp.mean(jax.lax.scan(body, x, None, length=2)[0])

    w, x = jax.ShapeDtypeStruct((3, 3), jnp.float32), jax.ShapeDtypeStruct((2, 3), jnp.float32)
    with pytest.raises(vs.VjpsplitError, match="stage_boundary inside a scan body"):
        vs.export_stages(in_scan, w, x, platforms="cpu")

    def in_cond(params, x):
        return jnp.mean(jax.lax.cond(True, lambda a: vs.stage_boundary(a @ params), lambda a: a @ params, x))

    with pytest.raises(vs.VjpsplitError, match="inside a cond body"):
        vs.export_stages(in_cond, w, x, platforms="cpu")

    @jax.custom_vjp
    def cv(a):
        return vs.stage_boundary(a * 2)

    cv.defvjp(lambda a: (cv(a), None), lambda _, g: (2 * g,))
    with pytest.raises(vs.VjpsplitError, match="inside a custom_vjp_call body"):
        vs.export_stages(lambda p, a: jnp.mean(cv(a @ p)), w, x, platforms="cpu")
    with pytest.raises(vs.VjpsplitError, match="one float scalar loss"):
        vs.export_stages(lambda p, a: vs.stage_boundary(a @ p) * 2, w, x, platforms="cpu")
    with pytest.raises(vs.VjpsplitError, match="4 specs given .* takes 2"):
        vs.export_stages(lambda p, a: jnp.mean(a @ p), w, x, x, x, platforms="cpu")
    with pytest.raises(vs.VjpsplitError, match="stage 1 computes nothing"):
        vs.export_stages(lambda p, a: jnp.mean(vs.stage_boundary(vs.stage_boundary(a @ p)) @ p), w, x, platforms="cpu")
    marked_in_jit = jax.jit(lambda p, a: vs.stage_boundary(jnp.tanh(a @ p)))  # a user's jit is inlined
    assert len(vs.export_stages(lambda p, a: jnp.mean(marked_in_jit(p, a) @ p), w, x, platforms="cpu")) == 2
    with pytest.raises(vs.VjpsplitError, match="no stage_boundary marks"):
        vs.export_stages(lambda p, a: jnp.mean(a @ p), w, x, platforms="cpu")
    bad = dict(params, embed=np.zeros((3, 3), np.float32))
    with pytest.raises(vs.VjpsplitError, match="params leaf 'params/embed' is float32\\[3, 3\\]"):
        P.run(stages, bad, gpt_batch(4), microbatches=2)
    with pytest.raises(vs.VjpsplitError, match="missing 'params/embed'"):
        P.run(stages, {"blocks": params["blocks"]}, gpt_batch(4), microbatches=2)
    with pytest.raises(vs.VjpsplitError, match="tuple of 3 inputs"):
        P.run(stages, params, list(gpt_batch(4)), microbatches=2)
    assert specs  # the GPT's own specs export (the fixture)


def test_balanced_cut_of_the_mlp_is_after_layers_2_4_6():
    params = mlp_params()
    x, labels = np.ones((8, 16), np.float32), np.arange(8, dtype=np.int32) % 4
    stages = vs.export_stages(mlp, *specs_like((params, x[:2], labels[:2])), wrt="params", stages=4, platforms="cpu")
    keys = stages.index.param_keys
    layers = [sorted({int(keys[i].split("/")[1]) for i in st.params}) for st in stages.index.per_stage]
    assert layers == [[0, 1], [2, 3], [4, 5], [6, 7]] and stages.index.cut == "balanced"
    loss, grads = jax.value_and_grad(mlp)(params, x, labels)
    r = P.run(stages, params, (x, labels), microbatches=4, schedule="zbh1")
    np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
    assert_trees_close(r.grads, grads, rtol=1e-4, atol=1e-6)


def test_flax_linen_model_cut_between_its_layers():
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(8)(x))
            x = vs.stage_boundary(x)
            x = nn.relu(nn.Dense(8)(x))
            x = vs.stage_boundary(x)
            return nn.Dense(3)(x)

    net = Net()
    x = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)
    y = np.arange(8, dtype=np.int32) % 3
    variables = net.init(jax.random.PRNGKey(0), x)

    def loss(variables, x, y):
        lp = jax.nn.log_softmax(net.apply(variables, x))
        return -jnp.mean(jnp.take_along_axis(lp, y[:, None], 1))

    stages = vs.export_stages(loss, *specs_like((variables, x[:2], y[:2])), wrt="variables", platforms="cpu")
    assert len(stages) == 3
    want, want_g = jax.value_and_grad(loss)(variables, x, y)
    r = P.run(stages, variables, (x, y), microbatches=4, schedule="1f1b")
    np.testing.assert_allclose(r.loss, want, rtol=1e-5)
    assert_trees_close(r.grads, want_g, rtol=1e-4, atol=1e-6)


CLI_MODEL = """
import jax, jax.numpy as jnp
import vjpsplit_cli as vs

def loss(params, x, labels):
    h = vs.stage_boundary(jnp.tanh(x @ params["w0"]))
    logits = h @ params["w1"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

def shapes():
    s = jax.ShapeDtypeStruct
    return {"w0": s((6, 8), jnp.float32), "w1": s((8, 3), jnp.float32)}
"""


def test_cli_export_stages_and_inspect_dir(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from vjpsplit_cli.cli import main

    (tmp_path / "cmodel.py").write_text(CLI_MODEL)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    args = ["export", "cmodel.py:loss", "--shapes", "params=@cmodel.py:shapes", "--shapes", "x=f32[b,6]"]
    args += ["--shapes", "labels=i32[b]", "--wrt", "params", "--platforms", "cpu", "--stages", "-o", "m.stages"]
    r = runner.invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "2 stages (marks)" in r.output
    r = runner.invoke(main, ["inspect", "m.stages", "--at", "b=4"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[2].split()[:2] == ["0", "48"] and "x" in lines[2] and "128 B" in lines[2]  # 4x8 f32 sent on
    assert lines[3].split()[:2] == ["1", "24"] and "labels" in lines[3] and "loss" in lines[3]
    assert lines[-1].startswith("imbalance (largest stage cost / mean): ")
    r = runner.invoke(main, ["inspect", "m.stages", "--json"])
    rows = __import__("json").loads(r.output)["stages"]
    assert [row["batch"] for row in rows] == [["x"], ["labels"]] and rows[0]["params"] == ["params/w0"]
    stages = vs.load_stages(tmp_path / "m.stages")
    rng = np.random.default_rng(0)
    params = {"w0": rng.normal(size=(6, 8)).astype(np.float32), "w1": rng.normal(size=(8, 3)).astype(np.float32)}
    x, labels = rng.normal(size=(4, 6)).astype(np.float32), np.array([0, 1, 2, 0], np.int32)
    monkeypatch.syspath_prepend(str(tmp_path))
    cmodel = __import__("cmodel")  # the same function, for the reference
    loss, grads = jax.value_and_grad(cmodel.loss)(params, x, labels)
    res = P.run(stages, params, (x, labels), microbatches=2, schedule="zbh1")
    np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
    assert_trees_close(res.grads, grads, rtol=1e-4, atol=1e-6)


def test_cli_export_stages_records_data_parallel_for_the_trainer(tmp_path, monkeypatch):
    import json

    import optax
    from click.testing import CliRunner

    from vjpsplit_cli.cli import main

    (tmp_path / "cmodel.py").write_text(CLI_MODEL)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    args = ["export", "cmodel.py:loss", "--shapes", "params=@cmodel.py:shapes", "--shapes", "x=f32[b,6]"]
    args += ["--shapes", "labels=i32[b]", "--wrt", "params", "--platforms", "cpu"]
    r = runner.invoke(main, [*args, "-o", "m.vjp", "--data-parallel", "2"])
    assert r.exit_code == 2 and "--data-parallel records replicas of pipeline stages: give it with --stages" in r.output
    assert not (tmp_path / "m.vjp").exists()
    r = runner.invoke(main, [*args, "--stages", "-o", "m.stages", "--data-parallel", "0"])
    assert r.exit_code == 2 and "--data-parallel" in r.output and not (tmp_path / "m.stages").exists()
    r = runner.invoke(main, [*args, "--stages", "-o", "m.stages", "--data-parallel", "2"])
    assert r.exit_code == 0, r.output
    assert "2 stages (marks), platforms cpu, data_parallel 2" in r.output
    index = json.loads((tmp_path / "m.stages" / "stages.json").read_text())
    assert index["version"] == 3 and index["data_parallel"] == 2
    r = runner.invoke(main, ["inspect", "m.stages", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["data_parallel"] == 2, r.output
    stages = vs.load_stages(tmp_path / "m.stages")
    assert stages.index.data_parallel == 2
    rng = np.random.default_rng(0)
    params = {"w0": rng.normal(size=(6, 8)).astype(np.float32), "w1": rng.normal(size=(8, 3)).astype(np.float32)}
    # The Trainer takes the recorded N when none is given (this process has 1 device: the refusal shows it) ...
    with pytest.raises(vs.VjpsplitError, match=r"data_parallel=2 with 2 workers needs 4 devices, this host has 1"):
        P.Trainer(stages, params, optimizer=optax.sgd(0.1), microbatches=2)
    # ... and one given wins.
    with P.Trainer(stages, params, optimizer=optax.sgd(0.1), microbatches=2, runner=P.InProcess(data_parallel=1)) as tr:
        assert tr.data_parallel == 1
        tr.step((rng.normal(size=(4, 6)).astype(np.float32), np.array([0, 1, 2, 0], np.int32)))
    # Without --data-parallel the index stays as it was (version 1 or 2, no data_parallel): signed bytes unchanged.
    r = runner.invoke(main, [*args, "--stages", "-o", "plain.stages"])
    plain = json.loads((tmp_path / "plain.stages" / "stages.json").read_text())
    assert r.exit_code == 0 and "data_parallel" not in plain and plain["version"] in (1, 2)
    bad = dict(index, data_parallel="2")
    (tmp_path / "m.stages" / "stages.json").write_text(json.dumps(bad))
    with pytest.raises(vs.VjpsplitError, match=r"data_parallel is '2', not an int >= 1"):
        vs.load_stages(tmp_path / "m.stages")


CLI_AUX_MODEL = CLI_MODEL.replace(
    "    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))",
    "    nll = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))\n"
    "    return nll, {'accuracy': jnp.mean(jnp.argmax(logits, -1) == labels)}",
)


def test_cli_export_stages_with_has_aux_gives_the_trainer_the_last_stages_aux(tmp_path, monkeypatch):
    import optax
    from click.testing import CliRunner

    from vjpsplit_cli.cli import main

    assert CLI_AUX_MODEL != CLI_MODEL
    (tmp_path / "amodel.py").write_text(CLI_AUX_MODEL)  # not cmodel: imported above
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    args = ["export", "amodel.py:loss", "--shapes", "params=@amodel.py:shapes", "--shapes", "x=f32[b,6]"]
    args += ["--shapes", "labels=i32[b]", "--wrt", "params", "--platforms", "cpu", "--stages"]
    r = runner.invoke(main, [*args, "-o", "plain.stages"])  # a pair without --has-aux: one error, nothing written
    assert r.exit_code == 1 and "pass has_aux" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "plain.stages").exists()
    r = runner.invoke(main, [*args, "--has-aux", "-o", "m.stages"])
    assert r.exit_code == 0, r.output
    assert "2 stages (marks), platforms cpu, the last stage returns aux" in r.output
    r = runner.invoke(main, ["inspect", "m.stages", "--at", "b=4"])
    assert r.exit_code == 0, r.output
    stages = vs.load_stages(tmp_path / "m.stages")
    assert [a.manifest.has_aux for a in stages.artifacts] == [False, True]
    rng = np.random.default_rng(0)
    params = {"w0": rng.normal(size=(6, 8)).astype(np.float32), "w1": rng.normal(size=(8, 3)).astype(np.float32)}
    x, labels = rng.normal(size=(8, 6)).astype(np.float32), rng.integers(0, 3, 8).astype(np.int32)
    with P.Trainer(stages, params, optimizer=optax.sgd(0.1), microbatches=2, aux="per_microbatch") as tr:
        loss, aux = tr.step((x, labels))
    monkeypatch.syspath_prepend(str(tmp_path))
    amodel = __import__("amodel")  # the same function, for the reference
    parts = [amodel.loss(params, x[i * 4 : (i + 1) * 4], labels[i * 4 : (i + 1) * 4]) for i in range(2)]
    np.testing.assert_allclose(loss, np.mean([p[0] for p in parts]), rtol=1e-6)
    np.testing.assert_allclose([a["accuracy"] for a in aux], [p[1]["accuracy"] for p in parts], rtol=1e-6)


def test_balanced_cut_of_the_sample_gpt_is_within_1_25_of_the_mean(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "samples" / "pipeline"))
    sample = __import__("gpt")
    monkeypatch.setattr(vs, "stage_boundary", lambda x: x)  # the sample's GPT without its marks
    params = sample.init()
    n = sample.SEQ
    specs = [jax.ShapeDtypeStruct((2, n), d) for d in (jnp.int32, jnp.float32, jnp.int32)]
    stages = vs.export_stages(sample.loss, specs_like(params), *specs, wrt="params", stages=4, platforms="cpu")
    costs = [st.cost for st in stages.index.per_stage]
    assert stages.index.cut == "balanced" and max(costs) <= 1.25 * np.mean(costs), costs
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, sample.VOCAB, (4, n)).astype(np.int32)
    batch = (tokens, np.ones((4, n), np.float32), np.roll(tokens, -1, 1))
    loss, grads = jax.value_and_grad(sample.loss)(params, *batch)
    r = P.run(stages, params, batch, microbatches=2, schedule="1f1b")
    np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
    assert_trees_close(r.grads, grads, rtol=1e-4, atol=1e-6)


def test_params_mismatch_names_the_leaves_each_side_lacks(gpt_stages):
    """Dropping a layer names only its leaves (not a present one); flax's {"params": p} wrapper is said as such."""
    stages, params = gpt_stages
    batch = gpt_batch(4)
    dropped = {"embed": params["embed"], "blocks": params["blocks"][:1]}
    with pytest.raises(vs.VjpsplitError) as e:
        P.run(stages, dropped, batch, microbatches=2)
    msg = str(e.value)
    assert "missing 'params/blocks/1/w'" in msg and "unexpected" not in msg, msg
    extra = dict(params, head=np.zeros(3, np.float32))
    with pytest.raises(vs.VjpsplitError, match="unexpected 'params/head'") as e:
        P.run(stages, extra, batch, microbatches=2)
    assert "missing" not in str(e.value)
    with pytest.raises(vs.VjpsplitError, match=r"every leaf given is under 'params'.*pass variables\['params'\]"):
        P.run(stages, {"params": params}, batch, microbatches=2)
    with pytest.raises(vs.VjpsplitError, match=r"missing 'params/blocks/1/w'; unexpected 'params/blocks/2/w'"):
        P.run(stages, dict(params, blocks=[params["blocks"][0], {}, params["blocks"][1]]), batch, microbatches=2)
    from vjpsplit_cli.pipeline.stages.directory import _leaves_differ

    exported_wrapped = ["variables/params/Dense_0/bias", "variables/params/Dense_0/kernel"]
    given = ["variables/Dense_0/bias", "variables/Dense_0/kernel"]
    assert "pass {'params': params}" in _leaves_differ(given, exported_wrapped)


def test_more_stages_than_devices_warns_with_the_cpu_recipe(gpt_stages):
    """4 stages on this process's one CPU device run, but the user is told, with the XLA_FLAGS recipe."""
    SharedDevicesWarning = P.SharedDevicesWarning

    stages, params = gpt_stages
    assert jax.local_device_count() == 1
    recipe = "4 workers need 4 devices but this host has 1 cpu device.*xla_force_host_platform_device_count=4"
    with pytest.warns(SharedDevicesWarning, match=recipe):
        P.run(stages, params, gpt_batch(4), microbatches=2)
    with pytest.warns(SharedDevicesWarning, match=recipe):
        P.Trainer(stages, params, optimizer=pytest.importorskip("optax").sgd(0.1), microbatches=2)
