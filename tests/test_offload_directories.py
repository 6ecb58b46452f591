"""Offload files, trace files and checkpoints from outside (issue 67, items 2-6 and 9): a user's file in the offload
directory left alone, overlapping directories refused before the first step, no offload file or thread left after a
failed or interrupted step or ``close()``, a process that exits after a stuck step, directory options that are files
refused when given."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import optax
import pytest
from stage_models import MLP_IN as D, MLP_OUT as OUT, tanh_mlp_params as _params, tanh_mlp_stages as _stages

from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.pipeline.runtime.offload import ResidualFiles
from vjpsplit_cli.pipeline.runtime.worker import StageWorker

M = 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _batches(n):
    rng = np.random.default_rng(3)
    return [
        (rng.normal(size=(8, D)).astype(np.float32), rng.normal(size=(8, OUT)).astype(np.float32)) for _ in range(n)
    ]


def _trainer(offload=None, **kw):
    # GPipe: every first-stage F runs before its B, so microbatches 0-2 of stage 0 go to files.
    return P.Trainer(
        _stages(),
        _params(),
        optimizer=optax.sgd(0.1),
        microbatches=M,
        schedule="gpipe",
        runner=P.InProcess(offload=offload),
        **kw,
    )


def _files(directory):
    return P.Offload(to="files", directory=str(directory))


def _written(monkeypatch):
    """The paths every offload write goes to, as they are submitted."""
    paths = []
    writer = ResidualFiles.writer

    def spy(self, path, res):
        paths.append(path)
        return writer(self, path, res)

    monkeypatch.setattr(ResidualFiles, "writer", spy)
    return paths


# -- item 2: a user's file in the offload directory ----------------------------------------------------------------


def test_offload_files_have_names_of_their_own_and_leave_a_users_file_alone(tmp_path, monkeypatch):
    off = tmp_path / "off"
    off.mkdir()
    mine = off / "stage0-mb0.npz"  # what the offload files were named before
    mine.write_bytes(b"the user's own")
    paths = _written(monkeypatch)
    with _trainer(_files(off)) as tr:
        for b in _batches(2):
            tr.step(b)
    assert paths and all(os.path.basename(p).startswith("vjpsplit-offload-") for p in paths), paths
    assert mine.read_bytes() == b"the user's own"  # never written over, never removed
    assert os.listdir(off) == ["stage0-mb0.npz"]  # the offload files were removed once read back


# -- items 3 and 4: overlapping directories ------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["same", "offload inside", "checkpoint inside"])
def test_an_offload_directory_overlapping_the_checkpoint_dir_is_refused_before_the_first_step(where, tmp_path):
    ck, off = {
        "same": (tmp_path / "run", tmp_path / "run"),
        "offload inside": (tmp_path / "ck", tmp_path / "ck" / "off"),
        "checkpoint inside": (tmp_path / "off" / "ck", tmp_path / "off"),
    }[where]
    asked = []

    def data(k):
        asked.append(k)
        return _batches(2)[k]

    with _trainer(_files(off)) as tr:
        with pytest.raises(VjpsplitError) as e:
            tr.fit(data, steps=2, checkpoint_dir=ck, checkpoint_every=1)
        assert asked == [] and tr.step_count == 0  # before the first step
    msg = str(e.value)
    assert "fit(checkpoint_dir=...)" in msg and "Offload(directory=...)" in msg and "\n" not in msg, msg
    assert "give each its own directory" in msg


def test_a_trace_dir_inside_the_checkpoint_dir_is_refused_before_the_first_step(tmp_path):
    ck = tmp_path / "ck"
    with _trainer(observe=P.Observe(trace_dir=ck / "traces", trace_every=1)) as tr:
        with pytest.raises(VjpsplitError) as e:
            tr.fit(_batches(2), steps=2, checkpoint_dir=ck)
        assert tr.step_count == 0  # before: the first step ran, then its save refused the traces
    msg = str(e.value)
    assert "fit(checkpoint_dir=...)" in msg and "Observe(trace_dir=...)" in msg and "inside" in msg, msg
    with _trainer(observe=P.Observe(trace_dir=tmp_path / "traces", trace_every=1)) as tr:  # apart: fine
        tr.fit(_batches(2), steps=2, checkpoint_dir=ck)
        assert sorted(os.listdir(tmp_path / "traces")) == ["step-1.trace.json", "step-2.trace.json"]


def test_an_offload_directory_that_is_the_trace_dir_is_refused_when_the_trainer_is_made(tmp_path):
    with pytest.raises(VjpsplitError, match=r"Offload\(directory=\.\.\.\) .* and Observe\(trace_dir=\.\.\.\) .*same"):
        _trainer(_files(tmp_path / "out"), observe=P.Observe(trace_dir=tmp_path / "out"))


# -- item 5: a stuck step's offload thread never keeps the process alive --------------------------------------------

_STUCK = """
import threading, sys
import jax, jax.numpy as jnp, numpy as np, optax
sys.path.insert(0, {tests!r})
from test_offload_directories import _trainer
from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.pipeline.runtime.worker import StageWorker

