"""schedule="auto"'s trial steps: the plans the model rates close race on the step's clock; the fastest is kept.

The race itself (``trials``): candidates interleaved round by round, the median step wins, ties go to the plans
modeled faster. ``AutoPlan`` driven step by step with costs and step times given here (no clock of this host in
it), and whole Trainers whose steps one candidate is made slower on: the clock, not the model, decides, and
every trial step trains as one process does.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import optax
import pytest
from models import assert_trees_close, optax_reference
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.pipeline.schedules.modeled import memory_peaks, modeled_makespan
from vjpsplit_cli.pipeline.schedules.ops import Op
from vjpsplit_cli.pipeline.training import autoplan, trials
from vjpsplit_cli.pipeline.schedules.catalog import AUTO
from vjpsplit_cli.pipeline.training.autoplan import AS_1F1B, AutoPlan
from vjpsplit_cli.pipeline.training.trials import Candidate, Trial, contenders

M, ROWS = 4, 2
UNIT = {"F": [1.0] * 4, "B": [1.0] * 4, "W": [1.0] * 4, "comm": 0.0}


@functools.lru_cache(maxsize=None)
def _stages():
    return vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")


def _cand(name, modeled, mb=0):
    return Candidate(name, [[Op("F", mb, 0), Op("B", mb, 0)]], frozenset(), modeled)


def test_contenders_are_distinct_within_the_margin_fastest_modeled_first():
    a, b, far = _cand("a", 10.0), _cand("b", 10.5, mb=1), _cand("far", 11.5, mb=2)
    twin = Candidate("twin", a.plans, frozenset(), 10.0)  # a's plans under another name: not raced twice
    assert [c.name for c in contenders([b, a, twin, far])] == ["a", "b"]  # far is 15% above the best
    assert [c.name for c in contenders([b, a, twin, far], margin=0.2)] == ["a", "b", "far"]
    one_f = Candidate("1f1b", [[Op("F", 3, 0)]], frozenset(), 30.0)  # modeled 3x the best: races all the same
    assert [c.name for c in contenders([b, one_f, a])] == ["a", "b", "1f1b"]
    offloading = Candidate("a, offloading", a.plans, frozenset({(0, 0)}), 10.2)  # same plans, other copies
    assert [c.name for c in contenders([a, offloading])] == ["a", "a, offloading"]


def _race(race, seconds):
    """Run ``race`` to its end, candidate ``name``'s k-th step taking ``seconds[name](k)``; the names run."""
    ran = []
    while not race.done:
        i = race.running
        name = race.candidates[i].name
        ran.append(name)
        race.add(i, seconds[name](len(race.seconds[i])))
    return ran


def test_a_trial_runs_every_candidate_once_a_round_and_keeps_the_least_median():
    race = Trial([_cand("x", 1.0), _cand("y", 1.1, mb=1), _cand("z", 1.2, mb=2)], rounds=3)
    seconds = {"x": [5.0, 2.0, 2.1], "y": [9.0, 1.9, 2.0], "z": [1.0, 3.0, 3.0]}  # y's first run was cold
    ran = []
    for _ in range(9):
        i = race.running
        ran.append(race.candidates[i].name)
        race.add(i, seconds[ran[-1]][len(race.seconds[i])])
    assert ran == ["x", "y", "z"] * 3
    assert race.medians() == [2.1, 2.0, 3.0]  # the median, not the mean or the min
    # The steps spread 0.1 s around their medians: z, a second above y, leaves; x, 0.1 s above, is within
    # two standard errors of the medians' difference and races on.
    assert race.out == {2} and not race.done and race.running == 0 and race.winner().name == "y"
    tie = Trial([_cand("first", 1.0), _cand("second", 1.0, mb=1)], rounds=1)
    tie.add(0, 2.0)
    tie.add(1, 2.0)
    assert tie.done and tie.winner().name == "first"  # equal on a clock with no noise: the one modeled faster
    with pytest.raises(ValueError):
        Trial([], rounds=1)


