"""Pipeline runners: every schedule's gradients equal value_and_grad in-process (Ray: tests/ray_suite; schedules: test_schedule.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import assert_trees_close, mlp_stage_artifacts
from models import stage_head as head
from models import stage_hidden as hidden
from models import stages_whole as whole

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.pipeline.runtime.dispatch import progress_bar
from vjpsplit_cli.pipeline.runtime.worker import StageWorker
from vjpsplit_cli.pipeline.schedules.catalog import SCHEDULES

D, CLASSES, BATCH = 8, 5, 24


@functools.lru_cache(maxsize=None)  # exporting dominates; tests never mutate what it returns
def make(stages, seed=0):
    rng = np.random.default_rng(seed)
    arts, params = mlp_stage_artifacts(stages, rng, D, CLASSES, scale=3.0)
    x = rng.normal(size=(BATCH, D)).astype(np.float32)
    labels = rng.integers(0, CLASSES, BATCH).astype(np.int32)
    return arts, params, x, labels


STAGES = {"zbv": [2, 4, 6], "dualpipev": [2, 4], "interleaved1f1b": [2, 4]}  # V: 2p stages; interleaved: 2 per worker
CASES = [(name, stages) for name in SCHEDULES for stages in STAGES.get(name, [1, 2, 3, 4])]


@pytest.mark.parametrize("name,stages", CASES)
def test_inprocess_gradients_equal_value_and_grad(name, stages):
    arts, params, x, labels = make(stages)
    r = P.run(arts, params, x, [labels], microbatches=4, schedule=name)
    loss, grads = jax.value_and_grad(whole)(params, x, labels)
    np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
    assert_trees_close(r.grads, grads, rtol=1e-5, atol=1e-6)
    assert len(r.events) == sum(len(p) for p in P.schedule(name, stages, 4))
    assert 0.0 <= r.bubble_ratio < 1.0 and 0.0 <= r.modeled_bubble_ratio < 1.0
    # Each event says what ran: the input part of a split backward is an I, a whole backward a B.
    kinds = {"zbh1": {"F", "I", "W"}, "zbv": {"F", "I", "W"}, "dualpipev": {"F", "B", "I", "W"}}
    assert {e.kind for e in r.events} == kinds.get(name, {"F", "B"})
    by_op = {(e.kind, e.mb, e.stage) for e in r.events}
    assert by_op == {(o.kind, o.mb, o.stage) for ops in P.schedule(name, stages, 4) for o in ops}
    # Each worker ran exactly its own list, in order.
    for w, ops in enumerate(P.schedule(name, stages, 4)):
        mine = sorted((e for e in r.events if e.worker == w), key=lambda e: e.start)
        assert [(e.kind, e.mb, e.stage) for e in mine] == [(o.kind, o.mb, o.stage) for o in ops]


def test_timeline_plot_is_written(tmp_path):
    arts, params, x, labels = make(2)
    r = P.run(arts, params, x, [labels], microbatches=2, schedule="zbh1")
    r.plot(tmp_path / "timeline.png")
    data = (tmp_path / "timeline.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    rows = r.per_worker()
    # The first stage's W runs inside its I (the whole backward: its I hands nothing on), the last stage's apart.
    assert len(rows) == 2 and rows[1]["W"] > 0 and all(row["I"] > 0 and row["idle"] >= 0 for row in rows)
    arts, params, x, labels = make(4)
    r = P.run(arts, params, x, [labels], microbatches=4, schedule="zbv")
    r.plot(tmp_path / "v.png")
    assert (tmp_path / "v.png").read_bytes()[:4] == b"\x89PNG" and r.num_workers == 2


def test_plans_with_the_old_meaning_of_b_are_refused_and_with_i_give_value_and_grads():
    """Before ``Kind.I``, a B with a W of its stage and microbatch was the backward's input part. Such plans,
    handed to a runner, are refused before anything runs, naming the fix; with I they run, and their
    gradients are value_and_grad's."""
    arts, params, x, labels = make(2)
    F, B, I, W = (lambda mb, s, k=k: P.Op(k, mb, s) for k in "FBIW")  # noqa: E741
    old = [[F(0, 0), F(1, 0), B(0, 0), W(0, 0), B(1, 0), W(1, 0)], [F(0, 1), B(0, 1), F(1, 1), B(1, 1)]]
    with pytest.raises(vs.VjpsplitError, match=r"^rank 0: stage 0 microbatch 0: 0B0 is the whole backward, yet 0W0"):
        P.run(arts, params, x, [labels], microbatches=2, schedule=P.Schedule(plans=old))
    new = [[F(0, 0), F(1, 0), I(0, 0), W(0, 0), I(1, 0), W(1, 0)], [F(0, 1), B(0, 1), F(1, 1), B(1, 1)]]
    r = P.run(arts, params, x, [labels], microbatches=2, schedule=P.Schedule(plans=new))
    loss, grads = jax.value_and_grad(whole)(params, x, labels)
    np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
    assert_trees_close(r.grads, grads, rtol=1e-5, atol=1e-6)
    assert sorted((e.kind, e.mb, e.stage) for e in r.events) == sorted(
        (o.kind, o.mb, o.stage) for ops in new for o in ops
    )


