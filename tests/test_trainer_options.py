"""The Trainer's options as typed values, and the old keywords: each group warns, naming the new form, and builds
the very same Trainer; an old keyword with the value it goes into is one error."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import warnings
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from models import assert_trees_close, mlp_stage_artifacts
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.pipeline.training import options as options_module
from vjpsplit_cli.pipeline.training import trainer_setup  # where Trainer._start opens the backend

ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def _stages():
    return vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")


@functools.lru_cache(maxsize=None)
def _per_stage():
    return mlp_stage_artifacts(3, np.random.default_rng(0), 8, 5, scale=2.0)


class _Opened:
    """What ``open_backend`` was given, in place of the workers (no export, no threads, no Ray)."""

    def __init__(
        self, runner, ownership, optimizer, states, *, layout, step_timeout, data_parallel=1, hang_report=None
    ):
        self.runner, self.step_timeout, self.hang_report = runner, step_timeout, hang_report
        self.data_parallel = data_parallel

    def close(self):
        pass


@pytest.fixture
def opened(monkeypatch):
    monkeypatch.setattr(trainer_setup, "open_backend", _Opened)


def _settings(tr):
    """Everything the options decide, as the Trainer holds it."""
    auto = None if tr.auto is None else (tr.auto.memory_limit, tr.auto.memory_limit_bytes)
    return (
        tr.schedule,
        tr.plan.name,
        auto,
        tr.runner,
        tr.data_parallel,
        tr.observe,
        tr.backend.step_timeout,
        tr.backend.hang_report,
        tr.ownership.holders,
    )


def test_the_signatures_are_short_typed_and_public():
    init = inspect.signature(P.Trainer.__init__).parameters
    assert len(init) <= 14, list(init)  # self counted; rng= and aux= (SPEC: "Training what users train") made it 14
    assert not [n for n in init if n.startswith("_")]
    restore = inspect.signature(P.Trainer.restore).parameters
    assert not [n for n in restore if n.startswith("_")]
    for params in (init, restore):
        (kw,) = [p for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
        assert kw.name == "deprecated" and kw.annotation == "Unpack[Deprecated]"  # typed, not **options: Any
    assert set(options_module.Deprecated.__annotations__) == set(options_module.LEGACY)
    for name in ("Schedule", "InProcess", "Ray", "Observe", "PerStage"):
        cls = getattr(P, name)
        assert name in P.__all__ and "Args:" in cls.__doc__ and cls.__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        P.Schedule("zbh1").name = "gpipe"


def _tied():
    return [[(0, "w"), (1, "w")]]


def _tied_params():
    params = [dict(p) for p in _per_stage()[1]]
    params[1]["w"] = params[0]["w"].copy()
    return params


D0 = jax.devices()[0]
# One row per old keyword group: the old keywords, the new form, the group's name in the warning.
GROUPS = {
    "schedule name": (dict(schedule_name="zbh1"), dict(schedule="zbh1"), "schedule="),
    "auto in microbatches": (
        dict(schedule_name="auto", memory_limit=2),
        dict(schedule=P.Schedule("auto", memory_limit=2)),
        "schedule=Schedule(name='auto', memory_limit=2)",
    ),
    "auto in bytes": (
        dict(schedule_name="auto", memory_limit_bytes="1KiB"),
        dict(schedule=P.Schedule("auto", memory_limit_bytes="1KiB")),
        "schedule=Schedule(name='auto', memory_limit_bytes='1KiB')",
    ),
    "in-process": (
        dict(devices=[[D0]] * 4, data_parallel=1),
        dict(runner=P.InProcess(devices=[[D0]] * 4, data_parallel=1)),
        "runner=InProcess(devices=",
    ),
    "ray": (
        dict(
            runner="ray",
            address="ray://head:10001",
            runtime_env={"pip": []},
            actor_options=[{}] * 4,
            schedule_timeout=5,
        ),
        dict(
            runner=P.Ray(
                address="ray://head:10001", runtime_env={"pip": []}, actor_options=[{}] * 4, schedule_timeout=5
            )
        ),
        "runner=Ray(address='ray://head:10001', runtime_env={'pip': []}, actor_options=",
    ),
    "observe": (
        dict(progress=False, timeline=True, trace_dir="t", trace_every=3, step_timeout=9.0, hang_report="h.json"),
        dict(observe=P.Observe(timeline=True, trace_dir="t", trace_every=3, step_timeout=9.0, hang_report="h.json")),
        "observe=Observe(progress=False, timeline=True, trace_dir='t', trace_every=3, step_timeout=9.0",
    ),
    "tied": (dict(tied=_tied()), dict(stages="per-stage"), "stages=PerStage(artifacts, tied="),
}


@pytest.mark.parametrize("group", list(GROUPS))
def test_each_old_keyword_group_warns_naming_the_new_form_and_builds_the_same_trainer(opened, group):
    old, new, form = GROUPS[group]
    per_stage = group == "tied"
    stages, params = (_per_stage()[0], _tied_params()) if per_stage else (_stages(), gpt_params())
    if new.get("stages") == "per-stage":
        new = {"stages": P.PerStage(stages, tied=_tied())}
    kw = dict(optimizer=optax.sgd(0.1), microbatches=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        was = P.Trainer(stages, params, **old, **kw)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in caught]
    msg = str(deprecations[0].message)
    names = ", ".join(f"{k}=" for k in old if k != "runner")
    assert msg.startswith(f"Trainer({names}) is deprecated") and form in msg, msg
    assert deprecations[0].filename == __file__  # the warning points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        now = P.Trainer(new.pop("stages", stages), params, **new, **kw)
    assert _settings(was) == _settings(now)


def test_restore_takes_the_old_keywords_too_and_says_so(tmp_path):
    arts, params = _per_stage()
    batch = (np.ones((4, 8), np.float32), np.zeros(4, np.int32))
    tr = P.Trainer(arts, params, optimizer=optax.sgd(0.1), microbatches=2, schedule="zbh1")
    tr.step(batch)
    tr.save(tmp_path / "ck")
    with pytest.warns(DeprecationWarning, match=r"Trainer.restore\(schedule_name=\) is deprecated.*schedule="):
        again = P.Trainer.restore(tmp_path / "ck", arts, optimizer=optax.sgd(0.1), schedule_name="gpipe")
    assert again.plan.name == "gpipe" and again.step_count == 1
    np.testing.assert_array_equal(
        again.step(batch),
        P.Trainer.restore(tmp_path / "ck", arts, optimizer=optax.sgd(0.1), schedule="gpipe").step(batch),
    )


MIXED = {
    "schedule_name with schedule": (dict(schedule_name="zbh1", schedule="gpipe"), "schedule_name="),
    "memory_limit with a Schedule": (dict(memory_limit=2, schedule=P.Schedule("auto")), "memory_limit="),
    "devices with InProcess": (dict(devices=[[D0]] * 4, runner=P.InProcess()), "devices="),
    "address with Ray": (dict(address="ray://head:10001", runner=P.Ray()), "address="),
    "progress with observe": (dict(progress=True, observe=P.Observe()), "progress="),
}


@pytest.mark.parametrize("case", list(MIXED))
def test_an_old_keyword_with_the_value_it_goes_into_is_one_error(opened, case):
    given, name = MIXED[case]
    with pytest.raises(VjpsplitError) as e:
        P.Trainer(_stages(), gpt_params(), optimizer=optax.sgd(0.1), microbatches=2, **given)
    msg = str(e.value)
    assert msg.startswith(f"Trainer({name}) and ") and "give it once" in msg and "\n" not in msg, msg


def test_tied_with_a_per_stage_value_is_one_error(opened):
    arts, _ = _per_stage()
    with pytest.raises(VjpsplitError, match=r"Trainer\(tied=\) and stages= say the same thing"):
        P.Trainer(P.PerStage(arts, _tied()), _tied_params(), optimizer=optax.sgd(0.1), microbatches=2, tied=_tied())


def test_old_keywords_of_the_other_runner_and_unknown_keywords_are_refused(opened):
    kw = dict(optimizer=optax.sgd(0.1), microbatches=2)
    # data_parallel is both runners': with runner="ray" the old keyword goes into Ray(...).
    with pytest.warns(DeprecationWarning, match=r"write runner=Ray\(data_parallel=2\)"):
        options = options_module.from_legacy("Trainer", _stages(), None, "ray", None, {"data_parallel": 2})
    assert options.runner == P.Ray(data_parallel=2)
    with pytest.raises(VjpsplitError, match=r"data_parallel=0: give the number of replicas"):
        P.Ray(data_parallel=0)
    with pytest.raises(VjpsplitError, match=r"devices= places the stages of this process"):
        P.Trainer(_stages(), gpt_params(), devices=[[D0]] * 4, runner="ray", **kw)
    with pytest.raises(VjpsplitError, match=r"address= configure Ray's actors, but the runner is 'inprocess'"):
        P.Trainer(_stages(), gpt_params(), address="ray://head:10001", **kw)
    with pytest.raises(VjpsplitError, match="unknown runner 'mpi'"):
        P.Trainer(_stages(), gpt_params(), runner="mpi", **kw)
    with pytest.raises(TypeError, match="unexpected keyword argument 'schedual'"):
        P.Trainer(_stages(), gpt_params(), schedual="zbh1", **kw)


def test_bad_option_values_are_one_error_when_made():
    with pytest.raises(VjpsplitError, match="give a schedule's name or its plans, not both"):
        P.Schedule("zbh1", plans=[[]])
    with pytest.raises(VjpsplitError, match="not both"):
        P.Schedule("auto", memory_limit=2, memory_limit_bytes="1KiB")
    with pytest.raises(VjpsplitError, match=r"apply to Schedule\('auto'\), not to 'custom'"):
        P.Schedule(plans=[[]], memory_limit=2)
    with pytest.raises(VjpsplitError, match=r"data_parallel=0: give the number of replicas"):
        P.InProcess(data_parallel=0)
    with pytest.raises(VjpsplitError, match=r"trace_every=0: give how often to time a step"):
        P.Observe(trace_every=0)
    assert P.Schedule("auto", memory_limit=np.int64(3)).memory_limit == 3  # a NumPy scalar is a number
    assert P.Observe(trace_every=np.int64(2)).trace_every == 2


@pytest.mark.parametrize("seconds", [-1, 0, float("nan"), float("inf"), "30", None, True])
def test_a_step_timeout_that_is_not_seconds_is_refused_when_made(seconds):
    # -1 and 0 failed every step as a fake hang, NaN turned the timeout off, "30" was a raw TypeError mid-step.
    with pytest.raises(VjpsplitError, match=rf"step_timeout={re.escape(repr(seconds))}.*give seconds, a finite number"):
        P.Observe(step_timeout=seconds)


def test_a_step_timeout_of_seconds_is_kept_as_a_float():
    assert P.Observe(step_timeout=np.float32(2.5)).step_timeout == 2.5
    assert type(P.Observe(step_timeout=30).step_timeout) is float


@pytest.mark.parametrize("count", ["2", 2.0, 0, -2, True, None])
def test_microbatches_that_are_not_a_count_are_refused_at_construction(opened, count):
    with pytest.raises(VjpsplitError, match=rf"microbatches={re.escape(repr(count))}: give how many microbatches"):
        P.Trainer(_stages(), gpt_params(), optimizer=optax.sgd(0.1), microbatches=count)
    assert P.Trainer(_stages(), gpt_params(), optimizer=optax.sgd(0.1), microbatches=np.int64(2)).microbatches == 2


def test_a_new_form_trainer_trains_as_the_old_one():
    """Not just the same settings: the same losses, bitwise, from the two spellings of one configuration."""
    batch, tx = gpt_batch(8), optax.sgd(0.1)
    new = P.Trainer(
        _stages(), gpt_params(), optimizer=tx, microbatches=2, schedule="zbh1", observe=P.Observe(timeline=True)
    )
    with pytest.warns(DeprecationWarning):
        old = P.Trainer(_stages(), gpt_params(), optimizer=tx, microbatches=2, schedule_name="zbh1", timeline=True)
    assert new.step(batch) == old.step(batch) and new.last_result.timed and old.last_result.timed


def _calls_with_old_keywords(tree: ast.AST) -> list[int]:
    lines = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if isinstance(f, ast.Attribute) and f.attr == "restore":
                name = "restore" if "Trainer" in ast.unparse(f.value) else ""
            if name in ("Trainer", "restore") and {k.arg for k in n.keywords} & set(options_module.LEGACY):
                lines.append(n.lineno)
    return lines


def test_docs_samples_benchmarks_and_tests_write_the_new_form():
    """Only this file (which asserts the deprecation) calls the Trainer with an old keyword."""
    found = []
    for path in [*ROOT.glob("tests/**/*.py"), *ROOT.glob("samples/**/*.py"), *ROOT.glob("benchmarks/*.py")]:
        if path.resolve() == Path(__file__).resolve():
            continue
        found += [f"{path.relative_to(ROOT)}:{ln}" for ln in _calls_with_old_keywords(ast.parse(path.read_text()))]
    for path in [ROOT / "README.md", *ROOT.glob("docs/**/*.md")]:
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S):
            try:
                tree = ast.parse(block.replace("...", "None"))
            except SyntaxError:
                continue
            found += [f"{path.relative_to(ROOT)}: {ln}" for ln in _calls_with_old_keywords(tree)]
    assert not found, found


def test_restore_takes_trainers_opt_state_and_step_count_in_place_of_the_checkpoints(tmp_path):
    """As the contract says, restore takes Trainer's keywords but params: a given opt_state and step_count win."""
    arts, params = _per_stage()
    batch = (np.ones((4, 8), np.float32), np.zeros(4, np.int32))
    tx = optax.adam(1e-2)
    with P.Trainer(arts, params, optimizer=tx, microbatches=2) as tr:
        fresh_state = tr.state()[1]  # before any step: optax's init
        tr.step(batch)
        tr.save(tmp_path / "ck")
        saved_state = tr.state()[1]
    with P.Trainer.restore(tmp_path / "ck", arts, optimizer=tx) as again:
        assert again.step_count == 1
        assert_trees_close(again.state()[1], saved_state, rtol=0, atol=0)
    with P.Trainer.restore(tmp_path / "ck", arts, optimizer=tx, opt_state=fresh_state, step_count=7) as again:
        assert again.step_count == 7
        assert_trees_close(again.state()[1], fresh_state, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["zbh", "atuo", "custom"])
def test_a_schedule_typo_is_refused_when_made_listing_auto_too(opened, name):
    said = rf"unknown schedule '{name}'; use one of gpipe, 1f1b, zbh1, zbv, interleaved1f1b, dualpipev, or 'auto'"
    with pytest.raises(VjpsplitError, match=said):
        P.Schedule(name)
    with pytest.raises(VjpsplitError, match=said):
        P.Trainer(_stages(), gpt_params(), optimizer=optax.sgd(0.1), microbatches=2, schedule=name)
