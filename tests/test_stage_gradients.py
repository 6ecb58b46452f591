"""Across stages: global-norm clipping equals optax's on one device, tied leaves summed and kept bitwise equal; checkpoints."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.files.prng import is_key
from vjpsplit_cli.pipeline.training import checkpoint as C
from vjpsplit_cli.pipeline.training.clipping import clip_scale, norm_owners, shared_keys, sum_of_squares, sum_tied
from vjpsplit_cli.pipeline.training.optimizer import export_optimizer

# A whole model's parameters, held by three stages: "embed" is tied (stages 0 and 2).
SHAPES = {"embed": (6, 4), "h0/w": (4, 4), "h1/w": (4, 4), "h1/b": (4,), "head/b": (6,)}
HOLD = [["embed", "h0/w"], ["h1/w", "h1/b"], ["embed", "head/b"]]


def _whole(seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


def _stage_grads(step, big=3.0):
    """Per stage, the gradients of the leaves it holds (a tied leaf: each holder's own contribution)."""
    rng = np.random.default_rng(10 + step)
    return [{k: (big * rng.normal(size=SHAPES[k])).astype(np.float32) for k in keys} for keys in HOLD]


def _programs(tx, whole):
    return [
        export_optimizer(tx, {k: jax.ShapeDtypeStruct(whole[k].shape, whole[k].dtype) for k in keys}, platforms="cpu")
        for keys in HOLD
    ]


def _pipelined_steps(tx, steps, clip):
    whole = _whole()
    progs = _programs(tx, whole)
    params = [{k: whole[k] for k in keys} for keys in HOLD]
    states = [p.init(ps) for p, ps in zip(progs, params)]
    owners, shared = norm_owners(HOLD), shared_keys(HOLD)
    norms = []
    for i in range(steps):
        grads = sum_tied(_stage_grads(i), shared)
        scale, norm = clip_scale([sum_of_squares(g, own) for g, own in zip(grads, owners)], clip)
        norms.append(norm)
        for s, prog in enumerate(progs):
            params[s], states[s] = prog.update(params[s], states[s], grads[s], scale)
    return params, norms


def _one_device_steps(tx, steps):
    p = _whole()
    state = tx.init(p)
    norms = []
    for i in range(steps):
        g = {}
        for part in _stage_grads(i):
            for k, v in part.items():
                g[k] = g[k] + v if k in g else v
        norms.append(float(optax.tree.norm(g)))
        u, state = tx.update(g, state, p)
        p = optax.apply_updates(p, u)
    return p, norms


def test_ownership_counts_a_tied_leaf_once():
    assert norm_owners(HOLD) == [{"embed", "h0/w"}, {"h1/w", "h1/b"}, {"head/b"}]
    assert shared_keys(HOLD) == [{"embed"}, set(), {"embed"}]


@pytest.mark.parametrize("make", [lambda: optax.adamw(1e-2), lambda: optax.sgd(0.05, momentum=0.9)])
def test_global_norm_clipping_across_stages_equals_optax_chain(make):
    c = 1.0
    params, norms = _pipelined_steps(make(), 3, clip=c)
    ref, ref_norms = _one_device_steps(optax.chain(optax.clip_by_global_norm(c), make()), 3)
    assert min(norms) > 5 * c  # clipping acts on every step, so a wrong norm or scale would show
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    for s, keys in enumerate(HOLD):
        for k in keys:
            np.testing.assert_allclose(params[s][k], ref[k], rtol=2e-5, atol=1e-6)


def test_without_clipping_the_norm_is_reported_and_nothing_scaled():
    params, norms = _pipelined_steps(optax.adam(1e-2), 2, clip=None)
    ref, ref_norms = _one_device_steps(optax.adam(1e-2), 2)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    for s, keys in enumerate(HOLD):
        for k in keys:
            np.testing.assert_allclose(params[s][k], ref[k], rtol=1e-5, atol=1e-6)


def test_tied_copies_stay_bitwise_equal():
    params, _ = _pipelined_steps(optax.adamw(1e-2, weight_decay=0.1), 5, clip=2.0)
    assert not np.array_equal(params[0]["embed"], _whole()["embed"])  # it trained
    np.testing.assert_array_equal(np.asarray(params[0]["embed"]), np.asarray(params[2]["embed"]))


def test_sum_tied_gives_every_holder_the_same_sum():
    g = _stage_grads(0)
    out = sum_tied(g, shared_keys(HOLD))
    np.testing.assert_array_equal(out[0]["embed"], g[0]["embed"] + g[2]["embed"])
    assert out[0]["embed"] is out[2]["embed"]
    assert out[1]["h1/w"] is g[1]["h1/w"]


def test_bad_clip_value_is_refused():
    with pytest.raises(VjpsplitError, match="clip_global_norm=0"):
        clip_scale([1.0], 0)
    assert clip_scale([9.0, 16.0], 10.0) == (1.0, 5.0)
    assert clip_scale([9.0, 16.0], 1.0) == (0.2, 5.0)


# ---------------------------------------------------------------------------------------------- checkpoints


def _stage_states():
    tx = optax.noisy_sgd(0.1, key=jax.random.key(1))  # a typed PRNG key in the state
    whole = _whole()
    out = []
    for keys in HOLD:
        p = {k: whole[k] for k in keys}
        prog = export_optimizer(tx, {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in p.items()}, platforms="cpu")
        out.append((p, prog.init(p)))
    out[1][0]["h1/b"] = jnp.asarray(out[1][0]["h1/b"], jnp.bfloat16)
    return out


def _assert_same(a, b):
    for (pa, sa), (pb, sb) in zip(a, b, strict=True):
        for x, y in ((pa, pb), (sa, sb)):
            assert list(x) == list(y)
            for k in x:
                assert x[k].dtype == y[k].dtype, k
                np.testing.assert_array_equal(
                    np.asarray(jax.random.key_data(x[k]) if is_key(x[k]) else x[k]),
                    np.asarray(jax.random.key_data(y[k]) if is_key(y[k]) else y[k]),
                )


def test_checkpoint_round_trips_every_leaf_and_the_step(tmp_path):
    stages = _stage_states()
    C.save_checkpoint(tmp_path / "ck", stages, 7, {"schedule": "1f1b"})
    back, step, meta = C.load_checkpoint(tmp_path / "ck")
    assert step == 7 and meta == {"schedule": "1f1b"}
    _assert_same(stages, back)
    assert sorted(os.listdir(tmp_path / "ck")) == ["checkpoint.json", "stage-0.npz", "stage-1.npz", "stage-2.npz"]


def test_checkpoint_replaces_a_previous_one_whole_or_not_at_all(tmp_path, monkeypatch):
    stages = _stage_states()
    C.save_checkpoint(tmp_path / "ck", stages, 1)
    changed = [({k: v + 1 for k, v in p.items()}, s) for p, s in stages]
    C.save_checkpoint(tmp_path / "ck", changed, 2)
    back, step, _ = C.load_checkpoint(tmp_path / "ck")
    assert step == 2
    _assert_same(changed, back)
    real = C.save_arrays
    calls = []

    def failing(path, *a, **k):
        calls.append(path)
        if len(calls) == 2:
            raise VjpsplitError("disk full")
        return real(path, *a, **k)

    monkeypatch.setattr(C, "save_arrays", failing)
    with pytest.raises(VjpsplitError, match="disk full"):
        C.save_checkpoint(tmp_path / "ck", stages, 3)
    back, step, _ = C.load_checkpoint(tmp_path / "ck")
    assert step == 2  # the previous checkpoint, whole
    _assert_same(changed, back)
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temp directory left


def test_checkpoint_refuses_to_replace_what_is_not_one_and_reports_damage(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(VjpsplitError, match="not a vjpsplit checkpoint"):
        C.save_checkpoint(tmp_path / "mine", _stage_states(), 1)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with pytest.raises(VjpsplitError, match="no checkpoint.json"):
        C.load_checkpoint(tmp_path / "mine")
    C.save_checkpoint(tmp_path / "ck", _stage_states(), 1)
    f = tmp_path / "ck" / "stage-1.npz"
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(VjpsplitError, match="stage-1.npz"):
        C.load_checkpoint(tmp_path / "ck")
