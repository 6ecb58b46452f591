"""Trainer(schedule="auto"): a timed first step, then auto_schedule's plans for its costs; equal to one process.

Also ``trainer.costs()`` (measured F, B, W and send times) and memory limits in
microbatches and in bytes per worker, counted from the stages' manifests.
"""

from __future__ import annotations

import functools
import statistics
import time
import types

import jax
import numpy as np
import optax
import pytest
from models import assert_trees_close, optax_reference
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.files.dtypes import dtype_from_name
from vjpsplit_cli.files.shapes import concrete_shape
from vjpsplit_cli.pipeline.runtime.result import step_result
from vjpsplit_cli.pipeline.schedules.costs import Costs
from vjpsplit_cli.pipeline.schedules.modeled import memory_peaks, modeled_makespan
from vjpsplit_cli.pipeline.schedules.offloading import byte_peaks
from vjpsplit_cli.pipeline.stages.exporting import module_flops
from vjpsplit_cli.pipeline.stages.report import stage_rows
from vjpsplit_cli.pipeline.training import measured
from vjpsplit_cli.pipeline.training.measured import CostSamples, counted, seconds, send_gaps
from vjpsplit_cli.pipeline.schedules.timeline import Event

M, ROWS = 4, 2  # microbatches of 2 rows: batches of 8


@functools.lru_cache(maxsize=None)
def _stages():
    return vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")


def _batches(n, seed=40):
    return [gpt_batch(M * ROWS, seed=seed + i) for i in range(n)]


def _check_costs(costs, S):
    assert set(costs) == {"F", "B", "W", "comm", "gap", "transfer"}
    assert set(costs["transfer"]) == {"out", "back"} and all(v > 0 for v in costs["transfer"].values())
    assert all(len(costs[k]) == S and all(v >= 0 for v in costs[k]) for k in "FBW")
    assert all(v > 0 for v in costs["F"]) and all(v > 0 for v in costs["W"]) and costs["comm"] > 0 and costs["gap"] >= 0
    # Every stage's B takes time but the first's: cut by FLOPs (from a whole backward, or an I that ran its W:
    # ``StageWorker.reset``), the first stage's input part has none.
    assert all(v > 0 for v in costs["B"][1:])