hold, never = threading.Event(), threading.Event()

def host(x):
    if hold.is_set():
        never.wait()  # a host callback that never returns
    return x

@jax.jit
def blocker(x, slow):
    x = jax.tree_util.tree_map(lambda a: a + (slow[0, 0] * 0).astype(a.dtype), x)
    return jax.pure_callback(host, jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x), x)

# Its input still being computed when it is dispatched, the callback runs later on XLA's thread, so the stage's F
# is dispatched and returns: its residuals go off the device on the offload thread, which waits for them for good.
slow = jax.jit(lambda b: jnp.tanh(jnp.tanh(b @ b) @ b))
big = jnp.ones((1024, 1024)) / 1024
forward = StageWorker.forward

def stuck(self, m, x, side, worker=None, microbatches=None):
    if self.stage_index == 0 and m == 1:
        x = blocker(x, slow(big))
    return forward(self, m, x, side, worker=worker, microbatches=microbatches)

StageWorker.forward = stuck
tr = _trainer("host")
x, y = np.ones((8, 4), np.float32), np.ones((8, 2), np.float32)
tr.step((x, y))  # compiled, the callback too: the limit below is the hang's
tr.backend.step_timeout = 1.5
hold.set()
try:
    tr.step((x, y))
except VjpsplitError as e:
    print("step error:", e, flush=True)