def test_bad_pipelines_are_refused():
    arts, params, x, labels = make(2)
    with pytest.raises(vs.VjpsplitError, match="equal microbatches"):
        P.run(arts, params, x, [labels], microbatches=5)
    plain = [
        vs.export(
            hidden,
            *[
                jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params[0]),
                jax.ShapeDtypeStruct((BATCH // 2, D), jnp.float32),
            ],
            platforms="cpu",
        ),
        arts[1],
    ]
    with pytest.raises(vs.VjpsplitError, match="ZB-H1 needs the split backward"):
        P.run(plain, params, x, [labels], microbatches=2, schedule="zbh1")
    with pytest.raises(vs.VjpsplitError, match="even number of stages"):
        P.run(*make(3)[:3], [labels], microbatches=2, schedule="zbv")
    no_input_grad = [
        arts[0],
        vs.export(
            head,
            *[
                jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), a)
                for a in (params[1], x, labels)
            ],
            wrt="params",
            platforms="cpu",
        ),
    ]
    with pytest.raises(vs.VjpsplitError, match="stage 1: export it with wrt including its input"):
        P.run(no_input_grad, params, x, [labels], microbatches=2, schedule="1f1b")


def test_forward_fast_path_keeps_the_callers_arrays():
    arts, params, x, labels = make(2)
    st = StageWorker(arts[0], params[0], 0, 2)
    ct = np.ones((8, D), np.float32)
    for mb in range(3):  # the first call checks and traces; the later ones take the jitted path
        xs = jnp.asarray(x[mb * 8 : (mb + 1) * 8])
        out = st.forward(mb, xs, [])
        assert any(leaf is xs for leaf in jax.tree_util.tree_leaves(st.res[mb]))  # the very array, not a copy
        ref_out, ref_res = arts[0].fwd(params[0], xs)
        np.testing.assert_allclose(out, ref_out, rtol=1e-6)
        assert_trees_close(arts[0].bwd(st.res[mb], ct), arts[0].bwd(ref_res, ct), rtol=1e-6, atol=1e-7)


def test_split_backward_hands_w_the_stages_own_residual_arrays():
    # B's jitted call must not return the residuals W reads (XLA would hand back copies): the very arrays ride along.
    arts, params, x, labels = make(2)
    st = StageWorker(arts[0], params[0], 0, 2)
    _, res = st.calls.forward(st.params, jnp.asarray(x[:8]))
    ct = jnp.ones((8, D), jnp.float32)
    gx, inter = st.calls.backward_input(res, ct)
    assert inter.stored or inter.inputs  # W reads the layer's input here (a residual backed by the input)
    assert all(inter.stored[k] is res.stored[k] for k in inter.stored)
    assert all(inter.inputs[k] is res.inputs[k] for k in inter.inputs)
    assert inter.residuals_id == res.residuals_id
    _, ref_inter = arts[0].bwd_input(res, ct)
    assert_trees_close(st.calls.backward_weight(inter), arts[0].bwd_weight(ref_inter)["params"], rtol=1e-6, atol=1e-7)


def test_progress_bar_counts_every_op(monkeypatch):
    import tqdm

    class Recorder:
        def __init__(self, total, **kwargs):
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            self.closed = True

    bars = []
    monkeypatch.setattr(tqdm, "tqdm", Recorder)
    arts, params, x, labels = make(2)
    P.run(arts, params, x, [labels], microbatches=2, schedule="zbh1", progress=True)
    total = sum(len(p) for p in P.schedule("zbh1", 2, 2))
    assert len(bars) == 1 and bars[0].total == bars[0].n == total and bars[0].closed


def test_progress_bar_is_tqdm_when_asked():
    from tqdm import tqdm

    bar = progress_bar(3, True)
    assert isinstance(bar, tqdm)
    bar.close()
    assert progress_bar(3, False) is None


def check_run(r, plans, params, x, labels):
    loss, grads = jax.value_and_grad(whole)(params, x, labels)
    np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
    assert_trees_close(r.grads, grads, rtol=1e-5, atol=1e-6)
    assert r.schedule == "custom" and r.num_workers == len(plans) and 0.0 <= r.modeled_bubble_ratio < 1.0
    for w, ops in enumerate(plans):  # each worker ran exactly its list, in order
        mine = sorted((e for e in r.events if e.worker == w), key=lambda e: e.start)
        assert [(e.kind, e.mb, e.stage) for e in mine] == [(o.kind, o.mb, o.stage) for o in ops]


