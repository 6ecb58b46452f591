"""Across stages: global-norm clipping equals optax's on one device, tied leaves summed and kept bitwise equal; checkpoints."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.files.prng import is_key, to_data
from vjpsplit_cli.files.trees import encode_structure, flatten_with_keys
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


def _checkpoint(step=7, shift=0.0):
    """A whole model's parameters (one bfloat16) and optax state with a typed PRNG key, as a Trainer saves them."""
    tx = optax.noisy_sgd(0.1, key=jax.random.key(1))  # a typed PRNG key in the state
    params = {k: v + shift for k, v in _whole().items()}
    params["h1/b"] = jnp.asarray(params["h1/b"], jnp.bfloat16)
    return C.HostCheckpoint(
        params, list(params), encode_structure(params), tx.init(params), step, C.CheckpointMeta(schedule="1f1b")
    )


def _assert_same(ck, saved):
    assert saved.layout == 2 and saved.step == ck.step and saved.meta == ck.meta
    assert list(saved.params) == list(ck.params) and saved.leaves == list(ck.leaves)
    for k, v in ck.params.items():
        assert saved.params[k].dtype == v.dtype, k
        np.testing.assert_array_equal(saved.params[k], np.asarray(v))
    state = dict(flatten_with_keys("", ck.opt_state))
    assert list(saved.opt_state) == list(state)
    for k, v in state.items():
        got = saved.opt_state[k]
        assert got.dtype == v.dtype and is_key(got) == is_key(v), k
        np.testing.assert_array_equal(
            np.asarray(jax.random.key_data(got) if is_key(got) else got),
            np.asarray(jax.random.key_data(v) if is_key(v) else v),
        )


def test_checkpoint_round_trips_every_leaf_and_the_step(tmp_path):
    ck = _checkpoint()
    C.save_checkpoint(tmp_path / "ck", ck)
    _assert_same(ck, C.read_checkpoint(tmp_path / "ck"))
    assert sorted(os.listdir(tmp_path / "ck")) == ["checkpoint.json", "opt_state.npz", "params.npz"]


def test_checkpoint_replaces_a_previous_one_whole_or_not_at_all(tmp_path, monkeypatch):
    C.save_checkpoint(tmp_path / "ck", _checkpoint(1))
    changed = _checkpoint(2, shift=1.0)
    C.save_checkpoint(tmp_path / "ck", changed)
    _assert_same(changed, C.read_checkpoint(tmp_path / "ck"))
    real = C.save_arrays
    calls = []

    def failing(path, *a, **k):
        calls.append(path)
        if len(calls) == 2:
            raise VjpsplitError("disk full")
        return real(path, *a, **k)

    monkeypatch.setattr(C, "save_arrays", failing)
    with pytest.raises(VjpsplitError, match="disk full"):
        C.save_checkpoint(tmp_path / "ck", _checkpoint(3))
    _assert_same(changed, C.read_checkpoint(tmp_path / "ck"))  # the previous checkpoint, whole
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temp directory left