"""


def test_a_process_whose_offloading_step_timed_out_exits(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(_STUCK.format(tests=os.path.join(ROOT, "tests")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=240)  # a bound, far above the run's seconds: before, it never exited
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the process did not exit after its step timed out:\n{out[-3000:]}")
    assert "step error: the step did not finish within step_timeout=1.5 s" in out, out[-3000:]
    assert proc.returncode == 0, out[-3000:]


# -- item 6: no offload file or thread left behind -----------------------------------------------------------------


def _failing_backward(monkeypatch, error):
    """Stage 0's B of microbatch 1 raises ``error``: its file and microbatch 2's are on disk then."""
    backward = StageWorker.backward

    def failing(self, mb, ct, microbatches, worker=None):
        if self.stage_index == 0 and mb == 1:
            raise error
        return backward(self, mb, ct, microbatches, worker=worker)

    monkeypatch.setattr(StageWorker, "backward", failing)


@pytest.mark.parametrize(
    "timed, error", [(False, RuntimeError("broken")), (True, RuntimeError("broken")), (False, KeyboardInterrupt())]
)
def test_a_failed_or_interrupted_step_leaves_no_offload_file(timed, error, tmp_path, monkeypatch):
    off = tmp_path / "off"
    paths = _written(monkeypatch)
    with _trainer(_files(off)) as tr:
        tr.step(_batches(1)[0], timed=timed)
        first = len(paths)
        _failing_backward(monkeypatch, error)
        # A stage's own error reaches the caller named (its operation) and chained; Ctrl-C as it is.
        with pytest.raises(VjpsplitError if isinstance(error, Exception) else type(error)) as got:
            tr.step(_batches(1)[0], timed=timed)
        assert isinstance(error, KeyboardInterrupt) or "B stage 0 mb 1 failed: RuntimeError: broken" in str(got.value)
        assert len(paths) > first  # the failed step wrote files
        # Before: the failed step's files stayed. One still being written as the error was raised (the offload
        # thread lags on a loaded host) goes once its write ends.
        deadline = time.monotonic() + 30
        while os.listdir(off) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.listdir(off) == []


def test_run_inprocess_that_fails_leaves_no_offload_file(tmp_path, monkeypatch):
    off = tmp_path / "off"
    _failing_backward(monkeypatch, RuntimeError("broken"))
    with pytest.raises(VjpsplitError, match="B stage 0 mb 1 failed: RuntimeError: broken"):
        P.run_inprocess(_stages(), _params(), _batches(1)[0], microbatches=M, schedule="gpipe", offload=_files(off))
    assert os.listdir(off) == []


def _offload_threads():
    return [t for t in threading.enumerate() if t.name.startswith("vjpsplit-offload-")]


@pytest.mark.parametrize("to", ["host", "files"])
def test_close_ends_every_offload_thread(to, tmp_path):
    before = set(_offload_threads())
    tr = _trainer("host" if to == "host" else _files(tmp_path / "off"))
    tr.step(_batches(1)[0])
    mine = [t for t in _offload_threads() if t not in before]
    assert mine  # stage 0's copies ran on its offload thread
    tr.close()
    end = time.monotonic() + 30  # a bound for a loaded machine, not a speed: before, they ran on for good
    for t in mine:
        t.join(max(end - time.monotonic(), 0.0))
    assert not [t for t in mine if t.is_alive()]


# -- item 9: directory options that are files ----------------------------------------------------------------------


def test_directory_options_that_are_files_or_under_one_are_refused_when_given(tmp_path):
    f = tmp_path / "file"
    f.write_text("mine")
    for where, said in [(f, "is a file, not a directory"), (f / "sub", f"is under {f}, which is a file")]:
        with pytest.raises(VjpsplitError, match=rf"Offload\(directory=\.\.\.\): {where} {said}"):
            P.Offload(to="files", directory=where)
        with pytest.raises(VjpsplitError, match=rf"Observe\(trace_dir=\.\.\.\): {where} {said}"):
            P.Observe(trace_dir=where, trace_every=1)
    assert f.read_text() == "mine"
    P.Observe(trace_dir=tmp_path / "new" / "traces")  # not there yet: made at the first trace
    P.Offload(to="files", directory=tmp_path / "new" / "off")


def test_a_trace_dir_made_a_file_after_the_trainer_is_one_error_that_keeps_the_steps_loss(tmp_path):
    traces = tmp_path / "traces"
    with _trainer(observe=P.Observe(trace_dir=traces)) as tr:
        traces.write_text("mine")  # after the Trainer checked it
        with pytest.raises(VjpsplitError) as e:
            tr.step(_batches(1)[0], timed=True)
        assert tr.step_count == 1  # the step was applied: the error says so, and its loss
        msg = str(e.value)
        assert msg.startswith(
            f"Observe(trace_dir=...): {traces}/step-1.trace.json: the trace of step 1 was not written"
        )
        assert f"the step was applied (loss {tr.history[-1].loss}" in msg and "\n" not in msg, msg
    assert traces.read_text() == "mine"


@pytest.mark.parametrize("offload", [None, P.Offload(to="host")])
def test_a_ray_trainers_close_ends_each_actors_offload_first_within_its_grace(offload):
    """With offload, a Ray Trainer's ``close`` asks every actor to end its stages' offload (which removes the files
    a failed last step left, as ``StageWorker.set_offload(None)`` does in-process) and waits at most
    ``CLOSE_GRACE`` for them before ending the actors; without offload it ends them at once. Stand-ins for the
    actors and Ray: the calls in order."""
    from vjpsplit_cli.pipeline.training import ray_backend

    calls: list[tuple] = []

    class Method:
        def __init__(self, worker):
            self.worker = worker

        def remote(self, spec):
            calls.append(("offload", self.worker, spec))
            return f"ref{self.worker}"

    class Actor:
        def __init__(self, worker):
            self.offload = Method(worker)

    class Ray:
        def wait(self, refs, num_returns, timeout):
            calls.append(("wait", list(refs), num_returns, timeout))
            return refs, []

    class Pipeline:
        actors, ray = [Actor(0), Actor(1)], Ray()

        def close(self):
            calls.append(("close",))

    backend = object.__new__(ray_backend.RayBackend)
    backend.offload, backend.rp = offload, Pipeline()
    backend.close()
    ended = [("offload", 0, None), ("offload", 1, None), ("wait", ["ref0", "ref1"], 2, ray_backend.CLOSE_GRACE)]
    assert calls == (ended if offload is not None else []) + [("close",)]
