"""Microbatches of their own lengths (``P.Microbatches``): weighted, they train as one process on the same ones.

Each microbatch is a batch tuple of its own sequence length (a symbolic dim of the export); the step's loss and
gradients are ``sum_i w_i * loss_i / sum_i w_i``, which ``stage_models.one_process_weighted`` computes with
``jax.value_and_grad`` in one process. Each new shape compiles once; the untimed step still reads nothing back
before its updates; bad microbatches or weights are one error naming the option.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from models import assert_trees_close
from stage_models import one_process_weighted, seq_loss, seq_microbatches, seq_specs

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError

pytestmark = pytest.mark.filterwarnings("ignore::vjpsplit_cli.pipeline.SharedDevicesWarning")

M = 4  # microbatches


def seq_params(seed: int = 0):
    rng = np.random.default_rng(seed)
    return {
        "w0": (rng.normal(size=(4, 8)) / 2).astype(np.float32),
        "w1": (rng.normal(size=(8, 3)) / 3).astype(np.float32),
    }


@pytest.fixture(scope="module")
def stages():
    return vs.export_stages(seq_loss, *seq_specs(seq_params()), wrt="params", platforms="cpu")


def _steps(lengths_per_step, seed: int = 3):
    """Per step ``(batches, weights)``: a microbatch per length, weighted by its token count (rows * length)."""
    out = []
    for t, lengths in enumerate(lengths_per_step):
        batches = seq_microbatches(lengths, seed=seed + t)
        out.append((batches, [float(b[0].shape[0] * b[0].shape[1]) for b in batches]))
    return out


STEPS = [(8, 16, 8, 16), (16, 16, 8, 8), (8, 8, 8, 16)]


def _trainer(stages, **kw):
    return P.Trainer(stages, seq_params(), **{"optimizer": optax.adam(1e-2), "microbatches": M, **kw})


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_microbatches_of_two_lengths_train_as_one_process_weighted(stages, schedule):
    steps = _steps(STEPS)
    with _trainer(stages, schedule=schedule) as tr:
        losses = [tr.step(P.Microbatches(b, weights=w)) for b, w in steps]
        params = tr.params()
    want, want_params = one_process_weighted(seq_loss, seq_params(), steps, optax.adam(1e-2))
    np.testing.assert_allclose(losses, want, rtol=1e-6)
    assert_trees_close(params, want_params, rtol=1e-6, atol=1e-7)
    unweighted, _ = one_process_weighted(seq_loss, seq_params(), [(b, [1.0] * M) for b, _ in steps], optax.adam(1e-2))
    assert not np.allclose(losses, unweighted, rtol=1e-4)  # the weights matter


def test_a_timed_step_a_clipped_update_and_fit_take_them_too(stages):
    """Timed steps (their own worker threads), clipping by the global norm and ``fit`` over data that gives
    ``Microbatches``: the same run as one process."""
    steps = _steps(STEPS)
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    data = [P.Microbatches(b, weights=w) for b, w in steps]
    with _trainer(stages, optimizer=optax.adam(1e-2), clip_global_norm=0.05) as tr:
        first = tr.step(data[0], timed=True)
        rest = tr.fit(data, steps=len(data))
        params = tr.params()
    want, want_params = one_process_weighted(seq_loss, seq_params(), steps, tx)
    np.testing.assert_allclose([first, *rest], want, rtol=1e-6)
    assert_trees_close(params, want_params, rtol=1e-6, atol=1e-7)


def test_evaluate_gives_the_weighted_mean(stages):
    ((batches, weights),) = _steps([(8, 16, 16, 8)])
    with _trainer(stages) as tr:
        got = tr.evaluate(P.Microbatches(batches, weights=weights))
        with pytest.raises(VjpsplitError, match="give no microbatches= with them"):
            tr.evaluate(P.Microbatches(batches), microbatches=2)
    want = sum(w * float(seq_loss(seq_params(), *b)) for b, w in zip(batches, weights)) / sum(weights)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_each_new_shape_compiles_once(stages, caplog):
    """Steps over lengths already seen compile nothing; a new length compiles in the step that brings it (the
    forward's checked first call, then its jitted one; the backward as a step's first microbatch and as a later
    one: here all in one step), and never after, in any order of the lengths."""
    steps = _steps([(8, 16, 8, 16), (16, 8, 16, 8), (8, 8, 16, 16), (24, 24, 8, 8), (8, 24, 16, 24), (16, 8, 24, 8)])
    mbs = [P.Microbatches(b, weights=w) for b, w in steps]

    def compiled(step) -> list[str]:
        caplog.clear()
        step()
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]

    with _trainer(stages) as tr:
        tr.step(mbs[0])
        tr.step(mbs[1])  # each length the first microbatch of a step, and a later one
        jax.config.update("jax_log_compiles", True)
        try:
            with caplog.at_level(logging.WARNING):
                got = [compiled(lambda m=m: tr.step(m)) for m in mbs[2:]]
        finally:
            jax.config.update("jax_log_compiles", False)
    assert got[0] == [], got[0]
    assert got[1]  # length 24: each stage call compiles for it
    assert got[2:] == [[], []], got[2:]


def test_an_untimed_step_reads_nothing_back_before_its_updates(stages):
    """The weights' cotangents go to the device as the step starts; nothing comes back mid-step."""
    steps = _steps(STEPS)
    with _trainer(stages) as tr:
        tr.step(P.Microbatches(steps[0][0], weights=steps[0][1]))  # compiled and warm
        jax.config.update("jax_transfer_guard_device_to_host", "disallow")  # np.asarray of a device array raises
        try:
            loss = tr.step(P.Microbatches(steps[0][0], weights=steps[0][1]))
        finally:
            jax.config.update("jax_transfer_guard_device_to_host", "allow")
    assert np.isfinite(loss)