def test_candidates_within_the_noise_race_on_and_the_slow_leave_early():
    """z is a second slower: out after the third round. x is 0.1 s slower than y under a noise of about
    +-0.05 s per step: the race runs on until the medians' standard error parts them, before ``most``."""
    jitter = [0.05, -0.05, 0.0, 0.04, -0.04, 0.02, -0.02]
    seconds = {
        "x": lambda k: 2.1 + jitter[k % 7],
        "y": lambda k: 2.0 + jitter[(k + 3) % 7],
        "z": lambda k: 3.0 + jitter[k % 7],
    }
    race = Trial([_cand("x", 1.0), _cand("y", 1.1, mb=1), _cand("z", 1.2, mb=2)], rounds=3)
    ran = _race(race, seconds)
    assert ran[:9] == ["x", "y", "z"] * 3 and "z" not in ran[9:]
    assert 3 < ran.count("x") < race.most == 12 and ran.count("x") == ran.count("y")
    assert race.winner().name == "y" and race.out == {0, 2}
    # Two candidates the clock cannot part (the same times, shifted) race until ``most``; the least median wins.
    even = Trial([_cand("a", 1.0), _cand("b", 1.1, mb=1)], rounds=2, most=5)
    ran = _race(even, {"a": lambda k: 2.0 + jitter[k % 7], "b": lambda k: 2.0 + jitter[(k + 1) % 7]})
    assert ran == ["a", "b"] * 5 and not even.out
    medians = even.medians()
    assert even.winner().name == ("a" if medians[0] <= medians[1] else "b")


MBS = [(np.zeros((2, 3), np.float32), [])]  # a step's microbatches as next_step sees them: one of one shape


def _measured(ap: AutoPlan, costs: dict) -> None:
    """Run ``ap``'s two timed measuring steps under ``costs``."""
    for _ in range(2):
        ran, measuring = ap.next_step(MBS)
        assert measuring
        ap.after(ran, lambda: costs, True, 1.0)


def test_autoplan_races_after_measuring_and_again_only_for_plans_not_raced(monkeypatch):
    monkeypatch.setattr(autoplan, "contenders", lambda c: contenders(c, margin=float("inf")))  # race them all
    ap = AutoPlan(_stages().artifacts, M, None, None, trial_rounds=2)
    _measured(ap, UNIT)
    race = ap.trial
    assert race is not None and race.rounds == 2
    names = [c.name for c in race.candidates]
    # auto's own plans, the same held to 1F1B's memory, the built-ins that fit, the measuring ZB-H1: once each.
    assert names[0] in (AUTO, AS_1F1B, "zbh1") and "gpipe" in names and "1f1b" in names
    assert len({c.key for c in race.candidates}) == len(names)
    assert [c.modeled for c in race.candidates] == sorted(modeled_makespan(c.plans, UNIT) for c in race.candidates)
    slowest = len(names) - 1  # the clock reverses the model: the plans modeled slowest run fastest
    ran = []
    while ap.trial is not None:
        plan, measuring = ap.next_step(MBS)
        assert not measuring and plan.plans == ap.plans and plan.name == AUTO
        i = race.running
        row = ap.after(plan, lambda: pytest.fail("an untimed step reads no costs"), False, 1.0 if i == slowest else 2.0)
        ran.append(row[3])
        assert row[:3] == (AUTO, race.candidates[i].modeled, False)
    assert ran == names * 2
    assert ap.choice == names[slowest] and ap.plans == race.candidates[slowest].plans
    assert ap.races == [{n: (1.0 if i == slowest else 2.0) for i, n in enumerate(names)}]
    plan, _ = ap.next_step(MBS)
    assert plan.name == AUTO and plan.plans == race.candidates[slowest].plans  # kept, under auto's name
    # A later timed step under other costs: the plans no race ran race the kept ones; the rest are not run again.
    heavy_w = {"F": [1.0] * 4, "B": [1.0] * 4, "W": [3.0] * 4, "comm": 0.5}
    ap.after(plan, lambda: heavy_w, True, 1.0)
    second = ap.trial
    assert second is not None and second.candidates[0].plans == race.candidates[slowest].plans
    assert second.candidates[0].modeled == pytest.approx(modeled_makespan(second.candidates[0].plans, heavy_w))
    raced = {c.key for c in race.candidates}
    assert len(second.candidates) >= 2 and all(c.key not in raced for c in second.candidates[1:])
    # A timed step inside a race (the Trainer times only some steps) counts nothing and plans nothing.
    running = second.running
    plan, _ = ap.next_step(MBS)
    ap.after(plan, lambda: UNIT, True, 0.1)
    assert ap.trial is second and second.running == running and second.seconds[running] == []


def test_no_trial_rounds_keeps_the_models_choice():
    ap = AutoPlan(_stages().artifacts, M, None, None, trial_rounds=0)
    _measured(ap, UNIT)
    assert ap.trial is None
    best = min(ap.candidates(UNIT), key=lambda c: c.modeled)
    assert ap.makespan == pytest.approx(best.modeled) and ap.next_step(MBS)[0].name == AUTO


