"""A PRNG key per microbatch (``Trainer(..., rng=key)``): dropout trains as the one-process loop over microbatch keys.

Microbatch ``i`` of step ``t`` gets ``fold_in(fold_in(key, t), i)`` on every stage that reads the key; the
one-process loop (``stage_models.one_process_with_keys``) draws the same masks, so losses and parameters agree
to f32 rounding under every schedule, across a checkpoint, and for a flax model with ``nn.Dropout``.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import assert_trees_close
from stage_models import (
    dropout_batches,
    dropout_loss,
    dropout_params,
    dropout_specs,
    one_process_with_keys,
    specs_like,
    split_key_loss,
)

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError

pytestmark = pytest.mark.filterwarnings("ignore::vjpsplit_cli.pipeline.SharedDevicesWarning")

KEY = jax.random.key(7)
M = 4  # microbatches


@pytest.fixture(scope="module")
def stages():
    return vs.export_stages(dropout_loss, *dropout_specs(dropout_params()), wrt="params", platforms="cpu")


def _trainer(stages, **kw):
    kw = {"optimizer": optax.adam(1e-2), "microbatches": M, "rng": KEY, **kw}
    return P.Trainer(stages, dropout_params(), **kw)


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_dropout_trains_as_the_one_process_loop_over_microbatch_keys(stages, schedule):
    batches = dropout_batches(3)
    with _trainer(stages, schedule=schedule) as tr:
        losses = [tr.step(b) for b in batches]
        params = tr.params()
    want, want_params = one_process_with_keys(dropout_loss, dropout_params(), KEY, batches, M, optax.adam(1e-2))
    np.testing.assert_allclose(losses, want, rtol=1e-6)
    assert_trees_close(params, want_params, rtol=1e-6, atol=1e-7)
    other, _ = one_process_with_keys(dropout_loss, dropout_params(), jax.random.key(8), batches, M, optax.adam(1e-2))
    assert not np.allclose(losses, other, rtol=1e-3)  # the masks matter: another key trains otherwise


def test_a_resumed_run_goes_on_with_the_same_keys(stages, tmp_path):
    batches = dropout_batches(4)
    with _trainer(stages) as tr:
        first = [tr.step(b) for b in batches[:2]]
        tr.save(tmp_path / "ck")
    again = P.Trainer.restore(tmp_path / "ck", stages, optimizer=optax.adam(1e-2), rng=KEY)
    with again:
        assert again.step_count == 2
        rest = again.fit(batches, steps=4)
        params = again.params()
    want, want_params = one_process_with_keys(dropout_loss, dropout_params(), KEY, batches, M, optax.adam(1e-2))
    np.testing.assert_allclose(first + rest, want, rtol=1e-6)
    assert_trees_close(params, want_params, rtol=1e-6, atol=1e-7)


def test_evaluate_takes_the_keys_of_the_next_step_and_changes_nothing(stages):
    batches = dropout_batches(2)
    with _trainer(stages) as tr:
        tr.step(batches[0])
        before = tr.params()
        evaluated = tr.evaluate(batches[1])
        assert tr.step_count == 1
        assert_trees_close(tr.params(), before, rtol=0, atol=0)
        stepped = tr.step(batches[1])
    np.testing.assert_allclose(evaluated, stepped, rtol=1e-6)  # the step after it draws the same masks
    want, _ = one_process_with_keys(dropout_loss, dropout_params(), KEY, batches, M, optax.adam(1e-2))
    np.testing.assert_allclose(evaluated, want[1], rtol=1e-6)


def test_a_raw_key_and_a_loaded_directory_train_as_the_typed_key(stages, tmp_path):
    batches = dropout_batches(2)
    with _trainer(stages) as tr:
        want = [tr.step(b) for b in batches]
        evaluated = tr.evaluate(batches[0])
    with _trainer(stages, rng=jax.random.PRNGKey(7)) as tr:  # uint32[2], wrapped with JAX's default impl
        assert [tr.step(b) for b in batches] == want
    stages.save(tmp_path / "st")
    loaded = vs.load_stages(tmp_path / "st")
    assert loaded.index.key_position == 0 and loaded.index.batch[0].dtype == "key<fry>"
    with _trainer(loaded) as tr:
        assert [tr.step(b) for b in batches] == want
        assert tr.evaluate(batches[0]) == evaluated  # the loaded evaluation programs take the key too


def test_a_key_split_on_one_stage_and_read_on_the_next_trains_as_one_process():
    stages = vs.export_stages(split_key_loss, *dropout_specs(dropout_params()), wrt="params", platforms="cpu")
    assert stages.index.per_stage[1].receives[0].dtype == "key<fry>"  # sent on as a key
    batches = dropout_batches(3)
    with _trainer(stages, schedule="zbh1", runner=P.InProcess(offload="host")) as tr:
        losses = [tr.step(batches[0], timed=True), tr.step(batches[1])]
        evaluated = tr.evaluate(batches[2])
        losses.append(tr.step(batches[2]))
    want, _ = one_process_with_keys(split_key_loss, dropout_params(), KEY, batches, M, optax.adam(1e-2))
    np.testing.assert_allclose(losses, want, rtol=1e-6)
    np.testing.assert_allclose(evaluated, want[2], rtol=1e-6)


def test_rng_is_checked_when_the_trainer_is_made(stages):
    with pytest.raises(
        VjpsplitError, match=re.escape("takes a PRNG key ('key'): give Trainer(..., rng=jax.random.key(seed))")
    ):
        _trainer(stages, rng=None)
    with pytest.raises(VjpsplitError, match=r"rng= is a key<rbg> key, the stages were exported for key<fry>"):
        _trainer(stages, rng=jax.random.key(0, impl="rbg"))
    for bad in (3, "seed", np.zeros(3, np.uint32), np.zeros(2, np.int32)):
        with pytest.raises(VjpsplitError, match=r"give one PRNG key, jax.random.key\(seed\)"):
            _trainer(stages, rng=bad)
    with pytest.raises(VjpsplitError, match=r"rng= is 2 keys; give one"):
        _trainer(stages, rng=jax.random.split(KEY))
    with pytest.raises(VjpsplitError, match=r"rng= with data_parallel=2"):
        _trainer(stages, runner=P.InProcess(data_parallel=2))

    def no_key(params, x, y):
        return dropout_loss(params, jax.random.key(0), x, y)  # a fixed mask: the function takes no key

    specs = dropout_specs(dropout_params())
    plain = vs.export_stages(no_key, specs[0], *specs[2:], wrt="params", platforms="cpu")
    with pytest.raises(VjpsplitError, match=r"rng=: the stages' function takes no PRNG key argument"):
        _trainer(plain)
    with pytest.raises(VjpsplitError, match=r"rng=: the stages' function takes no PRNG key argument"):
        P.Trainer(
            list(plain),
            [{"w0": dropout_params()["w0"]}, {"w1": dropout_params()["w1"]}],
            optimizer=optax.sgd(0.1),
            microbatches=2,
            rng=KEY,
        )


def test_the_batch_comes_without_the_key(stages):
    x, y = dropout_batches(1)[0]
    with _trainer(stages) as tr:
        with pytest.raises(VjpsplitError, match=r"tuple of 2 inputs \(x, y\).*leave out the PRNG key 'key'"):
            tr.step((KEY, x, y))
        assert tr.step_count == 0


def test_export_refuses_keys_the_trainer_cannot_hand_per_microbatch():
    params = dropout_params()
    p, key, x, y = dropout_specs(params)

    def nested(params, batch):
        return dropout_loss(params, batch["key"], batch["x"], batch["y"])

    with pytest.raises(VjpsplitError, match=r"batch input 'batch/key' is a scalar PRNG key inside a pytree"):
        vs.export_stages(nested, p, {"key": key, "x": x, "y": y}, wrt="params", platforms="cpu")

    def two(params, k1, k2, x, y):
        return dropout_loss(params, k1, x, y) + dropout_loss(params, k2, x, y)

    with pytest.raises(VjpsplitError, match=r"takes 2 PRNG key arguments \(k1, k2\); take one"):
        vs.export_stages(two, p, key, key, x, y, wrt="params", platforms="cpu")


def test_a_flax_model_with_dropout_trains_as_the_one_process_loop():
    import flax.linen as nn  # a test dependency (the models extra)

    class Block(nn.Module):
        width: int

        @nn.compact
        def __call__(self, x):
            return jnp.tanh(nn.Dropout(0.3, deterministic=False)(nn.Dense(self.width)(x)))

    first, second = Block(16), Block(3)
    params = {
        "first": first.init(jax.random.key(0), jnp.ones((2, 4)))["params"],
        "second": second.init(jax.random.key(1), jnp.ones((2, 16)))["params"],
    }

    def loss(params, key, x, y):
        h = first.apply({"params": params["first"]}, x, rngs={"dropout": jax.random.fold_in(key, 0)})
        h = vs.stage_boundary(h)
        out = second.apply({"params": params["second"]}, h, rngs={"dropout": jax.random.fold_in(key, 1)})
        return jnp.mean((out - y) ** 2)

    specs = dropout_specs(dropout_params())
    stages = vs.export_stages(loss, specs_like(params), *specs[1:], wrt="params", platforms="cpu")
    batches = dropout_batches(2)
    with P.Trainer(stages, params, optimizer=optax.sgd(0.1), microbatches=M, rng=KEY) as tr:
        losses = [tr.step(b) for b in batches]
        got = tr.params()
    want, want_params = one_process_with_keys(loss, params, KEY, batches, M, optax.sgd(0.1))
    np.testing.assert_allclose(losses, want, rtol=1e-6)
    assert_trees_close(got, want_params, rtol=1e-6, atol=1e-7)


def test_docs_dropout_block_runs():
    """docs/howto/training.md's dropout block, run as written: the Trainer's losses are the one-process loop's."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "howto" / "training.md").read_text()
    block = text.split("## Dropout: a PRNG key per microbatch", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, object] = {}
    exec(compile(block, "training.md", "exec"), scope)
    np.testing.assert_allclose(scope["losses"], scope["one_process"], rtol=1e-6)
