"""Seeing a step: worker threads that end, a stuck step that says where it is, the trace file, stragglers."""

from __future__ import annotations

import functools
import gc
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import optax
import pytest
from blocking import callback_blocks
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs
from tracecheck import check_trace_file, flow_pairs, op_slices

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.pipeline.runtime import stepwatch, timed, untimed, workerthreads
from vjpsplit_cli.pipeline.runtime.hang_report import StepInterrupted
from vjpsplit_cli.pipeline.runtime.worker import StageWorker


@functools.lru_cache(maxsize=None)
def _stages():
    return vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")


def _trainer(**kw):
    kw = {"schedule": "1f1b", "microbatches": 2, **kw}
    return P.Trainer(_stages(), gpt_params(), optimizer=optax.sgd(0.1), **kw)


def _worker_threads():
    """A Trainer's threads: its steps' thread and its timed steps' watchers (one per device)."""
    return [t for t in threading.enumerate() if t.name.startswith(("vjpsplit-step-", "vjpsplit-watch-"))]


def _gone(before, timeout=10.0):
    """Whether every worker thread not in ``before`` has ended within ``timeout``."""
    end = time.monotonic() + timeout
    for t in _worker_threads():
        if t not in before:
            t.join(max(end - time.monotonic(), 0.0))
    return all(t in before for t in _worker_threads())


def _in_thread(fn, timeout=60.0):
    """``fn()`` in a thread of its own: its value or what it raised, or a failure if it is still running."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still running after {timeout:g} s: it hangs"
    return out


# -- item 11: threads ------------------------------------------------------------------------------------------


def test_a_trainer_dropped_without_close_ends_its_worker_threads():
    before = set(_worker_threads())
    for _ in range(3):
        tr = _trainer()
        tr.step(gpt_batch(4), timed=True)
        assert len(set(_worker_threads()) - before) >= 2  # the step's and a watcher, while the Trainer lives
        del tr
    gc.collect()
    assert _gone(before)  # 3 dropped Trainers: 6 threads or more before, none now


def test_a_trainer_as_a_context_manager_ends_its_worker_threads():
    before = set(_worker_threads())
    with _trainer() as tr:
        tr.step(gpt_batch(4), timed=True)
        assert set(_worker_threads()) - before
    assert _gone(before, timeout=0.1)


class _BadBar:
    def update(self, n):
        raise RuntimeError("the bar broke")

    def close(self):
        pass


def test_a_job_that_raises_out_of_a_worker_loop_fails_the_step_and_the_next_step_runs(monkeypatch):
    """The progress bar's update raises in a worker thread, outside its operation: the step fails with that
    error (before: the thread died and the other workers waited for its results forever)."""
    tr, ref = _trainer(), _trainer()
    monkeypatch.setattr(timed, "progress_bar", lambda total, enabled: _BadBar())
    out = _in_thread(lambda: tr.step(gpt_batch(4), timed=True))
    assert "the bar broke" in str(out.get("error"))
    monkeypatch.setattr(timed, "progress_bar", lambda total, enabled: None)
    out = _in_thread(lambda: tr.step(gpt_batch(4), timed=True))  # the same threads serve the next step
    assert out.get("value") == ref.step(gpt_batch(4), timed=True)
    tr.close()
    ref.close()


def test_a_job_that_raises_never_ends_its_pool_thread():
    pool = workerthreads.WorkerThreads(1)

    def bad():
        raise RuntimeError("job failed")

    (job,) = pool.start([bad])
    assert job.event.wait(10) and "job failed" in str(job.error)
    (job,) = pool.start([lambda: None])
    assert job.event.wait(10) and job.error is None  # the thread still serves
    pool.close()


# -- a timed step dispatches as an untimed one does --------------------------------------------------------------


def test_a_timed_step_dispatches_the_next_operation_before_the_last_ones_result_is_ready():
    """Stage 0's forward of microbatch 0 reads its input through a host callback that waits (on XLA's threads:
    its dispatch returned): the timed step still hands out the next operations, stage 0's forward of
    microbatch 1 among them, and that forward's event starts once its input exists, after the callback
    returned (before: the step's thread waited for each operation's inputs and results, so nothing more was
    dispatched until the callback returned)."""
    from blocking import instance_blocks

    tr, ref = _trainer(), _trainer()
    for t in (tr, ref):
        t.step(gpt_batch(4), timed=True)  # the first timed step: every call cold, each waited for
    st = tr.backend.trainers[0].worker
    hold, release = instance_blocks(st, 0)
    blocked, handed = st.forward, threading.Event()

    def forward(m, x, side, worker=None, microbatches=None):
        if m == 1 and hold.is_set():
            handed.set()
        return blocked(m, x, side, worker=worker, microbatches=microbatches)

    st.forward = forward
    tr.step(gpt_batch(4), timed=True)  # compiles the blocker, which passes its input through
    ref.step(gpt_batch(4), timed=True)
    hold.set()
    step = threading.Thread(target=lambda: out.update(value=tr.step(gpt_batch(4, seed=7), timed=True)), daemon=True)
    out: dict[str, object] = {}
    step.start()
    try:
        assert handed.wait(10), "the timed step waited for stage 0's forward of mb 0 before handing on"
    finally:
        released = time.monotonic()
        release.set()
        step.join(60)
    assert out.get("value") == ref.step(gpt_batch(4, seed=7), timed=True)
    # Its input exists once the callback returned: that is when the forward's time starts, not at its dispatch.
    (f0,) = [e for e in tr.last_result.events if (e.kind, e.stage, e.mb) == ("F", 0, 0)]
    assert f0.own is None and f0.end >= f0.start >= released
    tr.close()
    ref.close()


# -- a stuck step says where it is -----------------------------------------------------------------------------


def _block_stage(monkeypatch, stage, mb, release):
    """Stage ``stage``'s forward of microbatch ``mb`` blocks until ``release`` is set (a host that hangs)."""
    real = StageWorker.forward

    def forward(self, m, x, side, worker=None, microbatches=None):
        if self.stage_index == stage and m == mb:
            release.wait()
        return real(self, m, x, side, worker=worker, microbatches=microbatches)

    monkeypatch.setattr(StageWorker, "forward", forward)


