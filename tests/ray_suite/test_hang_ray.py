"""Seeing a step on Ray: a timed step's trace on the driver's clock, and a stuck step that says where it is."""

from __future__ import annotations

import json
import re
import sys
import time

import blocking
import optax
import pytest
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs
from tracecheck import check_trace_file, flow_pairs, op_slices

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.pipeline.training.ray_backend import TrainActor, TrainPipeline

STUCK_STEP = 2  # the actors' step count: the Trainer's second step


class SlowActor(TrainActor):
    """A TrainActor whose stage 1 hangs (sleeps far past the step's limit) in its F of microbatch 1 of the
    second step: a host that blocks. Sent to the actors by value (this module is not importable there)."""

    def run_step(self, step, ops, batch, microbatches, timed, scales=None):
        st = self.stage_workers.get(1)
        if st is not None and step == STUCK_STEP:
            real = type(st).forward

            def forward(mb, x, side, worker=None, microbatches=None):
                if mb == 1:
                    time.sleep(60)
                return real(st, mb, x, side, worker=worker, microbatches=microbatches)

            st.forward = forward
        return super().run_step(step, ops, batch, microbatches, timed, scales)


class CallbackActor(TrainActor):
    """A TrainActor whose stage 1 reads its input of microbatch 1 through a host callback (``blocking``) that
    blocks from the second step on: the forward's dispatch returns and its outputs never get computed."""

    def run_step(self, step, ops, batch, microbatches, timed, scales=None):
        st = self.stage_workers.get(1)
        if st is not None:
            if not hasattr(self, "hold"):
                self.hold, _ = blocking.instance_blocks(st, 1)
            if step == STUCK_STEP:
                self.hold.set()
        return super().run_step(step, ops, batch, microbatches, timed, scales)


@pytest.fixture(scope="module")
def stages():
    return vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")


@pytest.mark.timeout(300)
def test_a_ray_step_traces_on_the_drivers_clock_and_a_stuck_one_names_its_op(
    ray_session, stages, tmp_path, monkeypatch
):
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    monkeypatch.setattr(TrainPipeline, "actor_class", SlowActor)
    report = tmp_path / "hang.json"
    with P.Trainer(
        stages,
        gpt_params(),
        optimizer=optax.sgd(0.1),
        microbatches=2,
        runner="ray",
        observe=P.Observe(trace_dir=tmp_path, hang_report=report),
    ) as tr:
        t0 = time.monotonic()
        tr.step(gpt_batch(4), timed=True)
        t1 = time.monotonic()
        doc = check_trace_file(tmp_path / "step-1.trace.json")
        r = tr.last_result
        # Per microbatch: 4 Fs, a whole B on the first and last stages, an I and a W on the two between (their
        # B hands its cotangent on early, timed as untimed); a flow per value that crosses a stage boundary.
        assert len(op_slices(doc)) == len(r.events) == 2 * (4 + 2 + 2 * 2) and len(flow_pairs(doc)) == 3 * 2 * 2
        # The actors' clocks moved onto the driver's: every slice inside the step as the driver saw it.
        origin = doc["otherData"]["origin_s"]
        assert t0 <= origin and all(origin + (s["ts"] + s["dur"]) / 1e6 <= t1 for s in op_slices(doc).values())
        names = {(ev["tid"], ev["name"]) for ev in doc["traceEvents"] if ev["ph"] == "X"}
        assert {(w + 1, "update") for w in range(4)} <= names and (0, "wait for the workers") in names

        tr.backend.rp.step_timeout = 4.0  # the stuck step: an error within step_timeout + 2 s
        t0 = time.monotonic()
        with pytest.raises(VjpsplitError) as info:
            tr.step(gpt_batch(4))
        assert time.monotonic() - t0 < 4.0 + 2.0
    text = str(info.value)
    assert "did not finish within step_timeout=4 s" in text and "\n" not in text
    assert "worker 1: running F stage 1 mb 1" in text
    assert "worker 2: F stage 2 mb 1 waits for the activation from stage 1 (worker 1 has not sent it)" in text
    body = json.loads(report.read_text())
    rows = {w["worker"]: w for w in body["workers"]}
    assert rows[1]["now"].startswith("worker 1: running F stage 1 mb 1")
    assert [(o["kind"], o["stage"], o["mb"]) for o in rows[1]["ops"]][-1] == ("F", 1, 0)
    assert str(report) in text


@pytest.mark.timeout(300)
@pytest.mark.parametrize("timed", [False, True])
def test_a_ray_step_stuck_in_a_forward_names_that_forward_not_a_delivery(
    ray_session, stages, tmp_path, monkeypatch, timed
):
    """A step on Ray, stage 1's F of microbatch 1 stuck in a host callback (its dispatch returned, its outputs
    never computed): the error names that F as what worker 1 runs, and no value as sent and never received
    (worker 1's sender never sent what depends on it); the report's row says the same. Timed, the actor's list
    dispatched past that F as an untimed one does (a watcher times it), so it is named as dispatched, not as
    an operation the list waits inside."""
    for module in (sys.modules[__name__], blocking):
        ray_session.cloudpickle.register_pickle_by_value(module)
    monkeypatch.setattr(TrainPipeline, "actor_class", CallbackActor)
    report = tmp_path / "hang.json"
    with P.Trainer(
        stages,
        gpt_params(),
        optimizer=optax.sgd(0.1),
        microbatches=4,
        runner="ray",
        observe=P.Observe(hang_report=report),
    ) as tr:
        tr.step(gpt_batch(8), timed=timed)  # compiled, the callback's too
        tr.backend.rp.step_timeout = 4.0
        with pytest.raises(VjpsplitError) as info:
            tr.step(gpt_batch(8, seed=3), timed=timed)
    text = str(info.value)
    assert "did not finish within step_timeout=4 s" in text, text
    if timed:
        assert "worker 1: running or waiting: F stage 1 mb 1 (dispatched" in text, text
    else:
        assert re.search(r"worker 1: running (F stage 1 mb 1 since|or waiting: F stage 1 mb 1 \(dispatched)", text), (
            text
        )
    assert "never received" not in text, text
    assert "worker 2: F stage 2 mb 1 waits for the activation from stage 1 (worker 1 has not sent it)" in text, text
    rows = {w["worker"]: w for w in json.loads(report.read_text())["workers"]}
    assert "F stage 1 mb 1" in rows[1]["now"]
