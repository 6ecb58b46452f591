"""Training state outside the cut: state() is optax's own, checkpoints keyed by the model continue in any cut, in one
process and through orbax; fit equals step-by-step training and resumes from its own checkpoints."""

from __future__ import annotations

import functools
import logging
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from checkpoint_v1 import write_per_stage_checkpoint
from models import assert_trees_close
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.pipeline.training import fit as fit_module


def _gpt_math(params, tokens, mask, labels, mark):
    """``stage_models.gpt``'s arithmetic, with ``mark`` at the boundaries to keep (the same function to JAX)."""
    emb = jnp.take(params["embed"], tokens, axis=0)
    h, aux = mark(0, emb), jnp.zeros((), jnp.float32)
    h = jnp.tanh(h @ params["blocks"][0]["w"]) * mask[..., None]
    aux = aux + jnp.mean(h**2)
    h, aux = mark(1, (h, aux))
    h = mark(2, jnp.tanh(h @ params["blocks"][1]["w"]) + emb)
    lp = jax.nn.log_softmax(h @ params["embed"].T)
    return -jnp.mean(jnp.take_along_axis(lp, labels[..., None], -1)) + 0.1 * aux


def gpt_two_stages(params, tokens, mask, labels):
    """The GPT cut once, after block 0: other marks, 2 stages."""
    return _gpt_math(params, tokens, mask, labels, lambda i, x: vs.stage_boundary(x) if i == 1 else x)


def gpt_unmarked(params, tokens, mask, labels):
    """The GPT without marks (``export_stages(..., stages=N)`` cuts it)."""
    return _gpt_math(params, tokens, mask, labels, lambda i, x: x)


@functools.lru_cache(maxsize=None)
def _stages(kind="marks4"):
    specs = gpt_specs(gpt_params())
    if kind == "marks4":
        return vs.export_stages(gpt, *specs, wrt="params", platforms="cpu")
    if kind == "marks2":
        return vs.export_stages(gpt_two_stages, *specs, wrt="params", platforms="cpu")
    return vs.export_stages(gpt_unmarked, *specs, wrt="params", platforms="cpu", stages=2)


def _batches(n, size=8):
    return [gpt_batch(size, seed=40 + i) for i in range(n)]


def _one_process(tx, batches, params=None, state=None):
    """N steps of optax in one process from ``(params, state)``: ``(losses, params, state)``."""
    params = gpt_params() if params is None else params
    state = tx.init(params) if state is None else state
    step = jax.jit(jax.value_and_grad(gpt))
    losses = []
    for b in batches:
        loss, g = step(params, *b)
        u, state = tx.update(g, state, params)
        params = optax.apply_updates(params, u)
        losses.append(float(loss))
    return losses, params, state


def _assert_states_close(got, want, **tol):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)


CLIP = 0.5
OPTIMIZERS = {
    "adamw": (lambda: optax.adamw(1e-2), None),
    # The chain's clip acts on the global norm (computed across stages), after the Trainer's at the same norm:
    # the run is the chain's on one device, and its state the chain's structure.
    "clip-adamw": (lambda: optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(1e-2)), CLIP),
    "sgd-schedule-momentum": (lambda: optax.sgd(optax.linear_schedule(0.1, 0.01, 3), momentum=0.9), None),
    # Labels as a function of the parameters: each stage's optimizer labels its own share of them.
    "multi-transform": (lambda: optax.multi_transform(TRANSFORMS, _labels), None),
}


TRANSFORMS = {"adam": optax.adamw(1e-2), "sgd": optax.sgd(0.1, momentum=0.9)}