def test_a_timed_step_past_step_timeout_names_the_stuck_op_and_what_each_worker_waits_for(monkeypatch, tmp_path):
    release = threading.Event()
    report = tmp_path / "hang.json"
    tr = _trainer(observe=P.Observe(hang_report=report))
    tr.step(gpt_batch(4), timed=True)  # compiled: the limit below is the hang's, not a first call's
    tr.backend.step_timeout = 1.5
    _block_stage(monkeypatch, stage=1, mb=1, release=release)
    unstick = threading.Timer(1.5 + stepwatch.GRACE / 2, release.set)  # back within the stop's grace
    t0 = time.monotonic()
    unstick.start()
    out = _in_thread(lambda: tr.step(gpt_batch(4), timed=True))
    took = time.monotonic() - t0
    release.set()
    err = out.get("error")
    assert isinstance(err, VjpsplitError), out
    assert took < 1.5 + 2.0
    text = str(err)
    assert "did not finish within step_timeout=1.5 s" in text
    assert "worker 1: running F stage 1 mb 1" in text
    # Dispatched from one thread, as an untimed step: worker 2's next operation is not handed out yet.
    assert "worker 2: waits to be handed its next operation (F stage 2 mb 0)" in text
    assert str(report) in text and "\n" not in text
    body = json.loads(report.read_text())
    assert body["message"] == text
    rows = {w["worker"]: w for w in body["workers"]}
    assert rows[1]["now"].startswith("worker 1: running F stage 1 mb 1")
    # Worker 1's ring holds the last step's operations and this step's F of mb 0, oldest first.
    ops = [(r["kind"], r["stage"], r["mb"]) for r in rows[1]["ops"]]
    assert ops[-1] == ("F", 1, 0) and ("B", 1, 1) in ops
    assert [r["start_ms"] for r in rows[1]["ops"]] == sorted(r["start_ms"] for r in rows[1]["ops"])
    # A cold call (the first timed step's first of each) was waited for: its end is given. A warm one was
    # dispatched as untimed (its watcher times it): its dispatch is given, as this step's F of mb 0 is.
    waited = [r for r in rows[1]["ops"] if r["dispatched_ms"] is None]
    handed = [r for r in rows[1]["ops"] if r["end_ms"] is None]
    assert waited and all(r["end_ms"] >= r["start_ms"] for r in waited)
    assert rows[1]["ops"][-1] in handed and all(r["dispatched_ms"] >= r["start_ms"] for r in handed)
    assert len(waited) + len(handed) == len(rows[1]["ops"])
    # The thread came back within the grace: the Trainer steps on; nothing was applied by the failed step.
    monkeypatch.undo()
    ref = _trainer()
    ref.step(gpt_batch(4), timed=True)
    assert _in_thread(lambda: tr.step(gpt_batch(4, seed=7), timed=True)).get("value") == ref.step(gpt_batch(4, seed=7))
    tr.close()
    ref.close()


def test_a_thread_stuck_for_good_ends_the_trainers_steps_and_nothing_hangs(monkeypatch, tmp_path):
    release = threading.Event()
    tr = _trainer(observe=P.Observe(hang_report=tmp_path / "h.json"))
    tr.step(gpt_batch(4), timed=True)
    tr.backend.step_timeout = 1.0
    _block_stage(monkeypatch, stage=2, mb=0, release=release)
    try:
        err = _in_thread(lambda: tr.step(gpt_batch(4), timed=True)).get("error")
        assert "still stuck after 1 s: the step's thread (in worker 2's dispatch)" in str(err)
        assert "restore the last checkpoint" in str(err)
        err = _in_thread(lambda: tr.step(gpt_batch(4), timed=True)).get("error")
        assert "an earlier step timed out" in str(err) and "running F stage 2 mb 0" in str(err)
        _in_thread(tr.close, timeout=10)  # does not wait for the stuck thread
    finally:
        release.set()


