"""pipeline.Trainer on Ray: parameters and optimizer state live in the actors; N steps equal single-process optax."""

from __future__ import annotations

import gc
import os
import sys
import time

import numpy as np
import optax
import pytest
from models import assert_trees_close, optax_reference
from optimizer_models import MICROBATCHES, assert_as_one_process, batches, one_process, params_
from optimizer_models import stages as tied_stages
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.pipeline.schedules.auto import auto_schedule
from vjpsplit_cli.pipeline.schedules.modeled import modeled_makespan
from vjpsplit_cli.pipeline.training import autoplan, ray_backend
from vjpsplit_cli.pipeline.training.trials import contenders


@pytest.fixture(scope="module")
def stages():
    return vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbh1", "zbv"])
def test_ray_trainer_equals_single_process_optax(ray_session, stages, schedule):
    params = gpt_params()
    batches = [gpt_batch(8, seed=20 + i) for i in range(3)]
    tx, clip = optax.adamw(1e-2), (0.5 if schedule == "1f1b" else None)
    with P.Trainer(
        stages, params, optimizer=tx, schedule=schedule, microbatches=4, runner="ray", clip_global_norm=clip
    ) as tr:
        losses = [tr.step(b) for b in batches]
        got = tr.params()
        copies = [p["params/embed"] for p, _ in tr.backend.snapshots() if "params/embed" in p]
        assert tr.last_result.runner == "ray" and len(tr.backend.rp.actors) == (2 if schedule == "zbv" else 4)
    ref_tx = tx if clip is None else optax.chain(optax.clip_by_global_norm(clip), tx)
    ref_losses, ref_params = optax_reference(gpt, params, ref_tx, batches)
    if clip is not None:
        assert min(h.grad_norm for h in tr.history) > clip  # clipping acted
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(got, ref_params, rtol=1e-4, atol=1e-6)
    assert len(copies) == 2
    np.testing.assert_array_equal(copies[0], copies[1])


def test_ray_trainer_auto_measures_then_races_and_equals_single_process_optax(ray_session, stages, monkeypatch):
    params, tx = gpt_params(), optax.adamw(1e-2)
    batches = [gpt_batch(8, seed=25 + i) for i in range(14)]
    planned = []  # the costs auto_schedule plans with: Ray's measured send time among them

    def spy(*args, **kwargs):
        planned.append(dict(kwargs["costs"]))
        return auto_schedule(*args, **kwargs)

    probed = []  # per call of the send probe: each boundary's delivery, one actor to the next
    deliver = ray_backend.RayBackend.send_seconds

    def send_seconds(self, values, repeats):
        probed.append(deliver(self, values, repeats))
        return probed[-1]

    monkeypatch.setattr(autoplan, "auto_schedule", spy)
    monkeypatch.setattr(ray_backend.RayBackend, "send_seconds", send_seconds)
    # Every candidate races (on this small model the model may rate only one near the best: no race to test).
    monkeypatch.setattr(autoplan, "contenders", lambda c: contenders(c, margin=float("inf")))
    schedule = P.Schedule("auto", trial_rounds=1)
    with P.Trainer(stages, params, optimizer=tx, schedule=schedule, microbatches=4, runner="ray") as tr:
        losses = [tr.step(b) for b in batches[:2]]
        costs, race, plannings = tr.costs(), tr.auto.trial, list(planned)
        # The race after the measuring steps: the candidates auto plans for Ray's costs, fastest modeled first.
        want = contenders(tr.auto.candidates(costs), margin=float("inf"))
        assert race is not None and [c.key for c in race.candidates] == [c.key for c in want]
        n = 2 + len(race.candidates) + 1  # one trial step each, then the plans kept
        assert n <= len(batches)
        losses += [tr.step(b) for b in batches[2:n]]
        got = tr.params()
        assert tr.last_result.runner == "ray" and tr.last_result.schedule == "auto"
    ref_losses, ref_params = optax_reference(gpt, params, tx, batches[:n])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(got, ref_params, rtol=1e-4, atol=1e-6)
    names = [c.name for c in race.candidates]
    assert [(h.schedule, h.measuring, h.trial) for h in tr.history] == [
        ("zbh1", True, None), ("auto", True, None), *(("auto", False, name) for name in names), ("auto", False, None)
    ]  # fmt: skip
    assert all(len(costs[k]) == 4 and min(costs[k]) >= 0 for k in "FBW") and costs["gap"] >= 0
    # The send: one actor-to-actor delivery per boundary, timed apart once; its mean is what auto plans with.
    assert len(probed) == 1 and len(probed[0]) == 3 and min(probed[0]) > 0
    assert costs["comm"] == pytest.approx(sum(probed[0]) / 3)
    # Two plannings (after each measuring step), each auto_schedule under the limit and at 1F1B's memory.
    assert len(plannings) == 4 and all(p["comm"] == costs["comm"] for p in plannings)
    # Under the same costs, the model's best candidate is no slower than the ZB-H1 auto measured with.
    assert race.candidates[0].modeled <= modeled_makespan(P.schedule("zbh1", 4, 4), costs) + 1e-12
    # Kept: the candidate whose trial step took least time on Ray, run under auto's name.
    medians = tr.auto.races[-1]
    assert tr.auto.choice == min(medians, key=medians.get)
    assert tr.last_result.plans == race.candidates[names.index(tr.auto.choice)].plans


