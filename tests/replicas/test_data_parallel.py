"""Data parallel x pipeline on 8 CPU devices: N replicas of every stage, one gradient reduction per stage per
step, the optimizer state sharded across the replicas (ZeRO-1), equal to optax on the whole batch in one process."""

from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import export as jexport
from blocking import callback_blocks
from models import assert_trees_close, optax_reference
from stage_models import TIED_D as D
from stage_models import TIED_T as T
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs, tied, tied_batches, tied_params, tied_specs

import vjpsplit_cli as vs
from vjpsplit_cli import VjpsplitError
from vjpsplit_cli import pipeline as P


@functools.lru_cache(maxsize=None)
def tied_stages():
    return vs.export_stages(tied, *tied_specs(), wrt="params", platforms="cpu")


@functools.lru_cache(maxsize=None)
def gpt_stages():
    return vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")


CLIP = 0.5
RTOL, ATOL = 1e-6, 1e-7  # f32: the replicas' sums and the one-process gradient differ in rounding only


def _reference(fn, params, tx, batches, clip=CLIP):
    return optax_reference(fn, params, optax.chain(optax.clip_by_global_norm(clip), tx), batches)


def _on_replicas(tr, n):
    """Every stage's parameters whole on each of its n distinct devices, its optimizer state spread over them."""
    seen = set()
    for t, devs in zip(tr.backend.trainers, tr.placement):
        assert len(devs) == n and not seen & set(devs)
        seen |= set(devs)
        for r, d in zip(t.worker.replicas, devs):
            assert all(a.devices() == {d} for a in jax.tree_util.tree_leaves(r.params))
        mu = [v for k, v in t.state.items() if "/mu/" in k]
        assert mu and all({s.device for s in v.addressable_shards} == set(devs) for v in mu)


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_pp2_dp4_tied_and_clipped_equals_optax_on_the_whole_batch(schedule):
    params, tx, batches = tied_params(), optax.adam(1e-2), tied_batches(3)
    with P.Trainer(
        tied_stages(),
        params,
        optimizer=tx,
        microbatches=4,
        schedule=schedule,
        clip_global_norm=CLIP,
        runner=P.InProcess(data_parallel=4),
    ) as tr:
        # The last step timed: the worker threads' path (replicas one after another) gives the same result.
        losses = [tr.step(b, timed=i == 2) for i, b in enumerate(batches)]
        ref_losses, ref_params = _reference(tied, params, tx, batches)
        np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
        assert_trees_close(tr.params(), ref_params, rtol=RTOL, atol=ATOL)
        _on_replicas(tr, 4)
        assert [t.worker.reductions for t in tr.backend.trainers] == [3, 3]  # one per stage per step
        want = np.mean([float(tied(ref_params, *b)) for b in tied_batches(1, seed=9)])
        np.testing.assert_allclose(tr.evaluate(tied_batches(1, seed=9)[0]), want, rtol=1e-5)


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_pp4_dp2_gpt_with_its_tied_embedding_equals_optax(schedule):
    params, tx = gpt_params(), optax.adamw(1e-2, weight_decay=0.1)
    batches = [gpt_batch(8, seed=60 + i) for i in range(2)]
    with P.Trainer(
        gpt_stages(),
        params,
        optimizer=tx,
        microbatches=2,
        schedule=schedule,
        clip_global_norm=CLIP,
        runner=P.InProcess(data_parallel=2),
    ) as tr:
        losses = [tr.step(b) for b in batches]
        ref_losses, ref_params = _reference(gpt, params, tx, batches)
        np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
        assert_trees_close(tr.params(), ref_params, rtol=RTOL, atol=ATOL)
        _on_replicas(tr, 2)


def test_an_untimed_pp_by_dp_step_sums_its_tied_leaf_on_devices_and_updates_before_it_reads_anything_back(
    monkeypatch,
):
    from fetches import step_noting_fetches

    batch = tied_batches(1, rows=16)[0]
    with P.Trainer(
        tied_stages(), tied_params(), optimizer=optax.adam(1e-2), microbatches=2, runner=P.InProcess(data_parallel=2)
    ) as tr:
        tr.step(batch)  # compiled and warm
        loss, seen = step_noting_fetches(tr, batch, monkeypatch)  # any np.asarray of a device array raises
        # Both stages' updates (each holds the tied leaf, summed over them) before the step reads back its losses.
        assert seen[:2] == ["update", "update"] and set(seen[2:]) == {"fetch"}, seen
        assert np.isfinite(loss) and np.isfinite(tr.history[-1].grad_norm)


