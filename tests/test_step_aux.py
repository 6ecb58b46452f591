"""Metrics from the last stage (``export_stages(..., has_aux=True)``): a step's aux equals the one-process loop's.

The function returns ``(loss, aux)``; the last stage returns the aux (leaves made on an earlier stage are carried
to it). ``step``, ``fit``'s history and ``evaluate`` give the step's aux, the mean over microbatches by default
(``aux="per_microbatch"``: each microbatch's), equal to ``jax.value_and_grad(has_aux=True)`` over the same
microbatches in one process (``stage_models.one_process_with_aux``).
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fetches import step_noting_fetches
from models import assert_trees_close
from stage_models import aux_loss, aux_mean, dropout_batches, dropout_params, dropout_specs, one_process_with_aux

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError

pytestmark = pytest.mark.filterwarnings("ignore::vjpsplit_cli.pipeline.SharedDevicesWarning")

M = 4  # microbatches


def _specs():
    p, _key, x, y = dropout_specs(dropout_params())
    return p, x, y


@pytest.fixture(scope="module")
def stages():
    return vs.export_stages(aux_loss, *_specs(), wrt="params", platforms="cpu", has_aux=True)


def _trainer(stages, **kw):
    return P.Trainer(stages, dropout_params(), **{"optimizer": optax.adam(1e-2), "microbatches": M, **kw})


def _close(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-6)


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_step_and_history_give_the_mean_aux_of_the_one_process_loop(stages, schedule):
    batches = dropout_batches(3)
    with _trainer(stages, schedule=schedule) as tr:
        got = [tr.step(batches[0], timed=True), *[tr.step(b) for b in batches[1:]]]
        per_microbatch = tr.last_result.aux
        params = tr.params()
        history = [row.aux for row in tr.history]
    losses, auxes, want_params = one_process_with_aux(aux_loss, dropout_params(), batches, M, optax.adam(1e-2))
    np.testing.assert_allclose([loss for loss, _ in got], losses, rtol=1e-6)
    for (_, aux), row, want in zip(got, history, auxes):
        _close(aux, aux_mean(want))
        _close(row, aux_mean(want))
    _close(per_microbatch, auxes[-1])
    assert auxes[0][0]["rows"] == 4 and len({float(a["accuracy"]) for a in auxes[0]}) > 1  # the mean is no copy
    assert_trees_close(params, want_params, rtol=1e-6, atol=1e-7)


def test_per_microbatch_aux_in_fit_history_and_its_evaluations(stages):
    batches = dropout_batches(3)
    with _trainer(stages, aux="per_microbatch") as tr:
        losses = tr.fit(batches, 3, eval_data=batches[0], eval_every=2)
        rows = list(tr.history)
        params = tr.params()
        evaluated = tr.evaluate(batches[0])
    want_losses, auxes, _ = one_process_with_aux(aux_loss, dropout_params(), batches, M, optax.adam(1e-2))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)  # fit gives the losses; the aux is in the rows
    for row, want in zip(rows, auxes):
        _close(row.aux, want)
    assert rows[0].eval_aux is None and rows[2].eval_aux is not None
    _, at_end, _ = one_process_with_aux(aux_loss, params, batches[:1], M, optax.sgd(0.0))
    _close(rows[2].eval_aux, at_end[0])  # evaluated after the last step, with its parameters
    _close(evaluated[1], at_end[0])


def test_evaluate_gives_the_aux_of_the_next_step_and_changes_nothing(stages):
    batches = dropout_batches(2)
    with _trainer(stages) as tr:
        tr.step(batches[0])
        before = tr.params()
        loss, aux = tr.evaluate(batches[1])
        loss_o, aux_o, outputs = tr.evaluate(batches[1], outputs=True)
        assert tr.step_count == 1 and len(tr.history) == 1
        assert_trees_close(tr.params(), before, rtol=0, atol=0)
        stepped, stepped_aux = tr.step(batches[1])
    np.testing.assert_allclose(loss, stepped, rtol=1e-6)
    _close(aux, stepped_aux)
    assert loss_o == loss and len(outputs) == M
    _close(aux_o, aux)


def test_a_saved_and_loaded_directory_gives_the_same_aux(stages, tmp_path):
    batches = dropout_batches(2)
    with _trainer(stages) as tr:
        want = [tr.step(b) for b in batches]
        evaluated = tr.evaluate(batches[0])
    stages.save(tmp_path / "st")
    loaded = vs.load_stages(tmp_path / "st")
    assert loaded.artifacts[-1].manifest.has_aux and not loaded.artifacts[0].manifest.has_aux
    with _trainer(loaded) as tr:
        got = [tr.step(b) for b in batches]
        again = tr.evaluate(batches[0])  # the loaded evaluation programs return the aux too
        tr.save(tmp_path / "ck")
    with P.Trainer.restore(tmp_path / "ck", loaded, optimizer=optax.adam(1e-2), aux="per_microbatch") as tr:
        _, per_microbatch = tr.step(batches[0])
        assert len(per_microbatch) == M and tr.history[0].aux is per_microbatch
    for (g_loss, g_aux), (w_loss, w_aux) in zip([*got, again], [*want, evaluated]):
        assert g_loss == w_loss
        _close(g_aux, w_aux)


@pytest.mark.parametrize("timed", [True, False])
def test_run_gives_each_microbatchs_aux_in_its_result(stages, timed):
    """``P.run`` (no Trainer, no update) on stages with aux: ``result.aux`` holds each microbatch's, as one process
    gives it, beside the loss and gradients; stages without aux give None."""
    params, batch = dropout_params(), dropout_batches(1)[0]
    r = P.run(stages, params, batch, microbatches=M, schedule="1f1b", timed=timed)
    (want_loss, want_aux), want_grads = jax.value_and_grad(lambda p: _mean_with_aux(p, batch), has_aux=True)(
        jax.tree_util.tree_map(jnp.asarray, params)
    )
    np.testing.assert_allclose(r.loss, want_loss, rtol=1e-6)
    assert_trees_close(r.grads, want_grads, rtol=1e-6, atol=1e-7)
    assert len(r.aux) == M
    _close(r.aux, [jax.tree_util.tree_map(np.asarray, a) for a in want_aux])
    plain = vs.export_stages(lambda params, x, y: aux_loss(params, x, y)[0], *_specs(), wrt="params", platforms="cpu")
    assert P.run(plain, params, batch, microbatches=M, timed=timed).aux is None


def _mean_with_aux(p, batch):
    """The mean loss over the M microbatches of ``batch``, and each one's aux."""
    k = batch[0].shape[0] // M
    parts = [aux_loss(p, *[x[i * k : (i + 1) * k] for x in batch]) for i in range(M)]
    return jnp.mean(jnp.stack([loss for loss, _ in parts])), [aux for _, aux in parts]


