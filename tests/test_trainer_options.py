"""The Trainer's options as typed values, one spelling each: the keywords they replaced are gone (issue 71) but
the contract's own (``schedule_name=``, ``memory_limit=``, ``devices=``, ``address=``, plans as ``schedule=``),
each the field of a value; what the project writes uses the values."""

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
from stage_models import gpt, gpt_params, gpt_specs

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.pipeline.training import trainer  # where Trainer._start opens the backend

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
    monkeypatch.setattr(trainer, "open_backend", _Opened)


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
    # self counted; rng= and aux= (SPEC: "Training what users train") made it 14, and the contract's keywords one
    assert len(init) <= 15, list(init)
    assert not [n for n in init if n.startswith("_")]
    restore = inspect.signature(P.Trainer.restore).parameters
    assert not [n for n in restore if n.startswith("_")]
    for params in (init, restore):  # the only ** is the contract's spellings, typed
        assert [str(p) for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD] == [
            "**keywords: 'Unpack[ContractKeywords]'"
        ]
    for name in ("Schedule", "InProcess", "Ray", "Observe", "PerStage"):
        cls = getattr(P, name)
        assert name in P.__all__ and "Args:" in cls.__doc__ and cls.__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        P.Schedule("zbh1").name = "gpipe"


# The keywords the option values replaced (0.1.0's deprecated spellings) that the contract does not write, each
# gone: Python's own TypeError.
REMOVED = {
    "data_parallel": 2,
    "runtime_env": {},
    "actor_options": [{}],
    "schedule_timeout": 5,
    "progress": True,
    "timeline": True,
    "trace_dir": "t",
    "trace_every": 3,
    "step_timeout": 9.0,
    "hang_report": "h.json",
    "tied": [],
}


@pytest.mark.parametrize("keyword", list(REMOVED))
def test_the_replaced_keywords_are_gone(opened, keyword):
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
        P.Trainer(_stages(), gpt_params(), optimizer=optax.sgd(0.1), microbatches=2, **{keyword: REMOVED[keyword]})


def test_the_contracts_keywords_are_the_fields_of_the_values(opened, recwarn):
    # docs/contract.md writes Trainer(schedule_name=..., memory_limit=...), runner="ray", address=..., devices=:
    # each is the field of schedule= or runner= it names, without a warning.
    kw = dict(optimizer=optax.sgd(0.1), microbatches=2)
    tr = P.Trainer(_stages(), gpt_params(), schedule_name="auto", memory_limit=2, **kw)
    assert tr.schedule == P.Schedule("auto", memory_limit=2)
    d = jax.devices()[0]
    tr = P.Trainer(_stages(), gpt_params(), schedule_name="zbh1", devices=[[d], [d]], **kw)
    assert tr.schedule == P.Schedule("zbh1") and tr.runner == P.InProcess(devices=[[d], [d]])
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]
    with pytest.raises(VjpsplitError, match=r"schedule_name=\) and schedule= say the same thing"):
        P.Trainer(_stages(), gpt_params(), schedule="1f1b", schedule_name="zbh1", **kw)
    with pytest.raises(VjpsplitError, match=r"address=\) is Ray's: give runner=Ray\(address=...\)"):
        P.Trainer(_stages(), gpt_params(), address="ray://head:10001", **kw)
    with pytest.raises(VjpsplitError, match=r"devices=\) is InProcess's"):
        P.Trainer(_stages(), gpt_params(), runner="ray", devices=[[d], [d]], **kw)


def test_plans_are_a_schedule_and_a_runner_is_a_name_or_its_value(opened):
    plans = P.schedule("1f1b", 4, 2)
    kw = dict(optimizer=optax.sgd(0.1), microbatches=2)
    assert P.Trainer(_stages(), gpt_params(), schedule=plans, **kw).plan.name == "custom"  # as the contract writes
    assert P.Trainer(_stages(), gpt_params(), schedule=P.Schedule(plans=plans), **kw).plan.name == "custom"
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


# The contract's spellings (docs/contract.md): accepted, but what the project writes is the value form.
CONTRACT = {"schedule_name", "memory_limit", "memory_limit_bytes", "devices", "address"}
MARK = "# the contract's spelling"  # a line testing one of them says so


def _calls_with_old_keywords(tree: ast.AST, source: str = "") -> list[int]:
    lines, text = [], source.splitlines()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if isinstance(f, ast.Attribute) and f.attr == "restore":
                name = "restore" if "Trainer" in ast.unparse(f.value) else ""
            given = {k.arg for k in n.keywords}
            if text and MARK in "".join(text[n.lineno - 1 : n.end_lineno]):
                continue
            if name in ("Trainer", "restore") and given & (set(REMOVED) | CONTRACT):
                lines.append(n.lineno)
            if name in ("run", "run_inprocess") and given & {"schedule_name", "address", "memory_limit"}:
                lines.append(n.lineno)
            if name == "run" and "devices" in given:
                lines.append(n.lineno)
    return lines


def test_docs_samples_benchmarks_and_tests_write_the_new_form():
    """No call in the tests, samples, benchmarks or docs' code spells a Trainer or a runner the old way."""
    found = []
    for path in [*ROOT.glob("tests/**/*.py"), *ROOT.glob("samples/**/*.py"), *ROOT.glob("benchmarks/*.py")]:
        if path.resolve() == Path(__file__).resolve():
            continue
        text = path.read_text()
        found += [f"{path.relative_to(ROOT)}:{ln}" for ln in _calls_with_old_keywords(ast.parse(text), text)]
    for path in [ROOT / "README.md", *(p for p in ROOT.glob("docs/**/*.md") if p.name != "contract.md")]:
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


def test_a_ray_trainer_does_not_warn_of_the_drivers_devices(monkeypatch):
    # The driver's placement only shapes the optimizer programs; each actor places its stages on its own devices,
    # so "4 workers need 4 devices but this host has 1" was a false warning for runner="ray".
    from vjpsplit_cli.pipeline.training import backend

    class Reached(Exception):
        pass

    def ray_backend(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(backend, "RayBackend", ray_backend)
    kw = dict(optimizer=optax.sgd(0.1), microbatches=2)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with pytest.raises(Reached):
            P.Trainer(_stages(), gpt_params(), runner="ray", **kw)
    assert not [w for w in got if issubclass(w.category, P.SharedDevicesWarning)], [str(w.message) for w in got]
    with pytest.warns(P.SharedDevicesWarning, match="4 workers need 4 devices"):  # in-process, it is true
        P.Trainer(_stages(), gpt_params(), **kw).close()
