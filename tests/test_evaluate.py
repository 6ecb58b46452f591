"""Trainer.evaluate: every stage's forward only, from evaluation programs without residuals (export_stages' GPT,
tied embedding): the one-process loss, no state changed, stage directories with and without the programs."""

from __future__ import annotations

import functools
import hashlib
import json
import os

import jax
import numpy as np
import optax
import pytest
from models import assert_trees_close, optax_reference
from jax import export as jexport
from stage_models import T, gpt, gpt_batch, gpt_params, gpt_specs, specs_like

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.pipeline.runtime.worker import StageWorker
from vjpsplit_cli.pipeline.stages.evalprograms import EvalProgram, forward_outputs

# What jax names its runtime errors: JaxRuntimeError (XlaRuntimeError on older jax, 0.6.2 among them).
RUNTIME_ERROR = jax.errors.JaxRuntimeError.__name__


@functools.lru_cache(maxsize=None)
def _stages():
    return vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")


def _same(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_eval_programs_return_only_what_each_stage_sends():
    st = _stages()
    for art, program in zip(st.artifacts, st.evaluation):
        outs = forward_outputs(art)
        assert [(a.shape, a.dtype) for a in program.exported.out_avals] == [(a.shape, a.dtype) for a in outs]
        assert program.exported.in_avals == art.exported["fwd"].in_avals
    # The training forward returns residuals beside its outputs; the evaluation programs none.
    assert sum(len(a.exported["fwd"].out_avals) for a in st) > sum(p.num_outputs for p in st.evaluation)


def test_evaluate_equals_one_process_loss_and_changes_no_state(monkeypatch):
    params, tx = gpt_params(), optax.adamw(1e-2)
    train, held_out = [gpt_batch(8, seed=40 + i) for i in range(3)], gpt_batch(8, seed=50)
    with P.Trainer(_stages(), params, optimizer=tx, schedule="1f1b", microbatches=4) as tr:
        tr.step(train[0])
        before = tr.state()
        history = list(tr.history)  # frozen records: the same rows after, or evaluate changed them

        def no_training_forward(*a, **k):
            raise AssertionError("evaluate ran a training forward")

        with monkeypatch.context() as m:
            m.setattr(StageWorker, "forward", no_training_forward)
            loss = tr.evaluate(held_out)
            loss2, outputs = tr.evaluate(held_out, microbatches=2, outputs=True)
        assert all(not t.worker.res and not t.worker.inter and t.worker.grads is None for t in tr.backend.trainers)
        _same(tr.state(), before)  # parameters and optimizer state, bitwise
        assert tr.step_count == 1 and tr.history == history
        ref = float(gpt(before[0], *held_out))
        assert abs(loss - ref) <= 1e-6 * abs(ref) and abs(loss2 - ref) <= 1e-6 * abs(ref)
        losses = [tr.step(b) for b in train[1:]]  # training goes on as if evaluate had not run
    ref_losses, _ = optax_reference(gpt, params, tx, train)
    np.testing.assert_allclose(losses, ref_losses[1:], rtol=1e-5)
    # The model's output: what the last stage receives, per microbatch, as the training forwards send it.
    st = _stages()
    stage_params = st.stage_params(before[0])
    x, side = st.stage_batch(held_out, 2)[1]
    for s in range(3):
        x, _ = st[s].fwd(stage_params[s], x, *side.get(s, []))
    assert len(outputs) == 2
    assert_trees_close(tuple(outputs[1]), tuple(x), rtol=1e-6, atol=1e-6)


def test_saved_directory_evaluates_and_an_old_one_trains_but_is_refused(tmp_path):
    params, batch = gpt_params(), gpt_batch(4, seed=7)
    d = tmp_path / "gpt.stages"
    _stages().save(d)
    names = sorted(os.listdir(d))
    assert names == [f"stage{k}.{e}" for k in range(4) for e in ("eval", "vjp")] + ["stages.json"]
    index = json.loads((d / "stages.json").read_text())
    assert index["version"] == 2 and index["stages"][0]["evaluation"]["file"] == "stage0.eval"
    back = vs.load_stages(d)
    with P.Trainer(back, params, optimizer=optax.sgd(0.1), microbatches=2) as tr:
        loss = tr.evaluate(batch)
    np.testing.assert_allclose(loss, gpt(params, *batch), rtol=1e-6)

    (d / "stage2.eval").write_bytes((d / "stage1.eval").read_bytes())  # another stage's program
    with pytest.raises(VjpsplitError, match=r"stage2\.eval: not the evaluation program stages\.json was saved with"):
        vs.load_stages(d)
    forged = json.loads(json.dumps(index))  # ... and an unsigned index that records its digest
    forged["stages"][2]["evaluation"]["sha256"] = hashlib.sha256((d / "stage1.eval").read_bytes()).hexdigest()
    (d / "stages.json").write_text(json.dumps(forged))
    with pytest.raises(
        VjpsplitError, match=r"stage2\.eval: input 'x/0': expected float32\[b,5,8\], the program takes float32\[\]"
    ):
        vs.load_stages(d)
    (d / "stage2.eval").write_bytes(b"garbage")
    forged["stages"][2]["evaluation"]["sha256"] = hashlib.sha256(b"garbage").hexdigest()
    (d / "stages.json").write_text(json.dumps(forged))
    with pytest.raises(VjpsplitError, match=r"stage2\.eval: not a vjpsplit evaluation program"):
        vs.load_stages(d)

    # A directory an older vjpsplit wrote: index version 1, no evaluation programs.
    for k in range(4):
        os.remove(d / f"stage{k}.eval")
    index["version"] = 1
    for entry in index["stages"]:
        del entry["evaluation"]
    (d / "stages.json").write_text(json.dumps(index))
    old = vs.load_stages(d)
    with P.Trainer(old, params, optimizer=optax.sgd(0.1), microbatches=2) as tr:
        np.testing.assert_allclose(tr.step(batch), gpt(params, *batch), rtol=1e-5)  # trains as before
        with pytest.raises(
            VjpsplitError, match=r"no evaluation program for stages 0, 1, 2, 3 .*export the stages again"
        ):
            tr.evaluate(batch)
    again = tmp_path / "again"
    old.save(again)  # saved again as it is: version 1, byte for byte the index it read
    assert json.loads((again / "stages.json").read_text())["version"] == 1


def test_fit_evaluates_every_n_steps_and_after_the_last():
    params, tx = gpt_params(), optax.sgd(0.1)
    train, held_out = [gpt_batch(8, seed=60 + i) for i in range(3)], gpt_batch(8, seed=70)
    with P.Trainer(_stages(), params, optimizer=tx, microbatches=2) as tr:
        with pytest.raises(VjpsplitError, match="both eval_data"):
            tr.fit(train, 3, eval_every=2)
        with pytest.raises(VjpsplitError, match=r"eval_every=0; pass a number of steps >= 1"):
            tr.fit(train, 3, eval_data=held_out, eval_every=0)
        tr.fit(train, 3, eval_data=held_out, eval_every=2)
        got = [h.eval_loss for h in tr.history]
        now = tr.params()
    assert got[0] is None and got[1] is not None
    np.testing.assert_allclose(got[2], gpt(now, *held_out), rtol=1e-6)


def test_per_stage_form_is_refused():
    st = _stages()
    per_stage = st.stage_params(gpt_params())
    with P.Trainer(list(st), per_stage, optimizer=optax.sgd(0.1), microbatches=2) as tr:
        with pytest.raises(VjpsplitError, match="evaluate runs the evaluation programs of a Stages"):
            tr.evaluate(gpt_batch(4))


def test_microbatches_that_are_not_a_count_are_refused_as_the_trainers_are():
    # -2 gave NaN without an error, 0 a raw ZeroDivisionError, "2" a raw TypeError.
    with P.Trainer(_stages(), gpt_params(), optimizer=optax.sgd(0.1), microbatches=2) as tr:
        for count in (-2, 0, "2", 2.0, True):
            with pytest.raises(VjpsplitError, match=rf"microbatches={count!r}: give how many microbatches"):
                tr.evaluate(gpt_batch(8), microbatches=count)
        assert np.isfinite(tr.evaluate(gpt_batch(8), microbatches=np.int64(4)))


def _gpt_stages_for(first):
    """The test GPT exported with ``first`` as every batch input's first dim (an int, or a symbolic expression)."""
    S = jax.ShapeDtypeStruct
    p = specs_like(gpt_params())
    return vs.export_stages(
        gpt,
        p,
        S((first, T), np.int32),
        S((first, T), np.float32),
        S((first, T), np.int32),
        wrt="params",
        platforms="cpu",
    )


def test_a_batch_that_does_not_fit_the_exported_rows_is_one_error_with_the_fix_before_any_stage_runs():
    # Exported for the whole batch (16 rows), trained with microbatches=4: the first step raised the artifact's
    # "args: input 'batch/0': expected i32[16,5], got i32[4,5]" and evaluate jax's raw "Shape mismatch".
    params = gpt_params()
    with P.Trainer(_gpt_stages_for(16), params, optimizer=optax.sgd(0.1), microbatches=4) as tr:
        fix = (
            r"batch leaf 'tokens': the stages were exported for 16 rows per stage call \(i32\[16,5\]\), but a batch "
            r"of 16 rows with microbatches=4 x data_parallel=1 gives each call 16 / 4 = 4: pass a batch of 64 rows, "
            r"or export the stages with a symbolic batch dim"
        )
        with pytest.raises(VjpsplitError, match=fix):
            tr.step(gpt_batch(16))
        with pytest.raises(VjpsplitError, match=fix):
            tr.evaluate(gpt_batch(16))
        assert tr.step_count == 0 and not tr.history
        _same(tr.params(), params)
        assert np.isfinite(tr.step(gpt_batch(64)))  # the batch the message names trains


def test_an_odd_row_count_for_a_2b_dim_is_the_steps_clear_error_in_evaluate_too():
    (b,) = jexport.symbolic_shape("b")
    with P.Trainer(_gpt_stages_for(2 * b), gpt_params(), optimizer=optax.sgd(0.1), microbatches=2) as tr:
        said = r"batch leaf 'tokens' dim 0 is 3, but the shape gives it as 2\*b: no whole number 'b' solves 2\*b = 3"
        for run in (tr.evaluate, tr.step):  # evaluate gave jax's raw "Division had remainder 1"
            with pytest.raises(VjpsplitError, match=said + r".*each stage call gets the batch's 6 rows"):
                run(gpt_batch(6))
        loss = tr.evaluate(gpt_batch(8))
        np.testing.assert_allclose(loss, gpt(gpt_params(), *gpt_batch(8)), rtol=1e-6)


def _raises_on_the_host(x):
    """``x`` through a jitted host callback that raises: an error inside a stage, as a user's callback gives."""

    def host(_):
        raise RuntimeError("the user's callback failed")

    like = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
    return jax.pure_callback(host, like, x)


def test_an_error_inside_a_stage_names_the_stage_and_the_microbatch(monkeypatch):
    real, calls = EvalProgram.run, []

    def run(self, *leaves):
        calls.append(self)
        if len(calls) == 6:  # microbatch 1's second stage (4 stages)
            leaves = jax.jit(_raises_on_the_host)(leaves)
        return real(self, *leaves)

    monkeypatch.setattr(EvalProgram, "run", run)
    with P.Trainer(_stages(), gpt_params(), optimizer=optax.sgd(0.1), microbatches=2) as tr:
        with pytest.raises(VjpsplitError) as got:
            tr.evaluate(gpt_batch(8))
        assert str(got.value) == (
            f"evaluate: stage 1 mb 1 failed in its evaluation program: {RUNTIME_ERROR}: INTERNAL: RuntimeError: "
            "the user's callback failed"
        )
        assert isinstance(got.value.__cause__, jax.errors.JaxRuntimeError)  # chained: the traceback is kept
        assert np.isfinite(tr.evaluate(gpt_batch(8)))  # the next call runs