@pytest.mark.parametrize("split", [True, False])
def test_ray_sends_a_backwards_cotangent_before_its_weight_part(ray_session, stages, split):
    # A B whose cotangent goes to another actor runs as its input part, the send, then its weight part, where the
    # stage has the split backward (the cotangent travels while W computes); stage 0 sends none and runs B whole,
    # as does every stage exported without the split. The cotangent is handed to the sender between the two parts'
    # dispatches, and counts as sent once its delivery went out (the sender waits for the input part's result),
    # never before it was handed over. A timed step runs the same actions in the same order, its events I and W.
    st = (
        stages
        if split
        else vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu", weights=False)
    )
    params, batch, M = gpt_params(), gpt_batch(8), 4
    with P.Trainer(st, params, optimizer=optax.sgd(0.1), schedule="1f1b", microbatches=M, runner="ray") as tr:
        tr.step(batch)
        statuses = ray_session.get([a.status.remote() for a in tr.backend.rp.actors])
        tr.step(batch, timed=True)
        timed_kinds = {str(e.kind) for e in tr.last_result.events}
        again = ray_session.get([a.status.remote() for a in tr.backend.rp.actors])
    for status, timed in zip(statuses, again):
        ((stage, ring),) = status["rings"].items()
        parts = split and 0 < stage < 3  # the last stage runs each B inside its F (1F1B): F and B, no I or W
        mine = ring[-3 * M :] if parts else ring[-2 * M :]  # this step's operations, in dispatch order
        ((_, timed_ring),) = timed["rings"].items()
        assert [r[:2] for r in timed_ring[-len(mine) :]] == [r[:2] for r in mine]
        kinds = sorted(kind for kind, *_ in mine)
        assert kinds == (sorted("FIW" * M) if parts else sorted("FB" * M))
        for mb in range(M) if stage > 0 else []:
            handed, sent = status["handed"][("B", mb, stage)], status["sent"][("B", mb, stage)]
            ends = {kind: (t0, t1) for kind, m, t0, t1, _ in mine if m == mb}
            assert handed <= sent
            if parts:
                assert ends["I"][1] <= handed <= ends["W"][0]  # after the input part, before the weight part
            else:
                assert ends["B"][1] <= handed
    assert timed_kinds == ({"F", "B", "I", "W"} if split else {"F", "B"})