def _labels(params):
    """The embedding under AdamW, the blocks under SGD with momentum."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "adam" if "embed" in jax.tree_util.keystr(path) else "sgd", params
    )


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_is_optax_own_for_the_whole_model(name):
    make, clip = OPTIMIZERS[name]
    tx, batches = make(), _batches(3)
    tr = P.Trainer(_stages(), gpt_params(), optimizer=tx, schedule="zbh1", microbatches=2, clip_global_norm=clip)
    losses = [tr.step(b) for b in batches]
    ref_losses, ref_params, ref_state = _one_process(tx, batches)
    params, opt_state = tr.state()
    assert jax.tree_util.tree_structure(opt_state) == jax.tree_util.tree_structure(tx.init(gpt_params()))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_states_close(opt_state, ref_state, rtol=1e-4, atol=1e-6)
    assert_trees_close(params, ref_params, rtol=1e-4, atol=1e-6)
    counts = [x for x in jax.tree_util.tree_leaves(opt_state) if np.asarray(x).dtype == np.int32]
    assert counts and all(int(c) == 3 for c in counts)  # the step counts, once each, not once per stage
    if clip is not None:
        assert min(h.grad_norm for h in tr.history) > clip  # the clipping acted on every step


def test_a_pytree_built_for_the_whole_model_is_one_error_saying_to_pass_a_function():
    tx = optax.multi_transform(TRANSFORMS, _labels(gpt_params()))
    with pytest.raises(VjpsplitError, match=r"optimizer 'partition'.*whole model's parameters.*function of the param"):
        P.Trainer(_stages(), gpt_params(), optimizer=tx, schedule="1f1b", microbatches=2)


def _leaf_counting_tx():
    """A state sized by the number of leaves it sees: a stage's cannot be joined into the whole model's."""
    return optax.GradientTransformation(
        lambda p: {"seen": jnp.zeros(len(jax.tree_util.tree_leaves(p)))}, lambda g, s, p=None: (g, s)
    )


def test_a_state_that_is_not_per_leaf_is_one_error_naming_the_optimizer():
    """Such a state has no whole-model form, so no stage's can be one process's: refused when the Trainer is built."""
    tx = _leaf_counting_tx()
    match = r"optimizer '_leaf_counting_tx'.*cannot be joined.*sized by the leaves"
    with pytest.raises(VjpsplitError, match=match):
        P.Trainer(_stages(), gpt_params(), optimizer=tx, schedule="1f1b", microbatches=2)
    with pytest.raises(VjpsplitError, match=match):
        P.Trainer(_stages(), gpt_params(), optimizer=tx, schedule="1f1b", microbatches=2, opt_state=tx.init({}))


def test_a_one_process_opt_state_continues_in_a_trainer_and_state_gives_it_back():
    tx, batches = optax.adamw(1e-2), _batches(4)
    ref_losses, ref_params, ref_state = _one_process(tx, batches)
    _, params2, state2 = _one_process(tx, batches[:2])
    tr = P.Trainer(_stages(), params2, optimizer=tx, opt_state=state2, schedule="1f1b", microbatches=2)
    _, back = tr.state()
    _assert_states_close(back, state2, rtol=0, atol=0)  # what it was given, exactly
    later = [tr.step(b) for b in batches[2:]]
    np.testing.assert_allclose(later, ref_losses[2:], rtol=1e-5)
    assert_trees_close(tr.params(), ref_params, rtol=1e-4, atol=1e-6)
    _assert_states_close(tr.state()[1], ref_state, rtol=1e-4, atol=1e-6)
    fresh = _one_process(tx, batches[2:], params2)[0]  # from optax's init instead: another run
    assert not np.allclose(fresh, ref_losses[2:], rtol=1e-5)
    other = optax.sgd(0.1, momentum=0.9).init(params2)
    with pytest.raises(VjpsplitError, match=r"opt_state: has 3 leaves, chain's init gives these parameters 7; leaf 0"):
        P.Trainer(_stages(), params2, optimizer=tx, opt_state=other, microbatches=2)


def test_a_4_stage_checkpoint_continues_in_2_stages_other_marks_stages_2_and_one_process(tmp_path):
    tx = optax.adamw(optax.linear_schedule(1e-2, 1e-3, 4))
    batches = _batches(4)
    kw = dict(optimizer=tx, schedule="1f1b", microbatches=2)
    losses, never_stopped, _ = _one_process(tx, batches)  # the run never stopped
    four = P.Trainer(_stages(), gpt_params(), **kw)
    for b in batches[:2]:
        four.step(b)
    four.save(tmp_path / "ck")
    for kind in ("marks2", "cost2"):
        again = P.Trainer.restore(tmp_path / "ck", _stages(kind), optimizer=tx)
        assert again.step_count == 2 and again.model.num_stages == 2
        np.testing.assert_allclose([again.step(b) for b in batches[2:]], losses[2:], rtol=1e-5)
        assert_trees_close(again.params(), never_stopped, rtol=1e-4, atol=1e-6)
    params, opt_state, step = P.load_checkpoint(tmp_path / "ck", optimizer=tx)
    assert step == 2
    one_losses, one_params, _ = _one_process(tx, batches[2:], params, opt_state)
    np.testing.assert_allclose(one_losses, losses[2:], rtol=1e-5)
    assert_trees_close(one_params, never_stopped, rtol=1e-4, atol=1e-6)
    with pytest.raises(VjpsplitError, match=r"ck: its optimizer state has no '0/trace/blocks/0/w'"):
        P.load_checkpoint(tmp_path / "ck", optimizer=optax.sgd(0.1, momentum=0.9))


def test_orbax_round_trip_continues_the_run(tmp_path):
    import orbax.checkpoint as ocp

    tx, batches = optax.adamw(1e-2), _batches(4)
    kw = dict(optimizer=tx, schedule="zbh1", microbatches=2)
    tr = P.Trainer(_stages(), gpt_params(), **kw)
    losses = [tr.step(b) for b in batches]
    first = P.Trainer(_stages(), gpt_params(), **kw)
    for b in batches[:2]:
        first.step(b)
    params, opt_state = first.state()
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "orbax", {"params": params, "opt_state": opt_state})
    ckptr.wait_until_finished()
    abstract = {"params": params, "opt_state": jax.eval_shape(tx.init, params)}
    restored = ckptr.restore(tmp_path / "orbax", jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, abstract))
    again = P.Trainer(_stages("marks2"), restored["params"], opt_state=restored["opt_state"], step_count=2, **kw)
    assert again.fit(batches, steps=4) == pytest.approx(losses[2:], rel=1e-5)  # fit goes on from step 2
    assert again.step_count == 4
    assert_trees_close(again.params(), tr.params(), rtol=1e-4, atol=1e-6)


def test_docs_orbax_snippet_runs(tmp_path):
    """docs/howto/checkpoints.md's orbax block, run as written: the step it saves is the one the new Trainer starts at."""
    pytest.importorskip("orbax.checkpoint")
    text = (Path(__file__).resolve().parents[1] / "docs" / "howto" / "checkpoints.md").read_text()
    block = text.split("## orbax", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    tx, batches = optax.adamw(1e-2), _batches(4)
    kw = dict(optimizer=tx, schedule="zbh1", microbatches=2)
    trainer = P.Trainer(_stages(), gpt_params(), **kw)
    losses = [trainer.step(b) for b in batches[:2]]
    scope = {"trainer": trainer, "stages": _stages("marks2"), "tx": tx, "params_like": gpt_params(), "P": P}
    exec(compile(block.replace("/abs/path/orbax-ck", str(tmp_path / "orbax-ck")), "checkpoints.md", "exec"), scope)
    again = scope["trainer"]
    assert again is not trainer and again.step_count == 2
    ref = P.Trainer(_stages(), gpt_params(), **kw)
    want = [ref.step(b) for b in batches]
    assert losses == pytest.approx(want[:2], rel=1e-5)
    assert again.fit(batches, steps=4) == pytest.approx(want[2:], rel=1e-5)


def test_a_per_stage_checkpoint_loads_into_its_cut_and_is_refused_elsewhere(tmp_path):
    tx, batches = optax.sgd(0.1, momentum=0.9), _batches(3)
    kw = dict(optimizer=tx, schedule="1f1b", microbatches=2)
    tr = P.Trainer(_stages(), gpt_params(), **kw)
    tr.step(batches[0])
    meta = {"schedule": "1f1b", "optimizer": "sgd", "structure": tr.ownership.structure, "microbatches": 2}
    write_per_stage_checkpoint(tmp_path / "old", tr.backend.snapshots(), tr.step_count, meta)
    again = P.Trainer.restore(tmp_path / "old", _stages(), optimizer=tx)
    np.testing.assert_array_equal([again.step(b) for b in batches[1:]], [tr.step(b) for b in batches[1:]])
    with pytest.raises(VjpsplitError, match=r"old: holds 4 stages, not 2"):
        P.Trainer.restore(tmp_path / "old", _stages("marks2"), optimizer=tx)
    two = P.Trainer(_stages("marks2"), gpt_params(), **kw)
    with pytest.raises(VjpsplitError, match=r"old: an older vjpsplit wrote this checkpoint per stage \(4 stages"):
        two.fit(batches, steps=3, checkpoint_dir=tmp_path / "old")  # a run resumes from its checkpoint_dir
    with pytest.raises(VjpsplitError, match=r"old: an older vjpsplit wrote this checkpoint per stage"):
        P.load_checkpoint(tmp_path / "old", optimizer=tx)


def test_fit_with_a_function_and_a_sequence_equals_step_by_step_and_resumes(tmp_path):
    tx, batches = optax.adam(1e-2), _batches(5)
    kw = dict(optimizer=tx, schedule="1f1b", microbatches=2)
    by_step = P.Trainer(_stages(), gpt_params(), **kw)
    losses = [by_step.step(b) for b in batches]
    np.testing.assert_array_equal(P.Trainer(_stages(), gpt_params(), **kw).fit(batches, steps=5), losses)
    asked, seen = [], []

    def data(step):
        asked.append(step)
        return batches[step]

    first = P.Trainer(_stages(), gpt_params(), **kw)
    got = first.fit(data, steps=3, checkpoint_dir=tmp_path / "ck", checkpoint_every=2)
    np.testing.assert_array_equal(got, losses[:3])
    assert [t.step for t in first.checkpoint_times] == [2, 3]  # every 2nd step and the last
    assert all(t.write > 0 and t.wait >= 0 for t in first.checkpoint_times)  # complete when fit returned
    later = P.Trainer(_stages("marks2"), gpt_params(), **kw)  # begins at the checkpoint, in another cut
    got = later.fit(data, steps=5, checkpoint_dir=tmp_path / "ck", callback=lambda k, v: seen.append((k, v)))
    np.testing.assert_allclose(got, losses[3:], rtol=1e-5)
    assert asked == [0, 1, 2, 3, 4] and [k for k, _ in seen] == [3, 4] and later.step_count == 5
    assert_trees_close(later.params(), by_step.params(), rtol=1e-4, atol=1e-6)
    assert P.load_checkpoint(tmp_path / "ck", optimizer=tx)[2] == 5


def test_fit_says_where_it_resumes_and_warns_when_the_checkpoint_leaves_nothing_to_train(tmp_path, caplog):
    """Re-running a finished run in the same folder: a log line says where it resumes, a warning that it trains
    nothing (not a silent ``[]``)."""
    tx, batches = optax.sgd(0.1), _batches(3)
    kw = dict(optimizer=tx, microbatches=2)
    ck = tmp_path / "ck"
    with P.Trainer(_stages("marks2"), gpt_params(), **kw) as tr:
        assert len(tr.fit(batches, steps=2, checkpoint_dir=ck)) == 2
    with P.Trainer(_stages("marks2"), gpt_params(), **kw) as again:
        with pytest.warns(
            UserWarning,
            match=rf"fit trains nothing: the checkpoint in {ck} is at step 2 and steps=2 "
            r".*pass steps > 2 to go on, or another checkpoint_dir to start over",
        ) as seen:
            with caplog.at_level(logging.INFO, logger="vjpsplit_cli.pipeline.training.fit"):
                assert again.fit(batches, steps=2, checkpoint_dir=ck) == []
        assert seen[0].filename == __file__  # the warning points at the caller's fit line
        assert f"fit resumes from the checkpoint in {ck}, after step 2 of steps=2" in caplog.text
        caplog.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a run that goes on warns of nothing
            with caplog.at_level(logging.INFO, logger="vjpsplit_cli.pipeline.training.fit"):
                assert len(again.fit(batches, steps=3, checkpoint_dir=ck)) == 1
        assert "after step 2 of steps=3" in caplog.text
        with pytest.warns(UserWarning, match=r"fit trains nothing: the Trainer is at step 3 and steps=3"):
            assert again.fit(batches, steps=3) == []


def test_fit_surfaces_a_failed_background_write_and_bad_options(tmp_path, monkeypatch):
    tx, batches = optax.sgd(0.1), _batches(3)
    tr = P.Trainer(_stages("marks2"), gpt_params(), optimizer=tx, microbatches=2)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fit_module, "save_checkpoint", full)
    with pytest.raises(VjpsplitError, match=r"ck: the checkpoint after step 1 was not written \(.*No space left"):
        tr.fit(batches, steps=3, checkpoint_dir=tmp_path / "ck", checkpoint_every=1)
    assert tr.step_count < 3  # the error came at a next step (as soon as the write failed), not at the end
    with pytest.raises(VjpsplitError, match="checkpoint_every is given without checkpoint_dir"):
        tr.fit(batches, steps=3, checkpoint_every=1)
    with pytest.raises(VjpsplitError, match="data holds 3 batches and steps=4"):
        tr.fit(batches, steps=4)
    with pytest.raises(
        VjpsplitError, match="workers\\(\\) gives the Ray actor of each worker; this Trainer runs in-process"
    ):
        tr.workers()