def test_ctrl_c_during_a_timed_step_is_one_error_naming_what_each_worker_does(monkeypatch, tmp_path):
    """Ctrl-C (here SIGINT from a timer) while a stage hangs: a ``StepInterrupted`` (also a
    ``KeyboardInterrupt``) naming the stuck op, the report written."""
    import os
    import signal

    release = threading.Event()
    tr = _trainer(observe=P.Observe(step_timeout=60, hang_report=tmp_path / "h.json"))
    tr.step(gpt_batch(4), timed=True)
    _block_stage(monkeypatch, stage=0, mb=1, release=release)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            tr.step(gpt_batch(4), timed=True)
    finally:
        timer.cancel()
        release.set()
    assert isinstance(info.value, VjpsplitError)
    assert "the step was interrupted" in str(info.value) and "worker 0: running F stage 0 mb 1" in str(info.value)
    assert (tmp_path / "h.json").exists()
    assert time.monotonic() - t0 < 1.0 + 2.0
    tr.close()


@pytest.mark.parametrize("timed", [True, False])
def test_a_first_step_past_step_timeout_while_compiling_says_it_was_compiling(monkeypatch, tmp_path, timed):
    """A first step whose compilation outlasts step_timeout (XLA's compile held here, on the step's thread only):
    the error says that thread was compiling, not that an operation was running. Timed or not, the step's
    thread places the batch first (a timed step is dispatched as an untimed one)."""
    from jax._src import compiler

    release = threading.Event()
    real, held = compiler.backend_compile_and_load, []

    def slow(*args, **kwargs):
        if not held and threading.current_thread().name.startswith("vjpsplit-step-"):
            held.append(True)
            release.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(compiler, "backend_compile_and_load", slow)
    tr = _trainer(observe=P.Observe(hang_report=tmp_path / "h.json"))
    tr.backend.step_timeout = 1.5
    unstick = threading.Timer(1.5 + stepwatch.GRACE / 2, release.set)  # back within the stop's grace
    unstick.start()
    try:
        # 7 or 9 rows a microbatch, which no other step here has: compiled afresh
        out = _in_thread(lambda: tr.step(gpt_batch(14 if timed else 18), timed=timed))
    finally:
        release.set()
    text = str(out.get("error"))
    assert held and "did not finish within step_timeout=1.5 s" in text, out
    # The step's thread compiles as it places the batch, before its first operation.
    assert text.startswith(
        "the step did not finish within step_timeout=1.5 s; the step's thread is compiling outside the "
        "operations (its first call for these inputs); worker 0: waits to be handed its next operation "
        "(F stage 0 mb 0)"
    )
    tr.close()


# -- an untimed step (the Trainer's default) stuck or interrupted says the same -------------------------------


def _step_threads():
    return [t for t in threading.enumerate() if t.name.startswith("vjpsplit-step-")]


def test_an_untimed_step_stuck_in_a_host_callback_ends_at_step_timeout_naming_the_op(monkeypatch, tmp_path):
    """The Trainer's default step, untimed, with stage 1's forward of microbatch 1 in a host callback that never
    returns: within step_timeout + 2 s one error names it and what the other workers wait for, the report is
    written; the thread stays stuck, so the Trainer refuses further steps; released at the end, the thread ends.
    (Before: the step hung for good.) XLA's CPU client runs the callback inside that operation's dispatch, or,
    when the operation's inputs are not ready as it is dispatched, later on a thread of its own (the dispatch
    returns, the step waits in a fetch): the report names the operation either way."""
    before = set(_step_threads())
    report = tmp_path / "hang.json"
    tr = _trainer(observe=P.Observe(hang_report=report))
    hold, release = callback_blocks(monkeypatch, stage=1, mb=1)
    try:
        tr.step(gpt_batch(4))  # compiled, the callback's too: the limit below is the hang's
        first = tr.history[-1].loss
        tr.backend.step_timeout = 1.5
        hold.set()
        t0 = time.monotonic()
        out = _in_thread(lambda: tr.step(gpt_batch(4)))
        took = time.monotonic() - t0
        err = out.get("error")
        assert isinstance(err, VjpsplitError), out
        assert took < 1.5 + 2.0
        text = str(err)
        assert "did not finish within step_timeout=1.5 s" in text
        inside = "worker 1: running F stage 1 mb 1 since" in text
        if inside:  # the dispatch holds the thread: the workers after it were not handed their operations
            assert "(in its dispatch, which has not returned)" in text
            assert "worker 0: waits to be handed its next operation (B stage 0 mb 0)" in text
            assert "still stuck after 1 s: the step's thread (in worker 1's dispatch)" in text
        else:  # dispatched: the first operation of each worker not finished, and what it waits for
            assert re.search(
                r"worker 1: running or waiting: F stage 1 mb 1 \(dispatched at [\d.]+ ms, not finished", text
            )
            assert "worker 0: B stage 0 mb 0 waits for the cotangent from stage 1 (worker 1 has not finished it" in text
            assert (
                "still stuck after 1 s: the step's thread (waiting for a result of the unfinished operations)" in text
            )
        assert str(report) in text and "\n" not in text
        body = json.loads(report.read_text())
        assert body["message"] == text
        rows = {w["worker"]: w for w in body["workers"]}
        assert re.match(r"worker 1: running (or waiting: )?F stage 1 mb 1", rows[1]["now"])
        ops = [(r["kind"], r["stage"], r["mb"]) for r in rows[1]["ops"]]
        assert ("B", 1, 1) in ops  # the first step's
        # Untimed: nothing waited for an operation, so no end is given; when its dispatch returned is.
        assert all(r["end_ms"] is None and r["dispatched_ms"] >= r["start_ms"] for r in rows[1]["ops"])
        # The ring holds each operation once its dispatch returned: inside it, this step's last is the F of mb 0.
        assert ops[-1] == ("F", 1, 0) if inside else ("F", 1, 1) in ops[ops.index(("B", 1, 1)) + 1 :]
        again = _in_thread(lambda: tr.step(gpt_batch(4))).get("error")
        assert "an earlier step timed out" in str(again) and re.search(
            r"running (or waiting: )?F stage 1 mb 1", str(again)
        )
        assert tr.history[-1].loss == first  # no step was counted
        _in_thread(tr.close, timeout=10)  # does not wait for the stuck thread
    finally:
        release.set()
    assert _gone_threads(before, _step_threads)