def test_an_untimed_step_with_aux_fetches_nothing_before_every_update_is_dispatched(stages, monkeypatch):
    """The aux comes to the host with the losses, at the step's end: nothing is read back before every stage's
    update is dispatched (no implicit transfer, no ``device_get``)."""
    batch = dropout_batches(1)[0]
    with _trainer(stages) as tr:
        tr.step(batch)  # compiled and warm
        (loss, aux), seen = step_noting_fetches(tr, batch, monkeypatch)
    assert seen[:2] == ["update"] * 2 and set(seen[2:]) == {"fetch"}, seen
    assert np.isfinite(loss) and 0 <= aux["accuracy"] <= 1


def test_the_aux_option_is_checked_when_the_trainer_is_made(stages):
    with pytest.raises(VjpsplitError, match=re.escape("aux='sum': give 'mean' (the default) or 'per_microbatch'")):
        _trainer(stages, aux="sum")
    plain = vs.export_stages(lambda params, x, y: aux_loss(params, x, y)[0], *_specs(), wrt="params", platforms="cpu")
    with pytest.raises(VjpsplitError, match=r"aux='mean': the stages' function returns no aux; export it with"):
        _trainer(plain, aux="mean")
    with _trainer(plain) as tr:  # no aux: the loss alone, as before
        assert isinstance(tr.step(dropout_batches(1)[0]), float) and tr.history[0].aux is None


def test_export_refuses_an_aux_that_is_not_a_pair_of_arrays():
    def loss_only(params, x, y):
        return aux_loss(params, x, y)[0]

    with pytest.raises(VjpsplitError, match=r"has_aux=True, so .*loss_only must return a pair \(loss, aux\); it "):
        vs.export_stages(loss_only, *_specs(), wrt="params", platforms="cpu", has_aux=True)

    def triple(params, x, y):
        return (*aux_loss(params, x, y), 1.0)

    with pytest.raises(VjpsplitError, match=r"must return a pair \(loss, aux\); it returned a 3-tuple"):
        vs.export_stages(triple, *_specs(), wrt="params", platforms="cpu", has_aux=True)

    def named(params, x, y):
        loss, aux = aux_loss(params, x, y)
        return loss, {**aux, "note": "epoch 1"}

    with pytest.raises(VjpsplitError, match=r"aux leaf 'aux/note' is a str; the aux holds arrays"):
        vs.export_stages(named, *_specs(), wrt="params", platforms="cpu", has_aux=True)

    def keyed(params, x, y):
        return aux_loss(params, x, y)[0], {"key": jax.random.key(0)}

    with pytest.raises(VjpsplitError, match=r"aux leaf 'aux/key' is a PRNG key"):
        vs.export_stages(keyed, *_specs(), wrt="params", platforms="cpu", has_aux=True)

    with pytest.raises(VjpsplitError, match=r"returning one float scalar loss .*return \(loss, aux\) and pass has_aux"):
        vs.export_stages(aux_loss, *_specs(), wrt="params", platforms="cpu")


def test_a_per_stage_artifact_with_aux_before_the_last_is_refused(stages):
    first = vs.export(
        lambda p, x: (jnp.tanh(x @ p["w0"]), {"m": jnp.mean(x)}),
        {"w0": jax.ShapeDtypeStruct((4, 16), jnp.float32)},
        jax.ShapeDtypeStruct((4, 4), jnp.float32),
        has_aux=True,
        platforms="cpu",
    )
    with pytest.raises(VjpsplitError, match=r"stage 0's artifact was exported with has_aux; only the last stage's"):
        P.Trainer(
            [first, stages.artifacts[1]],
            [{"w0": dropout_params()["w0"]}, {"w1": dropout_params()["w1"]}],
            optimizer=optax.sgd(0.1),
            microbatches=2,
        )


def test_docs_metrics_block_runs():
    """docs/howto/metrics.md's block, run as written: the Trainer's loss and aux are the one-process loop's."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "howto" / "metrics.md").read_text()
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, object] = {}
    exec(compile(block, "metrics.md", "exec"), scope)
    assert 0 <= scope["aux"]["accuracy"] <= 1 and scope["one_aux"]["accuracy"] == pytest.approx(
        scope["aux"]["accuracy"]
    )