def test_a_race_counts_timed_steps_where_the_trainer_times_every_step(monkeypatch):
    monkeypatch.setattr(autoplan, "contenders", lambda c: contenders(c, margin=float("inf")))
    ap = AutoPlan(_stages().artifacts, M, None, None, trial_rounds=1, every_step_timed=True)
    _measured(ap, UNIT)
    race = ap.trial
    assert race is not None
    for _ in race.candidates:
        plan, _ = ap.next_step(MBS)
        ap.after(plan, lambda: UNIT, True, 1.0)
    assert ap.trial is None and ap.choice == race.candidates[0].name  # all equal on the clock: the model's first


def test_the_trainer_keeps_what_ran_fastest_not_what_the_model_rates_fastest(monkeypatch):
    """The model's favourite is slowed on the clock (a sleep before its steps): the race keeps another, and
    every step, trial steps among them, trains as optax does in one process."""
    monkeypatch.setattr(autoplan, "contenders", lambda c: contenders(c, margin=float("inf")))
    monkeypatch.setattr(trials, "MOST_ROUNDS", 1)  # the race is its 2 rounds: the rest may stay within the noise
    params, tx = gpt_params(), optax.adamw(1e-2)
    batches = [gpt_batch(M * ROWS, seed=60 + i) for i in range(14)]
    tr = P.Trainer(_stages(), params, optimizer=tx, schedule=P.Schedule("auto", trial_rounds=2), microbatches=M)
    slowed, step = {"plans": None}, tr.backend.step

    def slow_step(mbs, plan, *args, **kwargs):
        if plan.plans == slowed["plans"]:
            time.sleep(0.5)
        return step(mbs, plan, *args, **kwargs)

    monkeypatch.setattr(tr.backend, "step", slow_step)
    losses = [tr.step(b) for b in batches[:2]]
    race = tr.auto.trial
    names = [c.name for c in race.candidates]
    slowed["plans"] = race.candidates[0].plans
    n = 2 + 2 * len(names)
    assert n < len(batches)
    losses += [tr.step(b) for b in batches[2:n]]
    # Each trial step's row names the candidate it ran; its schedule is auto's, and it measured nothing timed.
    assert [(h.schedule, h.trial, h.measuring) for h in tr.history[2:]] == [("auto", n, False) for n in names * 2]
    assert [(h.trial, h.measuring) for h in tr.history[:2]] == [(None, True)] * 2
    assert tr.history[2].as_dict()["trial"] == names[0] and "trial" not in tr.history[0].as_dict()
    assert tr.last_result.schedule == "auto" and tr.last_result.plans == race.candidates[-1].plans
    assert tr.auto.trial is None and tr.auto.choice != names[0]
    medians = tr.auto.races[-1]
    assert tr.auto.choice == min(medians, key=medians.get) and medians[names[0]] > 0.5
    kept = race.candidates[names.index(tr.auto.choice)]
    losses.append(tr.step(batches[n]))
    assert (tr.history[-1].schedule, tr.history[-1].measuring, tr.history[-1].trial) == ("auto", False, None)
    assert tr.last_result.plans == kept.plans == tr.plan.plans
    assert max(memory_peaks(tr.plan.plans)) <= M
    ref_losses, ref_params = optax_reference(gpt, params, tx, batches[: n + 1])
    assert len(losses) == n + 1
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(tr.params(), ref_params, rtol=1e-4, atol=1e-6)
    tr.close()


def test_trial_rounds_are_checked_and_recorded_by_checkpoints(tmp_path):
    with pytest.raises(VjpsplitError, match=r"trial_rounds=-1\): give the steps each close candidate runs"):
        P.Schedule("auto", trial_rounds=-1)
    with pytest.raises(VjpsplitError, match=r"trial_rounds=True"):
        P.Schedule("auto", trial_rounds=True)
    with pytest.raises(VjpsplitError, match=r"trial_rounds applies to Schedule\('auto'\), not to '1f1b'"):
        P.Schedule("1f1b", trial_rounds=2)
    tr = P.Trainer(
        _stages(), gpt_params(), optimizer=optax.sgd(0.1), schedule=P.Schedule("auto", trial_rounds=1), microbatches=M
    )
    tr.step(gpt_batch(M * ROWS, seed=3))
    tr.save(tmp_path / "ck")
    again = P.Trainer.restore(tmp_path / "ck", _stages(), optimizer=optax.sgd(0.1))
    assert again.auto.trial_rounds == 1 and again.auto.rounds == 1
    mine = P.Trainer.restore(
        tmp_path / "ck", _stages(), optimizer=optax.sgd(0.1), schedule=P.Schedule("auto", trial_rounds=4)
    )
    assert mine.auto.rounds == 4  # given to restore: it wins
    assert (
        trials.TRIAL_ROUNDS
        == P.Trainer(_stages(), gpt_params(), optimizer=optax.sgd(0.1), schedule="auto", microbatches=M).auto.rounds
    )