def test_checkpoint_refuses_to_replace_what_is_not_one_and_reports_damage(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(VjpsplitError, match="not a vjpsplit checkpoint"):
        C.save_checkpoint(tmp_path / "mine", _checkpoint())
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with pytest.raises(VjpsplitError, match="no checkpoint.json"):
        C.read_checkpoint(tmp_path / "mine")
    C.save_checkpoint(tmp_path / "ck", _checkpoint())
    f = tmp_path / "ck" / "opt_state.npz"
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(VjpsplitError, match="opt_state.npz"):
        C.read_checkpoint(tmp_path / "ck")


# ---------------------------------------------------------------------------------------------- the whole model's state

OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2),
    "sgd-momentum-schedule": lambda: optax.sgd(optax.linear_schedule(0.1, 0.01, 3), momentum=0.9),
    "noisy-sgd-key": lambda: optax.noisy_sgd(0.1, key=jax.random.key(1)),  # a typed PRNG key, tied to no leaf
    "masked": lambda: optax.masked(optax.adam(1e-2), lambda p: {k: v.ndim > 1 for k, v in p.items()}),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_map_joins_the_stages_states_into_optax_structure(name):
    """Three stages' programs (one tied leaf) stepped as a pipeline: their states joined equal one device's."""
    from vjpsplit_cli.pipeline.training.optax_state import StateMap

    tx, whole = OPTIMIZERS[name](), _whole()
    progs = _programs(tx, whole)
    params = [{k: whole[k] for k in keys} for keys in HOLD]
    states = [p.init(ps) for p, ps in zip(progs, params)]
    shared = shared_keys(HOLD)
    for i in range(3):
        grads = sum_tied(_stage_grads(i), shared)
        for s, prog in enumerate(progs):
            params[s], states[s] = prog.update(params[s], states[s], grads[s])
    one = tx.init(whole)
    p = _whole()
    for i in range(3):
        g = {}
        for part in _stage_grads(i):
            for k, v in part.items():
                g[k] = g[k] + v if k in g else v
        u, one = tx.update(g, one, p)
        p = optax.apply_updates(p, u)
    smap = StateMap(tx, whole, {k: k for k in whole}, HOLD)
    joined = smap.gather(states)
    assert jax.tree_util.tree_structure(joined) == jax.tree_util.tree_structure(one)
    for (k, a), (_, b) in zip(flatten_with_keys("", joined), flatten_with_keys("", one), strict=True):
        a, b = (np.asarray(jax.random.key_data(x) if is_key(x) else x) for x in (a, b))
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6, err_msg=k)
    # Back to the stages: the same arrays as each program holds, a tied leaf's state on both holders.
    back = smap.scatter(joined)
    for s, prog in enumerate(progs):
        assert sorted(back[s]) == sorted(prog.state_keys)
        for k in prog.state_keys:
            np.testing.assert_array_equal(back[s][k], np.asarray(to_data(states[s][k])))


def test_state_map_refuses_a_state_that_is_not_optax_own_and_stages_that_disagree():
    from vjpsplit_cli.pipeline.training.optax_state import StateMap

    tx, whole = optax.adamw(1e-2), _whole()
    smap = StateMap(tx, whole, {k: k for k in whole}, HOLD)
    with pytest.raises(
        VjpsplitError,
        match=r"opt_state: has 3 leaves, chain's init gives these parameters 11; leaf 0 is '0/trace/embed', not '0/count'",
    ):
        smap.scatter(optax.sgd(0.1, momentum=0.9).init({k: whole[k] for k in ["embed", "h0/w", "h1/b"]}))
    bad = jax.tree_util.tree_map(lambda x: x, tx.init(whole))
    bad[0].mu["h0/w"] = np.zeros((2, 2), np.float32)
    with pytest.raises(
        VjpsplitError, match=r"opt_state '0/mu/h0%2Fw' is float32\[2, 2\]; chain's init gives float32\[4, 4\]"
    ):
        smap.scatter(bad)
    states = smap.scatter(tx.init(whole))
    states[2]["0/mu/embed"] = states[2]["0/mu/embed"] + 1  # the tied leaf's second holder
    with pytest.raises(VjpsplitError, match=r"optimizer state '0/mu/embed' differs between stages 0 and 2"):
        smap.gather(states)


@pytest.mark.parametrize("dtypes", [("float32", "float32", "float32"), ("float32", "bfloat16", "float32")])
def test_a_stages_squared_sums_come_back_in_one_array_where_its_leaves_share_a_dtype(dtypes):
    """``Squares.of`` dispatches each leaf's sum of squares in its own dtype; where every leaf has one dtype they come
    back as one array (one transfer: each array fetched costs an accelerator's host its own copy), else one scalar
    per leaf; either way the value is the per-leaf sums added on the host in leaf order."""
    from vjpsplit_cli.pipeline.training.clipping import Squares

    rng = np.random.default_rng(3)
    grads = {k: jnp.asarray(rng.normal(size=(5, 3)), dt) for k, dt in zip("abc", dtypes)}
    sq = Squares.of(grads, ["c", "a", "b"])
    assert len(sq.parts) == (1 if len(set(dtypes)) == 1 else 3)
    want = 0.0
    for k in "abc":  # leaf order
        want += float(jax.device_get(jnp.sum(jnp.square(grads[k]))))
    assert sq.value() == want