def test_schedule_read_from_csv_runs_and_equals_value_and_grad(tmp_path):
    # Interleaved 1F1B with 3 chunks per worker (by name it has 2), through a CSV file.
    arts, params, x, labels = make(6)
    P.write_schedule(tmp_path / "i3.csv", P.schedule("interleaved1f1b", 6, 4, chunks=3))
    plans = P.read_schedule(tmp_path / "i3.csv")
    assert P.check_plans(plans, 6, 4) == [(0, 2, 4), (1, 3, 5)]
    check_run(
        P.run(arts, params, x, [labels], microbatches=4, schedule=P.Schedule(plans=plans)), plans, params, x, labels
    )
    # A hand-written one: worker 0 holds the last stage, a whole backward on stage 1, split on stage 0.
    arts, params, x, labels = make(2)
    (tmp_path / "hand.csv").write_text("1F0,1F1,1B0,,1B1\n0F0,0F1,0I0,0I1,0W1,0W0\n")
    plans = P.read_schedule(tmp_path / "hand.csv")
    check_run(
        P.run_inprocess(arts, params, x, [labels], microbatches=2, schedule=P.Schedule(plans=plans)),
        plans,
        params,
        x,
        labels,
    )


def test_run_takes_the_trainers_words_a_schedule_and_a_runner_value():
    """Issue 71: ``run`` speaks as the Trainer does: ``schedule=`` a name, plans or a ``Schedule``, the runner's
    options on ``InProcess``/``Ray`` (the contract's ``schedule_name=`` and ``devices=`` too); what one step cannot
    do (``"auto"``, replicas) is one error."""
    arts, params, x, labels = make(2)
    plans = P.schedule("zbh1", 2, 2)
    loss, grads = jax.value_and_grad(whole)(params, x, labels)
    devices = [[jax.devices()[0]]] * 2
    r = P.run(arts, params, x, [labels], microbatches=2, schedule=P.Schedule(plans=plans), runner=P.InProcess(devices))
    np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
    assert r.schedule == "custom" and {e.kind for e in r.events} == {"F", "I", "W"}
    # The contract's spellings: plans as schedule=, a name as schedule_name=, devices= for InProcess(devices=).
    again = P.run(arts, params, x, [labels], microbatches=2, schedule=plans, devices=devices)  # the contract's spelling
    assert again.schedule == "custom" and again.loss == r.loss
    named = P.run(
        arts, params, x, [labels], microbatches=2, schedule_name="zbh1", devices=devices
    )  # the contract's spelling
    assert named.schedule == "zbh1" and named.loss == r.loss
    with pytest.raises(vs.VjpsplitError, match=r"run\(schedule_name=\) and schedule= say the same thing"):
        P.run(
            arts, params, x, [labels], microbatches=2, schedule="1f1b", schedule_name="zbh1"
        )  # the contract's spelling
    with pytest.raises(vs.VjpsplitError, match=r"Schedule\('auto'\) plans from the steps a Trainer measures"):
        P.run(arts, params, x, [labels], microbatches=2, schedule=P.Schedule("auto"))
    with pytest.raises(vs.VjpsplitError, match=r"run takes one replica of every stage, not data_parallel=2"):
        P.run(arts, params, x, [labels], microbatches=2, runner=P.InProcess(data_parallel=2))
    with pytest.raises(vs.VjpsplitError, match=r"run\(devices=\) places stages in this process"):
        P.run(arts, params, x, [labels], microbatches=2, runner="ray", devices=devices)  # the contract's spelling


def test_bad_plans_are_refused_by_the_runners(tmp_path):
    arts, params, x, labels = make(2)
    plans = P.schedule("1f1b", 2, 2)
    with pytest.raises(vs.VjpsplitError, match=r"rank 0: action 0F2 is missing \(stage 0, microbatch 2\)"):
        P.run(arts, params, x, [labels], microbatches=3, schedule=P.Schedule(plans=plans))
    with pytest.raises(vs.VjpsplitError, match="rank 1: action 0F1 runs stage 0, which rank 0 holds"):
        P.run(
            arts,
            params,
            x,
            [labels],
            microbatches=2,
            schedule=P.Schedule(plans=[plans[1] + plans[0][:1], plans[0][1:]]),
        )
    plain = [
        vs.export(
            hidden,
            *[
                jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params[0]),
                jax.ShapeDtypeStruct((BATCH // 2, D), jnp.float32),
            ],
            platforms="cpu",
        ),
        arts[1],
    ]
    zb = P.schedule("zbh1", 2, 2)
    with pytest.raises(vs.VjpsplitError, match="needs the split backward: export stage 0"):
        P.run(plain, params, x, [labels], microbatches=2, schedule=P.Schedule(plans=zb))
    with pytest.raises(vs.VjpsplitError, match="multiple of 2 microbatches, not 3"):
        P.run(*make(4)[:3], [labels], microbatches=3, schedule="interleaved1f1b")
    with pytest.raises(vs.VjpsplitError, match="at least 4 microbatches"):
        P.run(*make(4)[:3], [labels], microbatches=2, schedule="dualpipev")