def test_a_race_under_a_byte_limit_runs_each_candidate_with_its_own_offload(monkeypatch):
    """Under ``memory_limit_bytes`` auto's own plans may offload and the built-ins do not: each trial step runs
    with the offload of the candidate it runs (switched between steps), and trains as one process does."""
    from vjpsplit_cli.pipeline.training.autoplan import microbatch_bytes
    from vjpsplit_cli.pipeline.runtime.model import model_of

    fixed = {"F": [1.0] * 4, "B": [1.0] * 4, "W": [0.8] * 4, "comm": 0.1, "transfer": 1e12}
    monkeypatch.setattr(P.Trainer, "costs", lambda self: fixed)
    monkeypatch.setattr(autoplan, "contenders", lambda c: contenders(c, margin=float("inf")))
    params, tx = gpt_params(), optax.adamw(1e-2)
    batches = [gpt_batch(M * ROWS, seed=80 + i) for i in range(12)]
    model = model_of(_stages(), params)
    held = microbatch_bytes(model.artifacts, model.batch_microbatches(batches[0], M)[0])
    limit = [2 * b + b // 2 for b in held]  # two microbatches and a half: more in flight only with offload
    tr = P.Trainer(
        _stages(),
        params,
        optimizer=tx,
        schedule=P.Schedule("auto", memory_limit_bytes=limit, trial_rounds=1),
        microbatches=M,
    )
    seen, step = [], tr.backend.step

    def spy(mbs, plan, *args, **kwargs):
        seen.append((plan.name, plan.plans, tr.planned_offload))
        return step(mbs, plan, *args, **kwargs)

    monkeypatch.setattr(tr.backend, "step", spy)
    losses = [tr.step(b) for b in batches[:2]]
    race = tr.auto.trial
    assert race is not None
    offloads = [c.offloaded for c in race.candidates]
    assert any(offloads) and not all(offloads)  # some candidates offload, others do not
    n = 2 + len(race.candidates)
    assert n < len(batches)
    losses += [tr.step(b) for b in batches[2:n]]
    for (name, plans, offload), c in zip(seen[2:n], race.candidates):
        assert (name, plans) == (AUTO, c.plans)
        assert (offload.pairs if offload is not None else frozenset()) == c.offloaded
    assert tr.auto.trial is None
    ref_losses, ref_params = optax_reference(gpt, params, tx, batches[:n])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(tr.params(), ref_params, rtol=1e-4, atol=1e-6)
    tr.close()


def test_where_no_built_in_fits_the_race_names_each_candidate_apart(monkeypatch):
    """At two microbatches per worker no built-in fits (the first stage of each holds four): the measuring step
    ran auto's plans for equal costs, which race (as ``"auto, equal costs"``) against auto's plans for the
    measured costs, each within the limit, under names of their own."""
    monkeypatch.setattr(autoplan, "contenders", lambda c: contenders(c, margin=float("inf")))
    ap = AutoPlan(_stages().artifacts, M, 2, None, trial_rounds=1)
    heavy_b = {"F": [1.0] * 4, "B": [2.0] * 4, "W": [0.2] * 4, "comm": 0.0}  # plans unlike those for equal costs
    _measured(ap, heavy_b)
    race = ap.trial
    assert race is not None
    names = [c.name for c in race.candidates]
    assert len(set(names)) == len(names) and autoplan.EQUAL_COSTS in names and ap.measured_with.name == AUTO
    assert not {"gpipe", "1f1b", "zbh1"} & set(names)
    assert all(max(memory_peaks(c.plans)) <= 2 for c in race.candidates)
    for _ in names:
        plan, _ = ap.next_step(MBS)
        ap.after(plan, lambda: heavy_b, False, 1.0)
    assert ap.races == [dict.fromkeys(names, 1.0)] and ap.choice == names[0]