def _gone_threads(before, current, timeout=10.0):
    end = time.monotonic() + timeout
    for t in current():
        if t not in before:
            t.join(max(end - time.monotonic(), 0.0))
    return all(t in before for t in current())


def test_ctrl_c_during_an_untimed_step_is_a_step_interrupted_and_the_trainer_goes_on(monkeypatch, tmp_path):
    """SIGINT while an untimed step hangs in a host callback: a ``StepInterrupted`` naming the stuck op, the
    report written; the callback returns within the stop's grace, so the Trainer steps on, the stopped step
    having applied nothing (its next step equals a reference Trainer's)."""
    import os
    import signal

    tr = _trainer(observe=P.Observe(step_timeout=60, hang_report=tmp_path / "h.json"))
    release = threading.Event()
    ref = _trainer()
    try:
        tr.step(gpt_batch(4))
        ref.step(gpt_batch(4))
        _block_stage(monkeypatch, stage=2, mb=0, release=release)  # the dispatch, and the updates, wait behind it
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
        unstick = threading.Timer(1.0 + stepwatch.GRACE / 2, release.set)
        t0 = time.monotonic()
        timer.start()
        unstick.start()
        try:
            with pytest.raises(KeyboardInterrupt) as info:
                tr.step(gpt_batch(4))
        finally:
            timer.cancel()
            release.set()
        assert time.monotonic() - t0 < 1.0 + 2.0
        assert isinstance(info.value, StepInterrupted) and isinstance(info.value, VjpsplitError)
        text = str(info.value)
        assert text.startswith("the step was interrupted; ")
        assert "worker 2: running F stage 2 mb 0 since" in text
        assert json.loads((tmp_path / "h.json").read_text())["message"] == text
        monkeypatch.undo()
        assert tr.step(gpt_batch(4, seed=7)) == ref.step(gpt_batch(4, seed=7))
    finally:
        release.set()
        tr.close()
        ref.close()


class _Probe:
    def __init__(self, ready):
        self.ready = ready

    def is_ready(self):
        return self.ready


def test_an_untimed_steps_workers_are_read_off_what_is_dispatched_and_not_finished():
    """Where the dispatch returned (a GPU runs host callbacks on a thread of its own and the step waits later, in
    a fetch), each worker is its first dispatched operation whose output is not ready: running when what it
    reads is ready, waiting for the value otherwise, with how many dispatched after it wait; a worker with its
    dispatched operations done and more to come waits to be handed the next; one with all done is finished."""
    from vjpsplit_cli.pipeline.runtime import hang_report
    from vjpsplit_cli.pipeline.schedules.ops import Op

    F, B = (lambda m, s: Op("F", m, s)), (lambda m, s: Op("B", m, s))
    plans = [[F(0, 0), F(1, 0), B(0, 0), B(1, 0)], [F(0, 1), B(0, 1), F(1, 1), B(1, 1)], [F(0, 2), B(0, 2)]]
    rec = untimed.Dispatched(plans, 3)
    t = rec.t0
    ready = {F(0, 0): True, F(1, 0): False, F(0, 1): True, B(0, 1): False, F(0, 2): True, B(0, 2): True}
    order = [F(0, 0), F(1, 0), F(0, 1), F(0, 2), B(0, 2), B(0, 1)]
    for i, op in enumerate(order):
        w = {0: 0, 1: 1, 2: 2}[op.stage]
        rec.ops[w].append((op, t + (i + 1) * 1e-3, [_Probe(ready[op])]))
        rec.count[w] += 1
        rec.last[w] = t + (i + 1) * 1e-3
    nows, after = rec.nows()
    text = hang_report.hang_message("stuck", nows, t, rec.worker_of, None, after=after)
    assert "worker 0: running or waiting: F stage 0 mb 1 (dispatched at 2.0 ms, not finished)" in text
    assert (
        "worker 1: B stage 1 mb 0 waits for the cotangent from stage 2" not in text
    )  # stage 2's B of mb 0 is ready: stage 1's B runs
    assert "worker 1: running or waiting: B stage 1 mb 0 (dispatched at 6.0 ms, not finished)" in text
    assert "worker 2: all its operations finished" in text
    # One more worker-1 op waiting behind its first, and a B waiting for a cotangent not finished.
    ready[B(0, 2)] = False
    rec.ops[2][-1] = (B(0, 2), t + 5e-3, [_Probe(False)])
    rec.ops[1].append((F(1, 1), t + 7e-3, [_Probe(False)]))
    rec.count[1] += 1
    nows, after = rec.nows()
    text = hang_report.hang_message("stuck", nows, t, rec.worker_of, None, after=after)
    assert (
        "worker 1: B stage 1 mb 0 waits for the cotangent from stage 2 (worker 2 has not finished it; "
        "dispatched at 6.0 ms; 1 dispatched after it wait)" in text
    )
    assert "worker 2: running or waiting: B stage 2 mb 0 (dispatched at 5.0 ms, not finished)" in text
    ready[F(1, 0)] = True
    rec.ops[0][1] = (F(1, 0), t + 2e-3, [_Probe(True)])
    nows, _ = rec.nows()
    assert nows[0][:2] == (hang_report.NEXT, B(0, 0))  # its next op is not handed out yet