def test_auto_plans_with_the_largest_microbatch_and_counts_no_race_step_that_compiled(stages):
    """``Schedule("auto", memory_limit_bytes=...)``: the limits come from the first step's largest microbatch; a
    trial step over a new length is not counted (its compile is no plan's time); a later microbatch larger than
    the limits were worked out for is a warning. It trains as one process throughout."""
    lengths = [(8, 16, 8, 16)] * 6 + [(8, 32, 8, 8)] + [(8, 16, 8, 16)] * 2
    steps = _steps(lengths)
    schedule = P.Schedule("auto", memory_limit_bytes="1MiB", trial_rounds=1)
    losses = []
    with _trainer(stages, schedule=schedule) as tr:
        for i, (b, w) in enumerate(steps):
            counted = None if tr.auto.trial is None else sum(map(len, tr.auto.trial.seconds))
            if i == 6:
                with pytest.warns(UserWarning, match="memory_limit_bytes: a microbatch of this step holds"):
                    losses.append(tr.step(P.Microbatches(b, weights=w)))
                assert counted is None or sum(map(len, tr.auto.trial.seconds)) == counted
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", UserWarning)
                    losses.append(tr.step(P.Microbatches(b, weights=w)))
            if i == 0:
                held = list(tr.auto.held)
        params = tr.params()
    small = _trainer(stages, schedule=P.Schedule("auto", memory_limit_bytes="1MiB"))
    with small:
        small.step(P.Microbatches(seq_microbatches([8] * M)))
        assert all(a < b for a, b in zip(small.auto.held, held))  # length 16 holds more than 8
    want, want_params = one_process_weighted(seq_loss, seq_params(), steps, optax.adam(1e-2))
    np.testing.assert_allclose(losses, want, rtol=1e-6)
    assert_trees_close(params, want_params, rtol=1e-6, atol=1e-7)


def test_bad_microbatches_are_one_error_naming_the_option(stages):
    batches = seq_microbatches([8, 16, 8, 16])
    for weights, match in [
        ([1.0, 2.0], r"Microbatches\(weights=...\): 2 weights for 4 microbatches"),
        ([1.0, 0.0, 1.0, 1.0], r"weight 1 is 0.0; each weight must be a finite number > 0"),
        ([1.0, float("nan"), 1.0, 1.0], "weight 1 is nan"),
        ([1.0, -2, 1.0, 1.0], "weight 1 is -2"),
        ([True, 1.0, 1.0, 1.0], "weight 0 is True"),
        (3.0, r"give one number per microbatch \(4\); got float"),
    ]:
        with pytest.raises(VjpsplitError, match=match):
            P.Microbatches(batches, weights=weights)
    with pytest.raises(VjpsplitError, match=r"Microbatches\(batches=...\): give a non-empty list"):
        P.Microbatches([])
    with pytest.raises(VjpsplitError, match="batch 1 is a list; give each microbatch as a tuple"):
        P.Microbatches([batches[0], list(batches[1])])
    x, y = batches[1]
    with _trainer(stages) as tr:
        with pytest.raises(VjpsplitError, match="Microbatches: 3 batches for a Trainer of microbatches=4"):
            tr.step(P.Microbatches(batches[:3]))
        wide = (np.zeros((2, 16, 5), np.float32), y)
        with pytest.raises(VjpsplitError, match=r"Microbatches batch 1: batch leaf 'x' is float32\[2, 16, 5\]"):
            tr.step(P.Microbatches([batches[0], wide, *batches[2:]]))
        torn = (x, np.zeros((2, 8, 3), np.float32))  # s is 16 in x, 8 in y
        with pytest.raises(VjpsplitError, match=r"Microbatches batch 1: batch leaf 'y' is \[2, 8, 3\].*s=16"):
            tr.step(P.Microbatches([batches[0], torn, *batches[2:]]))
        assert tr.step_count == 0  # refused before any stage ran


def test_the_docs_block_runs_and_equals_one_process():
    """docs/howto/variable-lengths.md's block, run as written: the Trainer's losses are the one-process loop's."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "howto" / "variable-lengths.md").read_text()
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, object] = {}
    exec(compile(block, "variable-lengths.md", "exec"), scope)
    assert len(scope["losses"]) == 2
    np.testing.assert_allclose(scope["losses"], scope["one_process"], rtol=1e-6)