def test_an_optimizer_that_couples_leaves_stays_exact_on_sharded_state():
    # clip_by_global_norm inside the optimizer: a reduction over every leaf of every stage, here over shards.
    params, batches = tied_params(), tied_batches(2, rows=16)
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    with P.Trainer(tied_stages(), params, optimizer=tx, microbatches=2, runner=P.InProcess(data_parallel=4)) as tr:
        losses = [tr.step(b) for b in batches]
        ref_losses, ref_params = optax_reference(tied, params, tx, batches)
        np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
        assert_trees_close(tr.params(), ref_params, rtol=RTOL, atol=ATOL)
        assert any(not v.sharding.is_fully_replicated for v in tr.backend.trainers[0].state.values())


_REDUCTION = re.compile(r"\b(all-reduce|reduce-scatter)(-start)?\(")


def _programs(dump, before):
    """The optimized HLO text of each program compiled since ``before`` (file names), by file name."""
    return {p.name: p.read_text() for p in dump.glob("*after_optimizations.txt") if p.name not in before}


@pytest.mark.parametrize("m", [4, 8])
def test_each_stage_reduces_its_weight_gradients_once_per_step(hlo_dump, m):
    before = {p.name for p in hlo_dump.iterdir()}
    with P.Trainer(
        tied_stages(),
        tied_params(),
        optimizer=optax.adam(1e-2),
        microbatches=m,
        runner=P.InProcess(data_parallel=4),
        schedule="zbh1",
    ) as tr:
        tr.step(tied_batches(1, rows=8 * m)[0])
        progs = _programs(hlo_dump, before)
        runs = [t.worker.reductions for t in tr.backend.trainers]
        tr.step(tied_batches(1, rows=8 * m, seed=6)[0])
        assert not [n for n in _programs(hlo_dump, before) if n not in progs]  # the second step compiles nothing
        runs2 = [t.worker.reductions for t in tr.backend.trainers]
        # The count sees a per-microbatch reduction (benchmarks/data_parallel.py's comparison): m a step.
        for t in tr.backend.trainers:
            t.worker.per_microbatch = True
        tr.step(tied_batches(1, rows=8 * m, seed=7)[0])
        per_mb_runs = [t.worker.reductions - r for t, r in zip(tr.backend.trainers, runs2)]
    counts = {n: len(_REDUCTION.findall(t)) for n, t in progs.items()}
    reducing = {n: c for n, c in counts.items() if c}
    # The per-microbatch programs (F, B, W, run m times a step) are compiled and hold no reduction at all ...
    per_mb = [n for n in progs if re.search(r"jit_(run|b_input|b_weight|fused|_lambda)", n)]
    assert per_mb and not [n for n in per_mb if counts[n]], reducing
    # ... the one program that does is each stage's reduction: one reduce-scatter (an all-f32 model), run once a step.
    assert reducing and all("reduce_replicas" in n and c == 1 for n, c in reducing.items()), reducing
    assert all("reduce-scatter(" in progs[n] for n in reducing)
    assert runs == [1, 1] and runs2 == [2, 2] and per_mb_runs == [m, m]


def test_each_device_holds_a_quarter_of_the_optimizer_state():
    with P.Trainer(
        tied_stages(), tied_params(), optimizer=optax.adam(1e-2), microbatches=2, runner=P.InProcess(data_parallel=4)
    ) as tr:
        tr.step(tied_batches(1, rows=16)[0])
        for t, devs in zip(tr.backend.trainers, tr.placement):
            whole = {k: v for k, v in t.state.items()}
            total = sum(v.nbytes for v in whole.values())
            # Kept whole on every device (docs/howto/data-parallel.md): the step count, and leaves with no dimension that
            # divides by 4 (the scalar 'temp': its mu and nu).
            kept = sum(v.nbytes for k, v in whole.items() if k.endswith("count") or k.endswith("temp"))
            for d in devs:
                mine = sum(s.data.nbytes for v in whole.values() for s in v.addressable_shards if s.device == d)
                assert mine <= (total - kept) / 4 + kept, (t.stage_index, mine, total, kept)
            assert kept < total / 4  # the bound is not the whole state
            replicated = {k: v for k, v in t.state.items() if v.sharding.is_fully_replicated}
            assert set(replicated) == {k for k in whole if k.endswith("count") or k.endswith("temp")}