def test_auto_trains_equal_to_one_process_and_records_its_plans():
    """Without trial steps (``trial_rounds=0``) auto keeps the plans the model rates fastest."""
    params, batches, tx = gpt_params(), _batches(3), optax.adamw(1e-2)
    tr = P.Trainer(_stages(), params, optimizer=tx, schedule=P.Schedule("auto", trial_rounds=0), microbatches=M)
    assert tr.plan.name == "auto" and tr.plan.plans == []  # nothing planned before the measuring step
    losses = [tr.step(batches[0])]
    # Every stage has the split backward and no limit binds: ZB-H1 times the first step, W included.
    assert tr.last_result.schedule == "zbh1" and tr.history[0].schedule == "zbh1"
    first_costs, planned = tr.costs(), tr.plan.plans
    _check_costs(first_costs, 4)
    assert tr.history[0].modeled_makespan == pytest.approx(modeled_makespan(P.schedule("zbh1", 4, M), first_costs))
    assert tr.auto.makespan == pytest.approx(modeled_makespan(planned, first_costs))
    assert tr.auto.makespan <= tr.history[0].modeled_makespan  # never slower than the built-in it measured with
    losses.append(tr.step(batches[1]))  # auto's plans, timed too; then planned again for its costs alone
    assert tr.last_result.schedule == "auto" and tr.last_result.plans == planned
    costs = tr.costs()
    assert costs != first_costs  # the first step no longer counts
    assert tr.history[1].modeled_makespan == pytest.approx(modeled_makespan(planned, costs))
    losses.append(tr.step(batches[2]))
    assert [(h.schedule, h.measuring) for h in tr.history] == [
        ("zbh1", True), ("auto", True), ("auto", False)
    ]  # fmt: skip
    assert tr.last_result.plans == tr.plan.plans and P.check_plans(tr.plan.plans, 4, M) == [(s,) for s in range(4)]
    assert tr.costs() == costs  # an untimed step adds nothing
    assert tr.history[2].modeled_makespan == pytest.approx(modeled_makespan(tr.plan.plans, costs))
    ref_losses, ref_params = optax_reference(gpt, params, tx, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(tr.params(), ref_params, rtol=1e-4, atol=1e-6)
    # A later timed step adds its times to the kept ones, and auto plans again for them.
    ran = tr.plan.plans
    tr.step(_batches(1, seed=45)[0], timed=True)
    assert tr.costs() != costs and not tr.history[-1].measuring
    assert tr.history[-1].modeled_makespan == pytest.approx(modeled_makespan(ran, tr.costs()))
    assert tr.auto.makespan == pytest.approx(modeled_makespan(tr.plan.plans, tr.costs()))


def test_costs_medians_and_a_whole_backward_cut_by_its_flops():
    """A 1F1B Trainer times whole backwards: ``costs()`` cuts each into B and W by XLA's FLOPs of the
    stage's ``bwd_input`` and ``bwd_weight``; F is the median of the step's forwards. The last stage's F runs
    its B too: its time is cut into F and B by the FLOPs of ``fwd`` and ``bwd`` first."""
    params, batches = gpt_params(), _batches(2)
    tr = P.Trainer(_stages(), params, optimizer=optax.sgd(0.1), schedule="1f1b", microbatches=M)
    for b in batches[:2]:  # untimed; the calls compile in these (the second step's for placed parameters)
        tr.step(b)
    with pytest.raises(VjpsplitError, match=r"no timed step has run yet: run trainer.step\(batch, timed=True\)"):
        tr.costs()
    tr.step(batches[0], timed=True)
    costs, events = tr.costs(), tr.last_result.events
    _check_costs(costs, 4)
    S = len(_stages())
    for s, art in enumerate(_stages()):
        times = {k: [seconds(e) for e in events if e.stage == s and e.kind == k] for k in "FB"}
        assert len(times["F"]) == len(times["B"]) == M
        if s == S - 1:  # 1F1B's last stage runs each B inside its F: that time is cut by the FLOPs of fwd and bwd
            assert times["B"] == [0.0] * M
            f, bwd = module_flops(art, "fwd"), module_flops(art, "bwd")
            fused = statistics.median(times["F"])
            assert costs["F"][s] == pytest.approx(fused * f / (f + bwd))
            whole = fused * bwd / (f + bwd)
        else:
            assert costs["F"][s] == pytest.approx(statistics.median(times["F"]))
            whole = statistics.median(times["B"])
        b, w = module_flops(art, "bwd_input"), module_flops(art, "bwd_weight")
        assert costs["B"][s] + costs["W"][s] == pytest.approx(whole)
        assert costs["B"][s] / whole == pytest.approx(b / (b + w))
    assert P.auto_schedule(_stages(), M, costs=costs)  # the form auto_schedule takes


def _activations(stages, params, batch):
    """What each stage boundary sends for one microbatch, computed by running the stages' forwards."""
    from vjpsplit_cli.pipeline.runtime.model import side_for
    from vjpsplit_cli.pipeline.runtime.worker import StageWorker

    S, dev = len(stages.artifacts), jax.local_devices()[0]
    x, side = stages.stage_batch(batch, M)[0]
    out = []
    for s, (art, p) in enumerate(zip(stages.artifacts[:-1], stages.stage_params(params))):
        x, _ = StageWorker(art, p, s, S, dev).calls.forward(p, x, *side_for(side, s, S))
        out.append(jax.tree_util.tree_leaves(x))
    return out


def test_auto_plans_with_the_send_measured_apart_not_the_timelines_gap(monkeypatch):
    """``costs()["comm"]`` is one send timed apart, with arrays shaped and typed as each boundary sends (the first
    timed step's microbatch), once per Trainer; it is what ``auto`` plans with. ``gap`` stays the timeline's."""
    from vjpsplit_cli.pipeline.training import autoplan, local_backend

    probed, planned = [], []
    real = local_backend.InProcessBackend.send_seconds

    def send_seconds(self, values, repeats):
        probed.append(([[(v.shape, v.dtype) for v in vs_] for vs_ in values], repeats))
        return [t + 1e-3 * (s + 1) for s, t in enumerate(real(self, values, repeats))]  # told apart from the gap

    plan = autoplan.auto_schedule

    def spy(*args, **kwargs):
        planned.append(dict(kwargs["costs"]))
        return plan(*args, **kwargs)

    monkeypatch.setattr(local_backend.InProcessBackend, "send_seconds", send_seconds)
    monkeypatch.setattr(autoplan, "auto_schedule", spy)
    stages, params, batches = _stages(), gpt_params(), _batches(3)
    tr = P.Trainer(stages, params, optimizer=optax.sgd(0.1), schedule="auto", microbatches=M)
    for b in batches:
        tr.step(b)
    costs = tr.costs()
    want = [[(np.shape(a), np.dtype(a.dtype)) for a in leaves] for leaves in _activations(stages, params, batches[0])]
    assert len(probed) == 1 and probed[0] == (want, measured.SEND_PROBES)  # once, as each boundary sends
    assert len(want) == 3 and costs["comm"] > 2e-3  # the mean of the probes, each 1-3 ms above the copy
    # Both replans, each auto_schedule under the limit and held to 1F1B's memory: the send measured apart.
    assert [c["comm"] for c in planned] == [costs["comm"]] * 4
    assert costs["gap"] != costs["comm"] and costs["gap"] >= 0


def test_without_a_sized_send_the_gap_stands_in_for_comm(monkeypatch):
    """Where what a stage sends cannot be sized from the microbatch, ``comm`` is the timelines' ``gap``."""
    from vjpsplit_cli.pipeline.training import local_backend, trainer

    monkeypatch.setattr(trainer, "boundary_values", lambda arts, mb: None)
    monkeypatch.setattr(local_backend.InProcessBackend, "send_seconds", lambda *a: pytest.fail("nothing to send"))
    tr = P.Trainer(_stages(), gpt_params(), optimizer=optax.sgd(0.1), schedule="1f1b", microbatches=M)
    tr.step(_batches(1)[0], timed=True)
    costs = tr.costs()
    assert costs["comm"] == costs["gap"] > 0  # an idle worker's wait for each result


def test_memory_limit_one_trains_correctly_within_it():
    params, batches, tx = gpt_params(), _batches(2, seed=50), optax.adam(1e-2)
    tr = P.Trainer(_stages(), params, optimizer=tx, schedule=P.Schedule("auto", memory_limit=1), microbatches=M)
    losses = [tr.step(b) for b in batches]
    ref_losses, ref_params = optax_reference(gpt, params, tx, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(tr.params(), ref_params, rtol=1e-4, atol=1e-6)
    # No built-in holds one microbatch: the measuring step ran auto's plans for equal costs.
    assert tr.history[0].schedule == "auto" and tr.history[0].measuring is True
    assert memory_peaks(tr.plan.plans) == [1] * 4


def _held_bytes(stages, rows):
    """Per stage, what a microbatch in flight holds by the manifests: the residuals ``inspect`` counts (F to B),
    or W's residuals and the intermediates (B to W), whichever is larger."""
    out = []
    for row, art in zip(stage_rows(stages, {"b": rows}), stages):
        m = art.manifest

        def nbytes(leaf):
            return int(np.prod(concrete_shape(leaf.shape, {"b": rows}))) * dtype_from_name(leaf.dtype).itemsize

        w = sum(nbytes(r) for r in m.stored_residuals if r.key in m.weight_residuals)
        out.append(max(row["residual_bytes"], w + sum(nbytes(c) for c in m.intermediates)))
    return out


def test_memory_limit_bytes_maps_to_microbatches_by_the_manifests():
    params, batches, tx = gpt_params(), _batches(2, seed=60), optax.adam(1e-2)
    held = _held_bytes(_stages(), ROWS)
    assert held == [360, 1004, 640, 876]  # the residuals of stage 0 are 40 bytes, its intermediates 320
    limit = 2100  # 5, 2, 3 and 2 microbatches
    tr = P.Trainer(
        _stages(), params, optimizer=tx, schedule=P.Schedule("auto", memory_limit_bytes=limit), microbatches=M
    )
    losses = [tr.step(b) for b in batches]
    assert tr.auto.limits == tuple(min(M, limit // h) for h in held) == (4, 2, 3, 2)
    # Within the bytes: by count where auto offloads nothing, else with its offloaded pairs away.
    c = Costs.of(tr.costs(), 4)
    assert all(p <= limit for p in byte_peaks(tr.plan.plans, held, tr.auto.offloaded, c, c.transfer))
    if not tr.auto.offloaded:
        assert all(p <= n for p, n in zip(memory_peaks(tr.plan.plans), tr.auto.limits))
    assert tr.history[0].schedule == "auto"  # ZB-H1 and 1F1B hold 3 or 4 on worker 1: neither fits
    np.testing.assert_allclose(losses, optax_reference(gpt, params, tx, batches)[0], rtol=1e-5)
    per_worker = P.Trainer(
        _stages(),
        params,
        optimizer=tx,
        schedule=P.Schedule("auto", memory_limit_bytes=["1KiB"] * 3 + [900]),
        microbatches=M,
    )
    assert per_worker.auto.limits_for(per_worker.model.batch_microbatches(batches[0], M)[0]) == (2, 1, 1, 1)
    small = P.Trainer(
        _stages(), params, optimizer=tx, schedule=P.Schedule("auto", memory_limit_bytes=1000), microbatches=M
    )
    with pytest.raises(VjpsplitError, match=r"on worker 1: one microbatch of stage 1 holds 1004 bytes .*no plan fits"):
        small.step(batches[0])


def test_save_and_restore_measure_again_and_continue_the_run(tmp_path):
    params, batches, tx = gpt_params(), _batches(4, seed=70), optax.adamw(1e-2)
    kw = dict(optimizer=tx, schedule=P.Schedule("auto", memory_limit=2), microbatches=M)
    never_stopped = P.Trainer(_stages(), params, **kw)
    losses = [never_stopped.step(b) for b in batches]
    first = P.Trainer(_stages(), params, **kw)
    for b in batches[:2]:
        first.step(b)
    first.save(tmp_path / "ck")
    again = P.Trainer.restore(tmp_path / "ck", _stages(), optimizer=tx)
    assert (again.plan.name, again.auto.memory_limit, again.step_count) == ("auto", 2, 2)
    later = [again.step(b) for b in batches[2:]]
    assert [h.measuring for h in again.history] == [True, True]  # measured again
    assert max(memory_peaks(again.plan.plans)) <= 2
    # Every plan sums each stage's gradients in microbatch order, so re-measured plans give the very same run.
    np.testing.assert_array_equal(later, losses[2:])
    assert_trees_close(again.params(), never_stopped.params(), rtol=0, atol=0)


def test_bad_limits_are_one_clear_error():
    params, tx = gpt_params(), optax.sgd(0.1)
    kw = dict(optimizer=tx, microbatches=M)
    with pytest.raises(VjpsplitError, match=r"apply to Schedule\('auto'\), not to '1f1b'"):
        P.Trainer(_stages(), params, schedule=P.Schedule("1f1b", memory_limit=2), **kw)
    with pytest.raises(VjpsplitError, match="not both"):
        P.Trainer(_stages(), params, schedule=P.Schedule("auto", memory_limit=2, memory_limit_bytes=10**6), **kw)
    with pytest.raises(VjpsplitError, match="memory_limit for worker 0 is 0; a worker must hold at least 1"):
        P.Trainer(_stages(), params, schedule=P.Schedule("auto", memory_limit=0), **kw)
    with pytest.raises(VjpsplitError, match="one value or one per worker"):
        P.Trainer(_stages(), params, schedule=P.Schedule("auto", memory_limit_bytes=[10**6] * 3), **kw)
    with pytest.raises(VjpsplitError, match="is not a size"):
        P.Trainer(_stages(), params, schedule=P.Schedule("auto", memory_limit_bytes="lots"), **kw)


def test_send_time_is_the_gap_to_an_idle_worker_and_compiling_operations_are_left_out():
    E = Event  # worker, kind, microbatch, start, end, stage
    events = [
        E(0, "F", 0, 0.0, 1.0, 0),
        E(1, "F", 0, 1.5, 2.5, 1),  # worker 1 idle since the start: a gap of 0.5
        E(0, "F", 1, 1.0, 2.0, 0),
        E(1, "B", 0, 2.5, 3.0, 1),
        E(1, "F", 1, 3.0, 4.0, 1),  # worker 1 was busy when F1 of stage 0 ended: not a send time
        E(0, "B", 0, 3.2, 4.0, 0),  # worker 0 idle since 2.0: a gap of 0.2
    ]
    assert sorted(send_gaps(events, 2)) == pytest.approx([0.2, 0.5])
    # One stage without the split backward, 4 microbatches; the first two of each kind were cold calls, each
    # with its warm run's own seconds (Event.own), which count in place of their spans in any step.
    plans = P.schedule("1f1b", 1, 4)
    took = {"F": [9.0, 8.0, 1.0, 3.0], "B": [7.0, 6.0, 2.0, 4.0]}
    own = {"F": [0.5, 1.5, None, None], "B": [1.0, 1.0, None, None]}

    def step(with_own):
        timeline, t = [], 0.0
        for op in plans[0]:
            d = took[op.kind][op.mb]
            timeline.append(E(0, op.kind, op.mb, t, t + d, 0, own[op.kind][op.mb] if with_own else None))
            t += d
        return step_result(
            schedule="1f1b", plans=plans, num_stages=1, microbatches=4, runner="test", step_time=t,
            losses=dict.fromkeys(range(4), 0.0), grads=[None], events=timeline,
        )  # fmt: skip

    whole = types.SimpleNamespace(manifest=types.SimpleNamespace(weights=(), splits_backward=False))
    samples = CostSamples([whole])
    samples.add(step(True), first=True)
    assert samples.costs() == {"F": [1.25], "B": [1.5], "W": [0.0], "gap": 0.0}
    samples.add(step(False), first=False)  # a later step: the first no longer counts; every microbatch of this one does
    assert samples.costs() == {"F": [5.5], "B": [5.0], "W": [0.0], "gap": 0.0}
    # An operation that ran while this process compiled is left out, in any step.
    t0 = time.monotonic()
    jax.jit(lambda x: x * 3 + 1)(np.float32(t0))  # traces and compiles now
    t1 = time.monotonic()
    ops = [E(0, "F", 0, t0, t1, 0), E(0, "F", 1, t1 + 1, t1 + 2, 0), E(0, "F", 2, t1 + 2, t1 + 5, 0)]
    assert [e.mb for e in counted(ops)[(0, "F")]] == [1, 2]
    assert [e.mb for e in counted(ops[:1])[(0, "F")]] == [0]  # none left: the last counts
    cold = E(0, "F", 0, t0, t1, 0, 0.25)  # a cold call's warm run, timed apart from its compile, counts
    assert [e.mb for e in counted([cold, *ops[1:]])[(0, "F")]] == [0, 1, 2]


def test_a_split_backwards_i_and_w_are_the_costs_b_and_w_and_an_is_cotangent_is_a_send():
    """The events say what ran: an I is the backward's input part (the costs' ``B``), a W its weight part; a
    whole B is cut by the stage's FLOPs. Read from the kinds alone, not from the plans."""
    E = Event
    events = [
        E(0, "F", 0, 0.0, 1.0, 0),
        E(1, "F", 0, 1.5, 2.5, 1),
        E(1, "I", 0, 2.5, 3.0, 1),
        E(0, "I", 0, 3.2, 4.0, 0),  # worker 0 idle since 1.0: the cotangent's gap, 0.2
        E(1, "W", 0, 3.0, 3.5, 1),
        E(0, "W", 0, 4.0, 4.25, 0),
    ]
    assert sorted(send_gaps(events, 2)) == pytest.approx([0.2, 0.5])
    result = step_result(
        schedule="zbh1", plans=[[]], num_stages=2, microbatches=1, runner="test", step_time=4.25,
        losses={0: 0.0}, grads=[None, None], events=events,
    )  # fmt: skip
    split = types.SimpleNamespace(manifest=types.SimpleNamespace(weights=("w",), splits_backward=True))
    samples = CostSamples([split, split])
    samples.add(result, first=True)
    costs = samples.costs()
    assert set(costs) == {"F", "B", "W", "gap"} and costs["gap"] == pytest.approx(0.35)
    assert [costs[k] for k in "FBW"] == [pytest.approx(v) for v in ([1.0, 1.0], [0.8, 0.5], [0.25, 0.5])]


@pytest.mark.parametrize("schedule_name", ["1f1b", "zbh1"])
def test_costs_are_each_operations_own_warm_time(monkeypatch, schedule_name):
    """Costs leave out a transfer to the stage and a cold call's compile, even where every operation is cold.

    On clocks (one per thread, so another worker's compile is not this one's) that jump 1000 s at each
    compile and each move to a stage's device, a first timed step of 2 microbatches of a new size (every F,
    B and W the first or second run of its call) must still give each operation's own time: a warm run's,
    from inputs already in place.
    """
    import threading

    from vjpsplit_cli.pipeline.runtime import worker as worker_module
    from vjpsplit_cli.pipeline.training import measured

    clocks, active = {}, [True]

    def advance(by):
        i = threading.get_ident()
        clocks[i] = clocks.get(i, 0.0) + by
        return clocks[i]

    def compiled(event, secs, **kw):
        if active[0] and event in measured.COMPILE_EVENTS:
            advance(1000.0)

    moved = worker_module.StageWorker.to_device

    def to_device(self, tree):
        advance(1000.0)  # a transfer: the stage waits for its input, the operation has not begun
        return moved(self, tree)

    clock = types.SimpleNamespace(monotonic=lambda: advance(1e-6))
    monkeypatch.setattr(worker_module, "time", clock)
    monkeypatch.setattr(measured, "time", clock)
    monkeypatch.setattr(worker_module.StageWorker, "to_device", to_device)
    measured.listen_for_compiles()
    jax.monitoring.register_event_duration_secs_listener(compiled)
    try:
        tr = P.Trainer(_stages(), gpt_params(), optimizer=optax.sgd(0.1), schedule=schedule_name, microbatches=2)
        tr.step(gpt_batch(6), timed=True)  # microbatches of 3 rows: a signature no other test compiled
        costs = tr.costs()
    finally:
        active[0] = False
    assert all(0 < v < 1000 for k in "FBW" for v in costs[k] if k != "B" or v), costs
    cold = {(e.stage, e.kind) for e in tr.last_result.events if e.own is not None}
    assert cold >= {(s, "F") for s in range(len(_stages()))}, cold  # each stage's first F is cold: run again