def test_clip_global_norm_and_a_chained_clip_say_exactly_how_each_takes_the_others_state(tmp_path):
    """clip_global_norm=c saves tx's state; optax.chain(optax.clip_by_global_norm(c), tx) saves (EmptyState(), tx's):
    each refused the other's as a missing leaf. The error now says the fix, and the fix it says continues the run."""
    tx, c, batches = optax.adam(1e-2), 0.5, _batches(3)
    chained = optax.chain(optax.clip_by_global_norm(c), tx)
    with P.Trainer(_stages(), gpt_params(), optimizer=tx, microbatches=2, clip_global_norm=c) as tr:
        tr.step(batches[0])
        tr.save(tmp_path / "alone")
        params, alone = tr.state()
        want = tr.step(batches[1])
    with pytest.raises(
        VjpsplitError,
        match=r"alone: .*as a run with clip_global_norm= saves it.*restore with "
        r"optimizer=tx and clip_global_norm=c \(the same update\)",
    ):
        P.Trainer.restore(tmp_path / "alone", _stages(), optimizer=chained, clip_global_norm=None)
    with pytest.raises(VjpsplitError, match=r"opt_state: .*pass opt_state=\(optax.EmptyState\(\), opt_state\)"):
        P.Trainer(_stages(), params, optimizer=chained, microbatches=2, opt_state=alone)
    with P.Trainer(_stages(), params, optimizer=chained, microbatches=2, opt_state=(optax.EmptyState(), alone)) as tr:
        np.testing.assert_allclose(tr.step(batches[1]), want, rtol=1e-6)  # the fix it names: the same run
        tr.save(tmp_path / "chained")
        _, chained_state = tr.state()
    with pytest.raises(
        VjpsplitError,
        match=r"chained: .*restore with that chain as optimizer= and "
        r"clip_global_norm=None \(the same update\)",
    ):
        P.Trainer.restore(tmp_path / "chained", _stages(), optimizer=tx, clip_global_norm=c)
    with pytest.raises(VjpsplitError, match=r"opt_state: .*pass opt_state=opt_state\[1\]"):
        P.Trainer(_stages(), params, optimizer=tx, microbatches=2, clip_global_norm=c, opt_state=chained_state)
    with P.Trainer(_stages(), params, optimizer=tx, microbatches=2, clip_global_norm=c, opt_state=chained_state[1]):
        pass