def test_ray_delivery_probe_times_round_trips_between_steps(ray_session, stages):
    params, tx = gpt_params(), optax.sgd(1e-2)
    batches = [gpt_batch(8, seed=40 + i) for i in range(2)]
    with P.Trainer(stages, params, optimizer=tx, microbatches=4, runner="ray") as tr:
        losses = [tr.step(batches[0])]
        rp = tr.backend.rp
        got = rp.probe_delivery(np.ones((2, 8, 16), np.float32), repeats=5, workers=(1, 2))
        assert len(got) == 5 and min(got) > 0
        with pytest.raises(VjpsplitError, match=r"workers=\(1, 1\): give two different workers"):
            rp.probe_delivery(np.ones(3), workers=(1, 1))
        losses.append(tr.step(batches[1]))  # the probe's step number is its own: the next step runs as before
        got = tr.params()
    ref_losses, ref_params = optax_reference(gpt, params, tx, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(got, ref_params, rtol=1e-4, atol=1e-6)


def test_ray_trainer_evaluates_forward_only_equal_to_one_process(ray_session, stages):
    params, tx, held_out = gpt_params(), optax.adam(1e-2), gpt_batch(8, seed=35)
    with P.Trainer(stages, params, optimizer=tx, schedule="1f1b", microbatches=2, runner="ray") as tr:
        tr.step(gpt_batch(8, seed=36))
        before = tr.backend.snapshots()
        loss, outputs = tr.evaluate(held_out, outputs=True)
        loss4 = tr.evaluate(held_out, microbatches=4)
        after, now = tr.backend.snapshots(), tr.params()
        assert tr.step_count == 1 and len(tr.history) == 1
    ref = float(gpt(now, *held_out))
    assert abs(loss - ref) <= 1e-6 * abs(ref) and abs(loss4 - ref) <= 1e-6 * abs(ref)
    for (p0, s0), (p1, s1) in zip(before, after):  # no parameter or optimizer state changed
        assert p0.keys() == p1.keys() and s0.keys() == s1.keys()
        assert all(np.array_equal(p0[k], p1[k]) for k in p0) and all(np.array_equal(s0[k], s1[k]) for k in s0)
    assert len(outputs) == 2 and [np.shape(v) for v in outputs[0]] == [(), (4, 5, 8)]  # what the last stage got


def test_ray_workers_without_optax_train_and_restore(ray_session, stages, tmp_path):
    shim = tmp_path / "no_optax"
    shim.mkdir()
    (shim / "optax.py").write_text("raise ImportError('optax is not installed on this worker')\n")
    path = os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", ""), *sys.path[1:3]])
    no_optax = [{"runtime_env": {"env_vars": {"PYTHONPATH": path}}} for _ in range(4)]
    params, tx = gpt_params(), optax.adam(1e-2)
    batches = [gpt_batch(8, seed=30 + i) for i in range(4)]
    kw = dict(optimizer=tx, schedule="1f1b", microbatches=2, runner=P.Ray(actor_options=no_optax))
    with P.Trainer(stages, params, **kw) as tr:
        losses = [tr.step(b) for b in batches[:2]]

        def probe(actor):
            import importlib

            try:
                importlib.import_module("optax")
            except ImportError as e:
                return str(e), "optax" in sys.modules
            return "imported", True

        for a in tr.backend.rp.actors:
            assert ray_session.get(a.__ray_call__.remote(probe)) == ("optax is not installed on this worker", False)
        tr.save(tmp_path / "ck")
    with P.Trainer.restore(tmp_path / "ck", stages, **kw) as again:
        assert again.step_count == 2
        losses += [again.step(b) for b in batches[2:]]
        got = again.params()
    ref_losses, ref_params = optax_reference(gpt, params, tx, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(got, ref_params, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("transport", ["socket", "ray"])
def test_ray_untimed_reports_come_on_the_drivers_socket(ray_session, stages, monkeypatch, transport):
    """An untimed step's reports reach the driver as frames on its socket (one per actor), a timed step's
    through Ray (its timings); with VJPSPLIT_RAY_TRANSPORT=ray, every report through Ray. Training equals
    one process either way."""
    monkeypatch.setenv("VJPSPLIT_RAY_TRANSPORT", transport)
    params, tx = gpt_params(), optax.adamw(1e-2)
    data = [gpt_batch(8, seed=40 + i) for i in range(3)]
    with P.Trainer(stages, params, optimizer=tx, schedule="1f1b", microbatches=4, runner="ray") as tr:
        desk = tr.backend.rp.reports
        losses = [tr.step(data[0]), tr.step(data[1])]
        framed = 0 if desk is None else desk.received
        losses.append(tr.step(data[2], timed=True))
        after = 0 if desk is None else desk.received
        assert tr.last_result.events  # the timed step's timings came back
        got = tr.params()
    assert (desk is None) == (transport == "ray") and tr.backend.rp.reports is None  # closed with the Trainer
    assert (framed, after) == ((2 * 4, 2 * 4) if transport == "socket" else (0, 0))
    ref_losses, ref_params = optax_reference(gpt, params, tx, data)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(got, ref_params, rtol=1e-4, atol=1e-6)


def test_ray_trainer_dead_actor_and_timeout_are_one_error(ray_session, stages):
    params, batch = gpt_params(), gpt_batch(8)
    kw = dict(optimizer=optax.sgd(0.1), schedule="gpipe", microbatches=2, runner="ray")
    with P.Trainer(stages, params, **kw) as tr:
        tr.step(batch)
        ray_session.kill(tr.backend.rp.actors[2])
        with pytest.raises(VjpsplitError, match=r"stage 2: its Ray actor died"):
            tr.step(batch)
    with P.Trainer(stages, params, observe=P.Observe(step_timeout=1e-3), **kw) as tr:
        with pytest.raises(VjpsplitError, match=r"stage \d: the step did not finish within step_timeout=0.001 s"):
            tr.step(batch)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_ray_trainer_dropped_without_close_ends_its_actors(ray_session, stages):
    """A Trainer nobody closed ends its actors once collected, as an in-process one ends its threads (before: its
    actors, which hold one another's handles, ran on: 4 processes per Trainer)."""
    tr = P.Trainer(stages, gpt_params(), optimizer=optax.sgd(0.1), microbatches=2, runner="ray")
    tr.step(gpt_batch(4))
    pids = ray_session.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in tr.backend.rp.actors])
    assert len(pids) == 4 and all(map(_alive, pids))
    del tr
    gc.collect()
    end = time.monotonic() + 30
    while any(map(_alive, pids)) and time.monotonic() < end:
        time.sleep(0.2)
    assert not any(map(_alive, pids))


def test_ray_trainer_optimizers_of_each_kind_equal_one_process_or_are_refused(ray_session):
    """On Ray as in-process (tests/test_optimizer_catalogue.py): per leaf, a key split over the whole tree,
    reductions over leaves across stages (the clip in the chain, DoWG's), the loss as value=; refused by name."""
    for name, tx in [
        ("adamw", optax.adamw(1e-2)),
        ("noisy_sgd", optax.noisy_sgd(1e-2, eta=1e-2, key=0)),
        ("chain(clip_by_global_norm, adamw)", optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2))),
        ("dowg", optax.contrib.dowg()),
        ("polyak_sgd", optax.polyak_sgd(max_learning_rate=1.0)),
    ]:
        with P.Trainer(tied_stages(), params_(), optimizer=tx, microbatches=MICROBATCHES, runner="ray") as tr:
            losses = [tr.step(b) for b in batches()]
            params, state = tr.state()
        assert_as_one_process(name, losses, params, state, one_process(tx, batches()))
    with pytest.raises(
        VjpsplitError, match=r"optimizer 'chain' \(scale_by_zoom_linesearch\): its update needs value_fn and grad"
    ):
        P.Trainer(tied_stages(), params_(), optimizer=optax.lbfgs(), microbatches=MICROBATCHES, runner="ray")
