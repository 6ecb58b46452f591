"""On one device that runs one program at a time, a step runs as one compiled program (issue 68).

Where every stage shares one device that runs one program at a time (a TPU chip; here a CPU device said to:
``dispatch.runs_serially``), the step's F, B, I and W, in the plans' order, are traced into one jitted call
(``runtime.program.StepProgram``): after its first step no stage call of its own is dispatched. The steps
equal optax on ``jax.value_and_grad`` in one process; a timed step runs the same program and cuts its time among
the operations by their FLOPs, in the plans' order.
"""

from __future__ import annotations

import weakref

import jax
import optax
import numpy as np
import pytest
import test_step_aux
import test_variable_lengths
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs
from test_fused_last_stage import M, _optax_steps, _trainer

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.pipeline.runtime import dispatch, program

pytestmark = pytest.mark.filterwarnings("ignore::vjpsplit_cli.pipeline.SharedDevicesWarning")


@pytest.fixture(autouse=True)
def serial(monkeypatch):
    """Every device said to run one program at a time (as an accelerator's does)."""
    monkeypatch.setattr(dispatch, "runs_serially", lambda device: True)


@pytest.fixture(scope="module")
def stages():
    return vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params")


def _traced(tree) -> bool:
    return all(isinstance(a, jax.core.Tracer) for a in jax.tree_util.tree_leaves(tree) if hasattr(a, "shape"))


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1", "gpipe"])
def test_a_step_is_one_program_and_trains_as_one_process(stages, schedule, monkeypatch):
    batch = gpt_batch(8)
    params, want = _optax_steps(batch, 3)
    monkeypatch.setattr(program, "_PROGRAMS", weakref.WeakKeyDictionary())  # none compiled by an earlier test
    calls: list[tuple[str, bool]] = []  # each stage call: its name, and whether it was traced (inside the program)
    with _trainer(stages, schedule) as tr:
        for t in tr.backend.trainers:
            c = t.worker.calls
            fwd, bwd = c.forward._fwd, c.backward
            monkeypatch.setattr(c.forward, "_fwd", lambda *a, _f=fwd: calls.append(("F", _traced(a))) or _f(*a))
            monkeypatch.setattr(c, "backward", lambda *a, _b=bwd: calls.append(("B", _traced(a))) or _b(*a))
            for name in ("forward_backward", "forward_backward_acc", "backward_acc", "backward_weight"):
                monkeypatch.setattr(c, name, lambda *a, _n=name: pytest.fail(f"{_n} ran"))
        got = [tr.step(batch)]
        S = len(tr.backend.trainers)
        # One trace of the plans' actions: every F and every backward once, all inside the program.
        assert sorted(calls) == sorted([("F", True)] * S * M + [("B", True)] * S * M)
        calls.clear()
        got += [tr.step(batch), tr.step(batch)]
        assert calls == []  # the compiled program ran: no stage call of its own
        rings = [
            [(k, mb) for k, mb, *_ in t.worker.ring][-len(tr.plan.plans[i]) :]
            for i, t in enumerate(tr.backend.trainers)
        ]
        assert rings == [[(op.kind, op.mb) for op in ops] for ops in tr.plan.plans]
        np.testing.assert_allclose(got, want, rtol=1e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), tr.params(), params)