def test_an_untimed_steps_record_holds_the_finished_operations_outputs_no_longer_than_a_few_more_ops():
    """The record holds one output array of each operation it hands out, to ask whether it finished: those found
    finished are dropped as the queue grows (at most ``PRUNE`` more held), every one once dispatch is over,
    while the unfinished stay (their buffers are alive anyway)."""
    import jax.numpy as jnp

    from vjpsplit_cli.pipeline.schedules.ops import Op

    ops = [Op("F", m, 0) for m in range(100)]
    rec = untimed.Dispatched([ops], 1)
    done = jnp.ones(3)
    done.block_until_ready()
    for op in ops:
        rec.begin(0, op)
        rec.end(0, op, (done, done), None)
        assert len(rec.ops[0]) <= untimed.PRUNE
    assert rec.count == [100] and rec.nows()[0][0][0] == "finished"
    rec.ops[0].append((Op("F", 100, 0), rec.t0, [_Probe(False)]))
    rec.dispatched()
    assert [e[0] for e in rec.ops[0]] == [Op("F", 100, 0)]


# -- a thread left behind does not crash the process's exit ----------------------------------------------------

_EXITS = """
import sys
import time

import optax
import pytest
from blocking import callback_blocks
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError


class SlowExit:
    def __del__(self, sleep=time.sleep):  # the exit lasts a while once it began ending the threads
        sleep(1.5)


slow = SlowExit()
timed = sys.argv[1] == "timed"
stages = vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")
tr = P.Trainer(stages, gpt_params(), optimizer=optax.sgd(0.1), schedule="1f1b", microbatches=2)
hold, release = callback_blocks(pytest.MonkeyPatch(), stage=1, mb=1, linger=0.5)
tr.step(gpt_batch(4), timed=timed)
tr.backend.step_timeout = 1.0
hold.set()
try:
    tr.step(gpt_batch(4), timed=timed)
except VjpsplitError as e:
    print("timed out" if "did not finish within step_timeout=1 s" in str(e) else e)
tr.close()
release.set()  # the stuck host callback returns half a second later, as the process exits
"""


@pytest.mark.parametrize("how", ["timed", "untimed"])
def test_a_process_whose_step_timed_out_exits_0_when_the_stuck_callback_returns_as_it_exits(how):
    """A step stuck in a host callback ends by step_timeout; the caller closes the Trainer and exits; the callback
    returns as the process exits. The exit waits for the thread left behind (``workerthreads.EXIT_WAIT``), which
    ends first. (Before: CPython ended the thread where it woke, inside XLA, and the process aborted with
    status 134: "terminate called after throwing an instance of ''", or a fatal error on the GIL.)"""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    r = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _EXITS, how], env=env, capture_output=True, text=True, timeout=300
    )
    assert (r.returncode, r.stdout.strip()) == (0, "timed out"), r.stderr[-2000:]
    assert "terminate called" not in r.stderr and "Fatal Python error" not in r.stderr