def test_memory_shows_each_replica_holding_half_its_stages_optimizer_state():
    """``Trainer.memory()`` per device: at data_parallel=2 each replica's device holds its stage's parameters whole
    and half the optimizer state of data_parallel=1 (ZeRO-1), less what stays whole on every replica."""
    got = {}
    for n in (1, 2):
        with P.Trainer(
            tied_stages(),
            tied_params(),
            optimizer=optax.adam(1e-2),
            microbatches=2,
            runner=P.InProcess(data_parallel=n),
        ) as tr:
            tr.step(tied_batches(1, rows=16)[0])
            got[n] = tr.memory()
    one, two = got[1], got[2]
    assert [r.stages for r in one] == [(0,), (1,)] and [r.stages for r in two] == [(0,), (0,), (1,), (1,)]
    assert len({r.device for r in one}) == 2 and len({r.device for r in two}) == 4  # a device per replica
    # Whole on every replica: the step count (int32), and on stage 1 the scalar 'temp''s mu and nu (f32 each).
    kept = {0: 4, 1: 4 + 8}
    for s, whole in enumerate(one):
        for r in two[2 * s : 2 * s + 2]:
            # 1F1B's last stage runs each B inside its F: it holds no residuals between them.
            assert r.params == whole.params and (r.peak_residuals > 0) == (s == 0)
            assert r.optimizer == (whole.optimizer - kept[s]) // 2 + kept[s], (s, r, whole)
        assert sum(r.optimizer for r in two[2 * s : 2 * s + 2]) == whole.optimizer + kept[s]


def test_a_checkpoint_at_dp4_continues_at_dp2_and_in_one_process(tmp_path):
    params, tx, batches = tied_params(), optax.adam(1e-2), tied_batches(4)
    never_stopped_losses, never_stopped = _reference(tied, params, tx, batches)
    with P.Trainer(
        tied_stages(), params, optimizer=tx, microbatches=2, clip_global_norm=CLIP, runner=P.InProcess(data_parallel=4)
    ) as tr:
        first = [tr.step(b) for b in batches[:2]]
        tr.save(tmp_path / "ck")
    np.testing.assert_allclose(first, never_stopped_losses[:2], rtol=RTOL)
    with P.Trainer.restore(tmp_path / "ck", tied_stages(), optimizer=tx, runner=P.InProcess(data_parallel=2)) as again:
        assert again.step_count == 2 and again.clip_global_norm == CLIP
        np.testing.assert_allclose([again.step(b) for b in batches[2:]], never_stopped_losses[2:], rtol=RTOL)
        assert_trees_close(again.params(), never_stopped, rtol=RTOL, atol=ATOL)
    p, opt_state, step = P.load_checkpoint(tmp_path / "ck", optimizer=tx)
    assert step == 2
    # The saved state is optax's own for the whole model: one process goes on from it.
    ref = optax.chain(optax.clip_by_global_norm(CLIP), tx)
    state = (optax.EmptyState(), opt_state)
    grad = jax.jit(jax.value_and_grad(tied))
    for b in batches[2:]:
        _, g = grad(p, *b)
        u, state = ref.update(g, state, p)
        p = optax.apply_updates(p, u)
    assert_trees_close(jax.tree_util.tree_map(np.asarray, p), never_stopped, rtol=RTOL, atol=ATOL)