def test_a_timed_step_runs_the_program_its_time_cut_by_flops(stages):
    """The timed step's events are the plans' operations, one after the other, each the program's time times its
    stage's forward or backward share of FLOPs (a warm program timed by its lane's watcher, as operations are); a W (its I ran the whole backward) has none, and ``costs()`` cuts
    the I's time in two as it does a whole backward's."""
    batch = gpt_batch(8)
    params, want = _optax_steps(batch, 2)
    with _trainer(stages, "zbh1") as tr:
        got = [tr.step(batch, timed=True), tr.step(batch, timed=True)]
        # The second step's program was warm: dispatched as untimed, its lane's watcher timed it (nothing waited).
        first = tr.backend.trainers[0].worker
        assert not any(waited for *_, waited in list(first.ring)[-len(tr.plan.plans[0]) :])
        events = sorted(tr.last_result.events, key=lambda e: (e.start, e.end))
        assert [(e.kind, e.mb, e.stage) for e in events if e.end > e.start] == [
            (op.kind, op.mb, op.stage) for _, op, _ in dispatch.order_of(tr.plan.plans, len(stages)) if op.kind != "W"
        ]
        for a, b in zip(events, events[1:]):
            assert b.start == pytest.approx(a.end, abs=1e-9)
        assert {e.kind for e in events if e.end == e.start} == {"W"}
        for s, art in enumerate(stages.artifacts):
            back, fwd = program.flops_weights(art)
            f = [e.end - e.start for e in events if e.stage == s and e.kind == "F"]
            i = [e.end - e.start for e in events if e.stage == s and e.kind == "I"]
            assert f[0] / i[0] == pytest.approx(fwd / back, rel=1e-4)  # differences of clock readings
        costs = tr.costs()
        assert all(v > 0 for v in costs["F"]) and all(v > 0 for v in costs["B"][1:]) and all(v > 0 for v in costs["W"])
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_plans_of_the_same_computations_share_one_program(stages, monkeypatch):
    """On one serial device ZB-H1's I is the whole backward and its W nothing: its computations and their order
    are 1F1B's, so a Trainer of either runs the program the other compiled; GPipe's order is its own."""
    monkeypatch.setattr(program, "_PROGRAMS", weakref.WeakKeyDictionary())  # none compiled by an earlier test
    batch = gpt_batch(8)
    made = {}
    for schedule in ("1f1b", "zbh1", "gpipe"):
        with _trainer(stages, schedule) as tr:
            tr.step(batch)
        made[schedule] = set(map(id, program._PROGRAMS[stages.artifacts[0]].values()))
    assert len(made["1f1b"]) == 1 and made["1f1b"] == made["zbh1"] and len(made["gpipe"]) == 2


def test_the_program_reports_the_residual_bytes_the_plan_holds(stages):
    """Each stage's peak is the plan's: GPipe holds every microbatch's residuals at once, 1F1B fewer on the middle
    stages; the last stage under 1F1B runs each B right after its F and holds none past it."""
    batch = gpt_batch(8)
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        with _trainer(stages, schedule) as tr:
            tr.step(batch)
            peaks[schedule] = [t.worker.peak_residual_bytes for t in tr.backend.trainers]
    assert all(g > f > 0 for g, f in zip(peaks["gpipe"][1:-1], peaks["1f1b"][1:-1]))
    assert peaks["1f1b"][-1] == 0 < peaks["gpipe"][-1]


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_aux_and_weighted_microbatches_of_two_lengths_on_one_serial_device(schedule, caplog):
    """The last stage's aux (``has_aux``, in the program) and ``Microbatches`` of two lengths with weights
    (operation by operation): their cases, on one serial device."""
    aux_stages = vs.export_stages(
        test_step_aux.aux_loss, *test_step_aux._specs(), wrt="params", platforms="cpu", has_aux=True
    )
    test_step_aux.test_step_and_history_give_the_mean_aux_of_the_one_process_loop(aux_stages, schedule)
    seq_stages = vs.export_stages(
        test_variable_lengths.seq_loss,
        *test_variable_lengths.seq_specs(test_variable_lengths.seq_params()),
        wrt="params",
        platforms="cpu",
    )
    test_variable_lengths.test_microbatches_of_two_lengths_train_as_one_process_weighted(seq_stages, schedule)
    assert program._PROGRAMS.get(aux_stages.artifacts[0])  # ran as a program
    # Microbatches of their own lengths run operation by operation: each call compiled once per length, not the
    # program once per order of lengths.
    assert not program._PROGRAMS.get(seq_stages.artifacts[0])
    test_variable_lengths.test_each_new_shape_compiles_once(seq_stages, caplog)


