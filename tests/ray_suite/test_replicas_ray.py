"""Data parallel x pipeline on Ray: each stage's actor holds its stage's N host CPU devices and runs N replicas on
them, one gradient reduction per stage per step, the optimizer state sharded across the replicas (ZeRO-1)."""

from __future__ import annotations

import numpy as np
import optax
import pytest
from models import assert_trees_close, optax_reference
from optimizer_models import model, params_, stages, V, T
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P

CLIP = 0.05  # below every step's gradient norm: clipping acts on each step
RTOL, ATOL = 1e-6, 1e-7  # f32: the replicas' sums and the one-process gradient differ in rounding only


def _batches(n, rows=8, seed=11):
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(0, V, (rows, T)).astype(np.int32), rng.integers(0, V, (rows, T)).astype(np.int32))
        for _ in range(n)
    ]


def _reference(batches):
    return optax_reference(model, params_(), optax.chain(optax.clip_by_global_norm(CLIP), optax.adam(1e-2)), batches)


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_ray_pp2_dp2_tied_and_clipped_equals_optax_and_its_checkpoint_continues_in_one_process(
    ray_session, schedule, tmp_path
):
    batches, tx = _batches(3), optax.adam(1e-2)
    ref_losses, ref_params = _reference(batches)

    def reductions(actor):  # defined here: Ray sends a test module's function by value only from inside a test
        """Per stage the actor holds, the cross-replica reductions its replica group has run."""
        return {s: w.reductions for s, w in actor.stage_workers.items()}

    kw = dict(optimizer=tx, microbatches=2, schedule=schedule, clip_global_norm=CLIP)
    with P.Trainer(stages(), params_(), runner=P.Ray(data_parallel=2), **kw) as tr:
        losses = [tr.step(b, timed=i == 1) for i, b in enumerate(batches[:2])]
        r = tr.last_result
        assert r.runner == "ray"
        # Timed: every replica's operations, and each stage's cross-replica reduction on its worker's track.
        assert {(e.stage, e.replica) for e in r.events} == {(0, 0), (0, 1), (1, 0), (1, 1)}
        assert sorted(p.worker for p in r.phases if p.name == "reduce replicas") == [0, 1]
        assert min(h.grad_norm for h in tr.history) > CLIP  # clipping acted
        # Each actor: its stage on 2 devices of its own process, Adam's moments sharded across them.
        assert [len(set(d)) for d in tr.placement] == [2, 2]
        memory = tr.memory()  # per actor's device: its replica's half of the stage's optimizer state (ZeRO-1)
        assert [(r.worker, r.stages) for r in memory] == [(0, (0,)), (0, (0,)), (1, (1,)), (1, (1,))], memory
        for w, actor in enumerate(tr.backend.rp.actors):
            got = ray_session.get(actor.optimizer_bytes.remote())
            assert len(got) == 1, got  # its one stage, on replicas
            for stage, (most, whole) in got.items():
                count = 4  # the step count (int32): the one leaf kept whole on every replica
                assert most == (whole - count) // 2 + count, (stage, most, whole)
                mine = [r for r in memory if r.worker == w]
                # 1F1B's last stage runs each B inside its F (no residual held between them); ZB-H1's keeps them.
                held = stage == 0 or schedule == "zbh1"
                assert [r.optimizer for r in mine] == [most, most] and all((r.peak_residuals > 0) == held for r in mine)
                assert sorted(r.device for r in mine) == sorted(tr.placement[stage])  # the actor's device names
            runs = ray_session.get(actor.__ray_call__.remote(reductions))
            assert list(runs.values()) == [2], runs  # one cross-replica reduction per stage per step
        tr.save(tmp_path / "ck")
        if schedule == "zbh1":  # the run goes on on Ray: 3 steps equal 3 of optax
            losses.append(tr.step(batches[2]))
            np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
            assert_trees_close(tr.params(), ref_params, rtol=RTOL, atol=ATOL)
            want = float(np.mean([float(model(ref_params, *b)) for b in _batches(1, seed=12)]))
            np.testing.assert_allclose(tr.evaluate(_batches(1, seed=12)[0]), want, rtol=1e-5)
            return
    np.testing.assert_allclose(losses, ref_losses[:2], rtol=RTOL)
    # Saved on Ray at DP 2 in the whole model's form: one process at DP 1 continues it equal to an unbroken run.
    with P.Trainer.restore(tmp_path / "ck", stages(), optimizer=tx) as again:
        assert again.step_count == 2 and again.data_parallel == 1
        np.testing.assert_allclose(again.step(batches[2]), ref_losses[2], rtol=RTOL)
        assert_trees_close(again.params(), ref_params, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
@pytest.mark.parametrize("workers, replicas", [(2, 4), (4, 2)], ids=["pp2-dp4", "pp4-dp2"])
def test_ray_pp_by_dp_as_in_process_equals_optax(ray_session, workers, replicas, schedule):
    """PP 2 x DP 4 (the tied model) and PP 4 x DP 2 (the GPT: a tied embedding, a skip), clipped, on Ray."""
    if workers == 2:
        fn, params, batches, tx = model, params_(), _batches(2, rows=8), optax.adam(1e-2)
        st = stages()
    else:
        fn, params, tx = gpt, gpt_params(), optax.adamw(1e-2, weight_decay=0.1)
        batches = [gpt_batch(8, seed=60 + i) for i in range(2)]
        st = vs.export_stages(gpt, *gpt_specs(params), wrt="params", platforms="cpu")
    assert len(st) == workers
    kw = dict(optimizer=tx, microbatches=2, schedule=schedule, clip_global_norm=CLIP)
    with P.Trainer(st, params, runner=P.Ray(data_parallel=replicas), **kw) as tr:
        losses = [tr.step(b) for b in batches]
        assert [len(set(d)) for d in tr.placement] == [replicas] * workers
        got = tr.params()
    ref_losses, ref_params = optax_reference(fn, params, optax.chain(optax.clip_by_global_norm(CLIP), tx), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_trees_close(got, ref_params, rtol=RTOL, atol=ATOL)