def test_stages_exported_with_data_parallel_train_on_that_many_replicas(tmp_path):
    # export_stages(data_parallel=2) (the CLI's --data-parallel 2) records N; the Trainer takes it when not given.
    (b,) = jexport.symbolic_shape("b")
    S = jax.ShapeDtypeStruct
    specs = jax.tree_util.tree_map(lambda a: S(np.shape(a), a.dtype), tied_params())
    st = vs.export_stages(
        tied, specs, S((b, T), jnp.int32), S((b, T), jnp.int32), wrt="params", platforms="cpu", data_parallel=2
    )
    st.save(tmp_path / "st")
    params, tx, batches = tied_params(), optax.adam(1e-2), tied_batches(2, rows=8)
    with P.Trainer(vs.load_stages(tmp_path / "st"), params, optimizer=tx, microbatches=2, clip_global_norm=CLIP) as tr:
        assert tr.data_parallel == 2
        losses = [tr.step(b) for b in batches]
        _on_replicas(tr, 2)
    ref_losses, ref_params = _reference(tied, params, tx, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_trees_close(tr.params(), ref_params, rtol=RTOL, atol=ATOL)


def test_data_parallel_refusals():
    st, params = tied_stages(), tied_params()
    with pytest.raises(VjpsplitError, match=r"data_parallel=0: give the number of replicas"):
        P.Trainer(st, params, optimizer=optax.sgd(0.1), microbatches=2, runner=P.InProcess(data_parallel=0))
    with pytest.raises(VjpsplitError, match=r"data_parallel=8 with 2 workers needs 16 devices, this host has 8"):
        P.Trainer(st, params, optimizer=optax.sgd(0.1), microbatches=2, runner=P.InProcess(data_parallel=8))
    with pytest.raises(VjpsplitError, match=r"stage 1 is given 1 devices"):
        P.Trainer(
            st,
            params,
            optimizer=optax.sgd(0.1),
            microbatches=2,
            runner=P.InProcess(devices=[jax.devices()[:2], jax.devices()[2:3]], data_parallel=2),
        )
    with P.Trainer(st, params, optimizer=optax.sgd(0.1), microbatches=2, runner=P.InProcess(data_parallel=4)) as tr:
        with pytest.raises(VjpsplitError, match=r"data_parallel=4: a microbatch of 6 rows does not split into 4"):
            tr.step(tied_batches(1, rows=12)[0])
        tr.step(tied_batches(1, rows=8)[0])  # the Trainer goes on


def _bitwise(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb) and la
    for x, y in zip(la, lb):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


@pytest.mark.parametrize("to", ["host", "files"])
def test_offload_with_replicas_trains_bitwise_as_without(to, tmp_path, monkeypatch):
    from vjpsplit_cli.pipeline.runtime.offload import ResidualFiles

    written = []
    writer = ResidualFiles.writer
    monkeypatch.setattr(
        ResidualFiles, "writer", lambda self, path, res: (written.append(path), writer(self, path, res))[1]
    )
    off = "host" if to == "host" else P.Offload(to="files", directory=str(tmp_path / "off"))

    def train(offload):
        with P.Trainer(
            tied_stages(), tied_params(), optimizer=optax.adam(1e-2), microbatches=4, schedule="gpipe",
            runner=P.InProcess(data_parallel=4, offload=offload),
        ) as tr:  # fmt: skip
            # GPipe: the first stage holds every microbatch until its B, so offload lowers its peak. The last step
            # timed and warm: the peak is what each device held.
            losses = [tr.step(b, timed=i == 2) for i, b in enumerate(tied_batches(3))]
            return losses, tr.params(), [t.worker.peak_residual_bytes for t in tr.backend.trainers]

    ref_losses, ref_params, ref_peaks = train(None)
    losses, params, peaks = train(off)
    assert losses == ref_losses
    _bitwise(params, ref_params)
    assert all(p <= r for p, r in zip(peaks, ref_peaks))
    if to == "host":
        assert peaks[0] < ref_peaks[0]  # the first stage's replicas hold less (a file's write may still be under way)
    else:
        # Each replica's own file: stage 0's four replicas write apart, and every file is gone once read back.
        assert {re.search(r"-stage0-(r\d)-", p)[1] for p in written if "-stage0-" in p} == {"r0", "r1", "r2", "r3"}
        assert os.listdir(tmp_path / "off") == []


def test_an_untimed_step_with_a_stuck_replica_ends_at_step_timeout_naming_the_op(monkeypatch, tmp_path):
    """data_parallel=2, the default untimed step, with one replica of stage 1 stuck in a host callback in its
    forward of microbatch 1: within step_timeout + 2 s one error names that operation (inside its dispatch, or
    dispatched and not finished: a replica group's operation is finished only once every replica's is) and the
    report is written; the Trainer then refuses to step on its half-run stages."""
    import json
    import time

    report = tmp_path / "hang.json"
    with P.Trainer(
        tied_stages(),
        tied_params(),
        optimizer=optax.adam(1e-2),
        microbatches=2,
        runner=P.InProcess(data_parallel=2),
        observe=P.Observe(hang_report=report),
    ) as tr:
        hold, release = callback_blocks(monkeypatch, stage=1, mb=1, device=tr.placement[1][1])
        try:
            tr.step(tied_batches(1, rows=8)[0])  # compiled, the callback's too
            tr.backend.step_timeout = 1.5
            hold.set()
            t0 = time.monotonic()
            with pytest.raises(VjpsplitError) as info:
                tr.step(tied_batches(1, rows=8, seed=6)[0])
            assert time.monotonic() - t0 < 1.5 + 2.0
            text = str(info.value)
            assert text.startswith("the step did not finish within step_timeout=1.5 s; ")
            assert re.search(r"worker 1: running (F stage 1 mb 1 since|or waiting: F stage 1 mb 1 \(dispatched)", text)
            assert json.loads(report.read_text())["message"] == text
            with pytest.raises(VjpsplitError, match="an earlier step timed out"):
                tr.step(tied_batches(1, rows=8)[0])
        finally:
            release.set()


def test_an_untimed_steps_record_asks_every_replica_whether_an_operation_finished():
    """What a replica group hands on (a ``Parts``, one array per replica) is probed on every replica's device:
    the operation counts as finished only when every replica's part is (and its reduction, if it dispatched one)."""
    from vjpsplit_cli.pipeline.runtime import untimed
    from vjpsplit_cli.pipeline.runtime.replicas import Parts
    from vjpsplit_cli.pipeline.schedules.ops import Op

    devs = jax.devices()[:2]
    small, big = jax.device_put(jnp.ones(2), devs[0]), jax.device_put(jnp.ones((3, 3)), devs[1])
    parts = Parts(({"a": small, "b": jax.device_put(jnp.ones(5), devs[0])}, big))
    probes = untimed._probe(parts)
    assert [p.devices() for p in probes] == [{devs[0]}, {devs[1]}] and probes[0] is small

    class NotYet:
        def is_ready(self):
            return False

    rec = untimed.Dispatched([[Op("F", 0, 0)]], 1)
    rec.ops[0].append((Op("F", 0, 0), rec.t0, [small, NotYet()]))  # replica 0's part ready, replica 1's not
    rec.count[0] = 1
    (now,), _ = rec.nows()
    assert now[0] == "pending" and now[1] == Op("F", 0, 0)
    rec.ops[0][0] = (Op("F", 0, 0), rec.t0, probes)
    (now,), _ = rec.nows()
    assert now[0] == "finished"
    # A stage's last gradient operation dispatches its cross-replica reduction: finished once that is too.
    with P.Trainer(
        tied_stages(), tied_params(), optimizer=optax.sgd(0.1), microbatches=2, runner=P.InProcess(data_parallel=2)
    ) as tr:
        group = tr.backend.trainers[1].worker
        reduced = jax.device_put(jnp.ones(3), devs[0])
        rec = untimed.Dispatched([[Op("B", 0, 1), Op("B", 1, 1)]], 2)
        group.grads = None  # not reduced yet: the op's own outputs
        rec.end(0, Op("B", 0, 1), parts, group)
        group.grads = {"w": reduced}
        rec.end(0, Op("B", 1, 1), parts, group)
        assert [len(e[2]) for e in rec.ops[0]] == [2, 3] and rec.ops[0][1][2][2] is reduced


def test_evaluate_on_replicas_with_a_concrete_per_replica_batch_equals_one_process():
    # Exported for 2 rows per replica call (data_parallel=2 recorded): training worked, evaluate raised jax's raw
    # "Shape mismatch" (it ran each whole microbatch on the first replica).
    S = jax.ShapeDtypeStruct
    specs = jax.tree_util.tree_map(lambda a: S(np.shape(a), a.dtype), tied_params())
    st = vs.export_stages(
        tied, specs, S((2, T), jnp.int32), S((2, T), jnp.int32), wrt="params", platforms="cpu", data_parallel=2
    )
    params, (batch,) = tied_params(), tied_batches(1, rows=8)
    with P.Trainer(st, params, optimizer=optax.sgd(0.1), microbatches=2) as tr:
        loss, outputs = tr.evaluate(batch, outputs=True)
        np.testing.assert_allclose(loss, tied(params, *batch), rtol=RTOL)
        assert [np.shape(o[0]) for o in outputs] == [(4, T, D)] * 2  # each microbatch whole, its replicas joined
        with pytest.raises(VjpsplitError, match=r"pass a batch of 8 rows"):
            tr.evaluate(tied_batches(1, rows=16)[0])
        np.testing.assert_allclose(tr.step(batch), loss, rtol=RTOL)  # the step's loss on the same parameters


def test_a_steps_aux_on_replicas_is_the_mean_of_theirs_and_a_mean_metric_equals_one_process():
    """export_stages(has_aux=True) at data_parallel=2: each replica's aux over its half of a microbatch, their mean
    per microbatch (timed, untimed and evaluate): the accuracy and a mean activation are one process's, the rows a
    replica's half."""
    from stage_models import aux_loss, aux_mean, dropout_batches, dropout_params, dropout_specs, one_process_with_aux

    p, _key, x, y = dropout_specs(dropout_params())
    stages = vs.export_stages(aux_loss, p, x, y, wrt="params", platforms="cpu", has_aux=True)
    batches = dropout_batches(3)
    kw = {"optimizer": optax.adam(1e-2), "microbatches": 4, "runner": P.InProcess(data_parallel=2)}
    with P.Trainer(stages, dropout_params(), **kw) as tr:
        got = [tr.step(batches[0], timed=True), tr.step(batches[1])]
        evaluated = tr.evaluate(batches[2])
    losses, auxes, _ = one_process_with_aux(aux_loss, dropout_params(), batches, 4, optax.adam(1e-2))
    np.testing.assert_allclose([loss for loss, _ in got], losses[:2], rtol=1e-6)
    for (_, aux), want in [*zip(got, auxes), (evaluated, auxes[2])]:
        want = aux_mean(want)
        np.testing.assert_allclose(aux["accuracy"], want["accuracy"], rtol=1e-6)
        np.testing.assert_allclose(aux["first"][0], want["first"][0], rtol=1e-6)
        assert aux["rows"] == 2 and want["rows"] == 4  # a count is each replica's part's


def test_a_timed_steps_trace_shows_every_replica_on_its_device_and_the_reduction(tmp_path):
    """data_parallel=2, a timed step traced: every replica's copy of every operation is an event and a slice
    (``F s1 mb0 r1``) on a worker-level track of its replica and on its own device's; each replica sends to the same replica of
    the next stage; each stage's cross-replica reduction is a ``reduce replicas`` slice on its worker's track,
    after the stage's last backward and before its update. The file reads back with the replicas."""
    from tracecheck import check_trace_file, flow_pairs, op_slices

    from vjpsplit_cli.pipeline.schedules.tracefile import read_trace

    with P.Trainer(
        tied_stages(),
        tied_params(),
        optimizer=optax.adam(1e-2),
        microbatches=2,
        runner=P.InProcess(data_parallel=2),
        observe=P.Observe(trace_dir=tmp_path / "traces"),
    ) as tr:
        tr.step(tied_batches(1, rows=8)[0], timed=True)
        r = tr.last_result
        devices = [[str(d) for d in g] for g in tr.placement]
    ops = {(e.kind, e.stage, e.mb, e.replica) for e in r.events}
    plan = {(op.kind, op.stage, op.mb) for ops_ in r.plans for op in ops_}
    assert len(r.events) == len(ops) == 2 * len(plan) and ops == {(*k, i) for k in plan for i in (0, 1)}
    assert len(r.modeled_timeline()) == len(plan)  # the replay reads one copy per operation
    doc = check_trace_file(tmp_path / "traces" / "step-1.trace.json")
    slices = op_slices(doc)
    assert sorted(slices) == sorted(f"{k} s{s} mb{m} r{i}" for k, s, m, i in ops)
    tracks = {ev["tid"]: ev["args"]["name"] for ev in doc["traceEvents"] if ev["name"] == "thread_name"}
    for s, names in enumerate(devices):
        for i, name in enumerate(names):
            (tid,) = [t for t, n in tracks.items() if n == f"worker {s} stage {s} replica {i} {name}"]
            on = sorted(ev["name"] for ev in doc["traceEvents"] if ev["ph"] == "X" and ev["tid"] == tid)
            assert on == sorted(f"{k} s{s} mb{m} r{i}" for k, st, m, j in ops if (st, j) == (s, i))
    assert flow_pairs(doc) == sorted(  # the last stage's F ran its B (1F1B): the cotangent flows from that F
        (f"{a} s{s} mb{m} r{i}", f"{b} s{t} mb{m} r{i}")
        for a, b, s, t in (("F", "F", 0, 1), ("F", "B", 1, 0))
        for m in range(2)
        for i in range(2)
    )
    reductions = [p for p in r.phases if p.name == "reduce replicas"]
    assert sorted(p.worker for p in reductions) == [0, 1]
    for p in reductions:
        last = max(e.end for e in r.events if e.worker == p.worker and e.kind != "F")
        (update,) = [u for u in r.phases if u.worker == p.worker and u.name == "update"]
        assert last <= p.start < p.end <= update.start
    drawn = {(ev["tid"], ev["cat"]) for ev in doc["traceEvents"] if ev["ph"] == "X" and ev["name"] == "reduce replicas"}
    assert drawn == {(1, "reduce"), (2, "reduce")}
    back = read_trace(tmp_path / "traces" / "step-1.trace.json")
    assert sorted((e.kind, e.stage, e.mb, e.replica) for e in back.events) == sorted(ops)