# -- the trace file --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_timed_steps_trace_file_holds_its_events_and_sends(schedule, tmp_path, monkeypatch):
    """The trace of a timed step (written by ``trace_dir``) against the format and against the step's events:
    one slice per operation at its microsecond times, a flow per value sent between workers (none inside
    ZB-V's worker, whose two stages pass it locally), the reductions, updates and driver phases as slices;
    each operation ran under a ``jax.profiler.TraceAnnotation`` of its slice's name."""
    import jax

    from vjpsplit_cli.pipeline.schedules.ops import Kind

    names = []
    real = jax.profiler.TraceAnnotation

    class Recorded(real):
        def __init__(self, name, **kw):
            names.append(name)
            super().__init__(name, **kw)

    monkeypatch.setattr(jax.profiler, "TraceAnnotation", Recorded)
    mbs = 4
    tr = _trainer(schedule=schedule, microbatches=mbs, observe=P.Observe(trace_dir=tmp_path / "traces", trace_every=2))
    tr.step(gpt_batch(8))  # step 1: untimed, no trace
    assert not (tmp_path / "traces").exists() and names == []
    tr.step(gpt_batch(8, seed=3))  # step 2: the trace_every-th, timed and traced
    r = tr.last_result
    path = tmp_path / "traces" / "step-2.trace.json"
    doc = check_trace_file(path)
    ops = op_slices(doc)
    origin = doc["otherData"]["origin_s"]
    assert len(ops) == len(r.events) and sorted(names) == sorted(ops)
    for e in r.events:
        s = ops[f"{e.kind} s{e.stage} mb{e.mb}"]
        assert s["tid"] == e.worker + 1 and s["cat"] == e.kind
        assert s["ts"] == pytest.approx((e.start - origin) * 1e6, abs=2e-3)
        assert s["dur"] == pytest.approx((e.end - e.start) * 1e6, abs=2e-3)
    worker_of = {e.stage: e.worker for e in r.events}
    back = {(e.stage, e.mb): e.kind for e in r.events if e.kind in (Kind.B, Kind.I)}  # 1F1B's B, ZB-V's I

    def name(k, s, m, sends=False):
        if sends and k == Kind.B and s == 3:  # the last stage's F ran this B (1F1B) or I (ZB-V): sent from F
            return f"F s{s} mb{m}"
        return f"{k if k == Kind.F else back[(s, m)]} s{s} mb{m}"

    want = sorted(
        (name(k, s, m, sends=True), name(k, t, m))
        for k, step in ((Kind.F, 1), (Kind.B, -1))
        for s in range(4)
        for t in [s + step]
        if 0 <= t < 4 and worker_of[s] != worker_of[t]
        for m in range(mbs)
    )
    assert set(back.values()) == ({Kind.B} if schedule == "1f1b" else {Kind.I})
    assert flow_pairs(doc) == want and want  # zbv: stages 1-2 share worker 1, so 2 x 2 x 4 flows
    assert len(want) == (24 if schedule == "1f1b" else 16)
    others = {(ev["tid"], ev["name"]) for ev in doc["traceEvents"] if ev["ph"] == "X" and ev["cat"] not in "FBIW"}
    workers = r.num_workers
    assert {(w + 1, "update") for w in range(workers)} | {(w + 1, "reduce norms") for w in range(workers)} <= others
    assert {(w + 1, "reduce tied") for w in range(workers)} <= others  # the tied embedding
    assert {(0, "hand out"), (0, "wait for the workers"), (0, "fetch the losses")} <= others
    # Per worker, no two operations overlap.
    for w in range(workers):
        spans = sorted((s["ts"], s["ts"] + s["dur"]) for s in ops.values() if s["tid"] == w + 1)
        assert all(b <= c + 1e-3 for (_, b), (c, _) in zip(spans, spans[1:]))
    # plot_timeline draws the same rectangles from the file as from the events.
    from_events = P.plot_timeline(r.events, workers, tmp_path / "a.png", "t")
    from_file = P.plot_timeline(path, None, tmp_path / "b.png", "t")
    assert len(from_file) == len(from_events) == len(r.events)
    for a, b in zip(from_events, from_file):
        assert a[1:2] == b[1:2] and a[3:] == b[3:]
        assert a[0] == pytest.approx(b[0], abs=1e-5) and a[2] == pytest.approx(b[2], abs=1e-5)  # ms, ns-rounded
    tr.close()