def test_the_program_reads_nothing_back_before_the_updates(stages, monkeypatch):
    """As operation by operation: the step's thread reads nothing back from the device (no implicit transfer, no
    ``device_get``) until every stage's update is dispatched, then fetches once."""
    from fetches import step_noting_fetches

    batch = gpt_batch(8)
    with _trainer(stages, "1f1b") as tr:
        tr.step(batch)  # compiled and warm
        loss, seen = step_noting_fetches(tr, batch, monkeypatch)
        S = len(tr.backend.trainers)
        assert program._PROGRAMS.get(stages.artifacts[0])
    assert seen[:S] == ["update"] * S and set(seen[S:]) == {"fetch"}, seen
    assert np.isfinite(loss)


def test_an_error_inside_the_program_names_it_and_the_trainer_steps_on(stages, monkeypatch):
    """A host callback that raises inside a stage's forward fails the step's one call: one ``VjpsplitError``
    naming the program (it runs every operation, so it names none), chained to JAX's error; nothing is applied
    and the next step runs."""

    def host(_):
        raise RuntimeError("the user's callback failed")

    def raising(x):
        return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    batch = gpt_batch(8)
    monkeypatch.setattr(program, "_PROGRAMS", weakref.WeakKeyDictionary())  # traced here, with the callback
    with _trainer(stages, "1f1b") as tr:
        c = tr.backend.trainers[1].worker.calls.forward
        real = c._fwd
        monkeypatch.setattr(c, "_fwd", lambda p, x, *side: real(p, jax.tree.map(raising, x), *side))
        before = tr.params()
        with pytest.raises(
            vs.VjpsplitError,
            match=r"^the step's program \(\d+ operations of 4 stages on one device\) failed: .*the user's callback failed",
        ) as got:
            tr.step(batch)
        assert isinstance(got.value.__cause__, jax.errors.JaxRuntimeError)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), tr.params(), before)  # nothing applied
        monkeypatch.setattr(c, "_fwd", real)
        monkeypatch.setattr(program, "_PROGRAMS", weakref.WeakKeyDictionary())  # traced again, without it
        assert np.isfinite(tr.step(batch))


def test_a_stuck_program_is_reported_as_the_programs(stages, monkeypatch):
    """A step whose program does not finish within ``step_timeout`` (a host callback in stage 2's forward that
    takes longer) names every worker as in the step's program, from its first operation on, and the step's
    thread as in the program's dispatch (on CPU the callback runs there)."""
    import time

    def host(v):
        time.sleep(4)
        return v

    def slow(x):
        return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    batch = gpt_batch(8)
    monkeypatch.setattr(program, "_PROGRAMS", weakref.WeakKeyDictionary())  # traced here, with the callback
    d = jax.devices()[0]
    runner = P.InProcess(devices=[[d]] * len(stages))
    tr = P.Trainer(
        stages, gpt_params(), optimizer=optax.sgd(0.1), microbatches=M, runner=runner, observe=P.Observe(step_timeout=1)
    )
    try:
        c = tr.backend.trainers[2].worker.calls.forward
        real = c._fwd
        monkeypatch.setattr(c, "_fwd", lambda p, x, *side: real(p, jax.tree.map(slow, x), *side))
        with pytest.raises(vs.VjpsplitError) as got:
            tr.step(batch)
        said = str(got.value)
        assert said.startswith("the step did not finish within step_timeout=1 s; ")
        for w, ops in enumerate(tr.plan.plans):
            first = ops[0]
            assert (
                f"worker {w}: in the step's program since" in said
                and f"its operations from {first.kind} stage {first.stage} mb {first.mb} on" in said
            ), said
        assert "the step's thread (in the step's program's dispatch)" in said
    finally:
        time.sleep(4)  # the abandoned thread's callback ends
        tr.close()