def test_a_trace_file_that_is_not_one_is_one_clear_error(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text("{not json")
    with pytest.raises(VjpsplitError, match=r"t.json: not a JSON trace file"):
        P.plot_timeline(bad, None, tmp_path / "p.png", "t")
    bad.write_text(json.dumps({"traceEvents": [{"ph": "X", "tid": 1, "ts": "soon", "dur": 1}]}))
    with pytest.raises(VjpsplitError, match=r"traceEvents\[0\]: field 'ts' is 'soon'"):
        P.plot_timeline(bad, None, tmp_path / "p.png", "t")
    tr = _trainer()
    tr.step(gpt_batch(4))
    with pytest.raises(VjpsplitError, match=r"not timed"):
        tr.last_result.write_trace(tmp_path / "x.json")
    tr.close()


# -- stragglers ------------------------------------------------------------------------------------------------


def test_a_worker_slowed_on_purpose_is_named_after_three_timed_steps(monkeypatch):
    """The MLP's balanced cut gives stages 1 and 2 the same cost signature: peers. Stage 1 sleeps 50 ms per
    operation; from the third timed step in a row after the first (which compiles) it is named in a warning and in ``history``; workers 0
    and 3 have no peers and are never named."""
    import numpy as np
    from stage_models import mlp, mlp_params, specs_like

    params = mlp_params()
    x, labels = np.ones((8, 16), np.float32), np.arange(8, dtype=np.int32) % 4
    stages = vs.export_stages(mlp, *specs_like((params, x[:2], labels[:2])), wrt="params", stages=4, platforms="cpu")
    real = StageWorker._run

    wrapped = {}  # one slowed call per call: a call's runs are counted by the call (warm from its second step)

    def slowed(self, worker, kind, mb, args, call, warmup):
        if self.stage_index == 1:
            call = wrapped.setdefault(id(call), lambda *a, c=call: (time.sleep(0.05), c(*a))[1])
        return real(self, worker, kind, mb, args, call, warmup)

    monkeypatch.setattr(StageWorker, "_run", slowed)
    with P.Trainer(stages, params, optimizer=optax.sgd(0.1), microbatches=4, observe=P.Observe(timeline=True)) as tr:
        with pytest.warns(UserWarning) as caught:
            for _ in range(5):
                tr.step((x, labels))
            tr.step((x, labels), timed=False)  # untimed: no busy times, no verdict
    rows = tr.history
    # The first step compiles every stage: no verdict; then three in a row.
    assert [r.stragglers for r in rows[:5]] == [(), (), (), (1,), (1,)] and rows[5].stragglers is None
    assert all(len(r.busy) == 4 and r.busy[1] > r.busy[2] + 0.3 for r in rows[1:5])
    (w,) = [str(c.message) for c in caught if "straggler" in str(c.message)]  # warned once, when first named
    assert w.startswith("worker 1 (stages 1) is a straggler") and "peers' (worker 2, whose stages cost the same)" in w


def test_fit_writes_a_stuck_steps_report_beside_its_checkpoint_directory(monkeypatch, tmp_path):
    release = threading.Event()
    tr = _trainer(observe=P.Observe(timeline=True))
    tr.step(gpt_batch(4))  # compiled before the limit applies
    tr.backend.step_timeout = 1.5
    _block_stage(monkeypatch, stage=1, mb=1, release=release)
    unstick = threading.Timer(1.5 + stepwatch.GRACE / 2, release.set)
    unstick.start()
    try:
        err = _in_thread(lambda: tr.fit(lambda step: gpt_batch(4), 2, checkpoint_dir=tmp_path / "ck")).get("error")
    finally:
        release.set()
    assert isinstance(err, VjpsplitError) and "running F stage 1 mb 1" in str(err)
    beside = tmp_path / "ck.hang.json"
    assert str(beside) in str(err) and json.loads(beside.read_text())["message"] == str(err)
    tr.close()


def test_a_sharded_stage_gets_a_track_per_device_and_the_file_reads_back_once():
    """``trace_events`` with a stage on two devices: its slices once more on each device's track; read back,
    the file gives each operation once."""
    from vjpsplit_cli.pipeline.schedules.timeline import Event, Phase
    from vjpsplit_cli.pipeline.schedules.tracefile import read_trace, trace_events, write_trace

    events = [
        Event(0, "F", 0, 10.0, 10.001, 0),
        Event(1, "F", 0, 10.0012, 10.002, 1),
        Event(1, "B", 0, 10.003, 10.004, 1),
    ]
    events.append(Event(0, "B", 0, 10.0045, 10.005, 0))
    doc = trace_events(events, [Phase(None, "hand out", 9.9995, 10.0)], 2, 2, devices={1: ["cpu:1", "cpu:2"]})
    tracks = {ev["tid"]: ev["args"]["name"] for ev in doc["traceEvents"] if ev["name"] == "thread_name"}
    extra = sorted(t for t in tracks if t >= 1000)
    assert [tracks[t] for t in extra] == ["worker 1 stage 1 cpu:1", "worker 1 stage 1 cpu:2"]
    for t in extra:
        assert sorted(ev["name"] for ev in doc["traceEvents"] if ev["ph"] == "X" and ev["tid"] == t) == [
            "B s1 mb0",
            "F s1 mb0",
        ]
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        write_trace(f"{d}/t.json", doc)
        check_trace_file(f"{d}/t.json")
        back = read_trace(f"{d}/t.json")
    assert [(e.worker, e.kind, e.mb, e.stage) for e in back.events] == [
        (e.worker, e.kind, e.mb, e.stage) for e in events
    ]
    assert all(abs(a.start - b.start) < 1e-8 and abs(a.end - b.end) < 1e-8 for a, b in zip(back.events, events))
    assert [(p.worker, p.name) for p in back.phases] == [(None, "hand out")] and back.num_workers == 2


def test_spans_that_touch_never_overlap_in_the_trace_file():
    """A reduction that ends where the update begins (one clock reading): in the file, at the nanosecond, the update
    starts where the reduction ends, never before. (Before: start and duration were rounded apart, and here the
    reduction ended 1 ns after the update began: 0.6 ns rounds up, its 1000.8 ns length up, 1001.4 ns down.)"""
    from vjpsplit_cli.pipeline.schedules.timeline import Event, Phase
    from vjpsplit_cli.pipeline.schedules.tracefile import trace_events

    t0 = 1000.0
    a, b = t0 + 0.6e-9, t0 + 1001.4e-9
    phases = [Phase(None, "hand out", t0, a), Phase(0, "reduce norms", a, b), Phase(0, "update", b, b + 1e-6)]
    events = [Event(0, "F", 0, a, b, 0), Event(0, "B", 0, b, b + 1.0014e-6, 0)]
    doc = trace_events(events, phases, 1, 1)
    ns = {ev["name"]: (round(ev["ts"] * 1e3), round(ev["dur"] * 1e3)) for ev in doc["traceEvents"] if ev["ph"] == "X"}

    def end(name):
        return ns[name][0] + ns[name][1]

    assert ns["reduce norms"] == (1, 1000) and ns["update"][0] == end("reduce norms") == 1001
    assert ns["B s0 mb0"][0] == end("F s0 mb0") == end("hand out") + 1000


def test_a_trace_file_from_before_kind_i_reads_its_input_parts_as_i(tmp_path):
    """Trace files written before ``Kind.I`` named a split backward's input part ``B`` (category and name).
    Read back, each B with a W of its stage and microbatch is that I; a B without a W stays a whole B."""
    from vjpsplit_cli.pipeline.schedules.timeline import Event
    from vjpsplit_cli.pipeline.schedules.tracefile import read_trace, trace_events, write_trace

    now = [  # as a step records them today: stage 1 split (I, W), stage 0 whole (B)
        Event(0, "F", 0, 10.0, 10.001, 0),
        Event(1, "F", 0, 10.0012, 10.002, 1),
        Event(1, "I", 0, 10.002, 10.003, 1),
        Event(1, "W", 0, 10.003, 10.0035, 1),
        Event(0, "B", 0, 10.0036, 10.005, 0),
    ]
    doc = trace_events(now, [], 2, 2)
    assert {ev["name"] for ev in doc["traceEvents"] if ev["ph"] == "X"} >= {"I s1 mb0", "B s0 mb0"}
    old = json.loads(json.dumps(doc))
    for ev in old["traceEvents"]:  # the same step as an older vjpsplit wrote it
        if ev.get("cat") == "I":
            ev["cat"], ev["name"], ev["args"]["kind"] = "B", ev["name"].replace("I", "B", 1), "B"
    assert not any(ev.get("cat") == "I" for ev in old["traceEvents"])
    for name, d in (("new", doc), ("old", old)):
        write_trace(tmp_path / f"{name}.json", d)
        back = read_trace(tmp_path / f"{name}.json")
        assert [(e.worker, e.kind, e.mb, e.stage) for e in back.events] == [
            (e.worker, e.kind, e.mb, e.stage) for e in now
        ], name


def test_a_workers_update_handed_out_while_its_last_operation_runs_starts_after_it_in_the_trace(tmp_path):
    """The step's thread may hand out a stage's update while the worker's last operation still runs on its device
    (a timed step's operation ends when its results exist): the update's slice starts once that operation ended,
    as it runs on the device, so the worker's track nests (a strict viewer refused it before: the compat run)."""
    from tracecheck import check_trace_file

    from vjpsplit_cli.pipeline.schedules.timeline import Event, Phase
    from vjpsplit_cli.pipeline.schedules.tracefile import trace_events, write_trace

    events = [Event(0, "F", 0, 10.0, 10.001, 0), Event(0, "B", 0, 10.001, 10.004, 0)]
    phases = [Phase(None, "hand out", 10.0, 10.0015), Phase(0, "update", 10.002, 10.0025)]
    write_trace(tmp_path / "t.json", trace_events(events, phases, 1, 1))
    doc = check_trace_file(tmp_path / "t.json")  # before: the update overlapped the B without nesting in it
    (update,) = [ev for ev in doc["traceEvents"] if ev.get("name") == "update"]
    (b,) = [ev for ev in doc["traceEvents"] if ev.get("name") == "B s0 mb0" and ev["tid"] == 1]
    assert update["ts"] == b["ts"] + b["dur"] and update["dur"] == 0.0  # its host span ended before the B did
    (hand_out,) = [ev for ev in doc["traceEvents"] if ev.get("name") == "hand out"]
    assert hand_out["ts"] == 0.0 and hand_out["dur"] == 1500.0  # the driver's track: as marked


def test_replicas_running_at_once_each_have_a_track_and_read_back_with_their_worker(tmp_path):
    """A worker's replicas (data_parallel) run at once on their devices: replica 0's slices on the worker's track,
    replica r's on a track of its own, so every track nests (on one track they overlapped); read back, each
    event has its worker and replica, and the trace its workers."""
    from tracecheck import check_trace_file, flow_pairs

    from vjpsplit_cli.pipeline.schedules.timeline import Event
    from vjpsplit_cli.pipeline.schedules.tracefile import read_trace, trace_events, write_trace

    events = [
        Event(w, "F", 0, 10.0 + w * 0.002 + r * 0.0003, 10.0015 + w * 0.002 + r * 0.0003, w, replica=r)
        for w in range(2)
        for r in range(2)
    ]
    write_trace(tmp_path / "t.json", trace_events(events, [], 2, 2))
    doc = check_trace_file(tmp_path / "t.json")  # before: F s0 mb0 r1 overlapped F s0 mb0 r0 on worker 0's track
    tracks = {ev["tid"]: ev["args"]["name"] for ev in doc["traceEvents"] if ev["name"] == "thread_name"}
    for w in range(2):
        on = {
            ev["name"] for ev in doc["traceEvents"] if ev["ph"] == "X" and tracks[ev["tid"]].startswith(f"worker {w}")
        }
        assert on == {f"F s{w} mb0 r0", f"F s{w} mb0 r1"}
    assert flow_pairs(doc) == [(f"F s0 mb0 r{r}", f"F s1 mb0 r{r}") for r in range(2)]
    back = read_trace(tmp_path / "t.json")
    assert back.num_workers == 2
    assert sorted((e.worker, e.replica) for e in back.events) == [(0, 0), (0, 1), (1, 0), (1, 1)]
