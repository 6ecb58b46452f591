"""Checkpoints and ``fit`` from outside (issue 43, items 1-10): damaged indexes, bad places, user files, dead
writers' temps, Ctrl-C mid-write, readers racing writers, non-finite steps, wrong shapes, NumPy scalars, re-runs."""

from __future__ import annotations

import functools
import json
import os
import signal
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
from vjpsplit_cli.files import load_arrays
from vjpsplit_cli.pipeline.runtime.ray.waiting import WorkerLost
from vjpsplit_cli.pipeline.training import checkpoint as ckpt
from vjpsplit_cli.pipeline.training import fit as fit_module
from vjpsplit_cli.safeio import temps


def _batches(n, scale=1.0):
    rng = np.random.default_rng(3)
    return [
        (
            (scale * rng.normal(size=(8, D))).astype(np.float32),
            rng.normal(size=(8, OUT)).astype(np.float32),
        )
        for _ in range(n)
    ]


def _trainer(**kw):
    kw.setdefault("optimizer", optax.sgd(0.1))
    kw.setdefault("microbatches", 2)
    return P.Trainer(_stages(), _params(), **kw)


@functools.lru_cache(maxsize=None)
def _saved_index_and_files():
    """A checkpoint's index and files (bytes), written once and copied per test."""
    import tempfile

    d = os.path.join(tempfile.mkdtemp(), "ck")
    tr = _trainer(clip_global_norm=1.0)
    tr.step(_batches(1)[0])
    tr.save(d)
    files = {n: open(os.path.join(d, n), "rb").read() for n in os.listdir(d)}
    return json.loads(files[ckpt.INDEX]), files


def _write(tmp_path, index=None, damage=None, name="ck"):
    saved, files = _saved_index_and_files()
    d = tmp_path / name
    d.mkdir()
    for n, data in files.items():
        (d / n).write_bytes(data)
    if index is not None:
        (d / ckpt.INDEX).write_text(json.dumps(index))
    if damage is not None:
        damage(d)
    return d


def _changed(path, value):
    index = json.loads(json.dumps(_saved_index_and_files()[0]))
    node = index
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return index


# 1. The index checked field by field; a damaged array file blamed on that file.


@pytest.mark.parametrize(
    "path, value, field",
    [
        (("step",), -3, "step is -3, not an int >= 0"),
        (("step",), 2.5, "step is 2.5, not an int >= 0"),
        (("meta",), [1], "meta is \\[1\\], not an object"),
        (("meta", "microbatches"), "eight", "meta.microbatches is 'eight', not an int >= 1"),
        (("meta", "clip_global_norm"), "abc", "meta.clip_global_norm is 'abc', not a positive number"),
        (("params", "leaves"), ["params/w0"], "params.leaves lacks 'params/w1'"),
        (("params", "keys"), "params/w0", "params.keys is 'params/w0', not a list of strings"),
    ],
)
def test_a_damaged_index_field_is_one_error_naming_it(tmp_path, path, value, field):
    d = _write(tmp_path, _changed(path, value))
    for read in (
        lambda: P.Trainer.restore(d, _stages(), optimizer=optax.sgd(0.1)),
        lambda: P.load_checkpoint(d, optimizer=optax.sgd(0.1)),
        lambda: _trainer().fit(_batches(3), steps=3, checkpoint_dir=d),
    ):
        with pytest.raises(VjpsplitError, match=f"checkpoint.json's {field}.*the checkpoint is damaged"):
            read()


def test_a_damaged_array_file_is_blamed_on_that_file(tmp_path):
    def truncate(d):
        data = (d / ckpt.OPT_STATE).read_bytes()
        (d / ckpt.OPT_STATE).write_bytes(data[: len(data) // 2])

    d = _write(tmp_path, damage=truncate, name="a")
    with pytest.raises(VjpsplitError, match="opt_state.npz") as e:
        P.load_checkpoint(d, optimizer=optax.sgd(0.1))
    assert "checkpoint.json" not in str(e.value)

    def flip(d):
        data = bytearray((d / ckpt.PARAMS).read_bytes())
        w0 = load_arrays(d / ckpt.PARAMS)[0]["params/w0"]
        at = bytes(data).index(w0.tobytes()[:8])  # inside w0's data: its CRC-32 no longer matches
        data[at] ^= 0xFF
        (d / ckpt.PARAMS).write_bytes(bytes(data))

    d = _write(tmp_path, damage=flip, name="b")
    with pytest.raises(VjpsplitError, match="params.npz") as e:
        P.load_checkpoint(d, optimizer=optax.sgd(0.1))
    assert "checkpoint.json" not in str(e.value)


# 2. fit checks checkpoint_dir before the first step; 3. nothing the user put there is deleted.


def test_fit_refuses_a_bad_checkpoint_dir_before_the_first_step_and_takes_an_empty_one(tmp_path):
    tr, asked = _trainer(), []

    def data(k):
        asked.append(k)
        return _batches(3)[k]

    (tmp_path / "file").write_text("x")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    for where, message in [
        (tmp_path / "file", "file: is a file, not a directory"),
        (tmp_path / "file" / "ck", "does not exist; create it first"),
        (tmp_path / "notes", "notes: exists and is not a vjpsplit checkpoint \\(it holds 'todo.txt'\\)"),
    ]:
        with pytest.raises(VjpsplitError, match=message):
            tr.fit(data, steps=3, checkpoint_dir=where)
    assert asked == [] and tr.step_count == 0  # refused before any step
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()  # made by the user, as `mkdir ck`
    tr.fit(data, steps=2, checkpoint_dir=tmp_path / "empty")
    assert P.load_checkpoint(tmp_path / "empty", optimizer=optax.sgd(0.1))[2] == 2


def test_a_place_it_cannot_write_is_refused_as_os_access_says(tmp_path, monkeypatch):
    # As root (CI containers) nothing is unwritable: the system's answer is faked.
    monkeypatch.setattr(ckpt.os, "access", lambda path, mode: os.path.abspath(path) != str(tmp_path))
    tr = _trainer()
    with pytest.raises(VjpsplitError, match=f"ck: cannot write in {tmp_path} \\(a checkpoint is written beside"):
        tr.fit(_batches(2), steps=2, checkpoint_dir=tmp_path / "ck")
    assert tr.step_count == 0


def test_a_save_refuses_to_delete_a_file_it_did_not_write(tmp_path):
    tr = _trainer()
    tr.fit(_batches(2), steps=1, checkpoint_dir=tmp_path / "ck")
    (tmp_path / "ck" / "README").write_text("my run's notes")
    with pytest.raises(VjpsplitError, match="ck: holds 'README', which no checkpoint save wrote; .*would delete it"):
        tr.save(tmp_path / "ck")
    with pytest.raises(VjpsplitError, match="holds 'README'"):
        tr.fit(_batches(2), steps=2, checkpoint_dir=tmp_path / "ck")
    assert (tmp_path / "ck" / "README").read_text() == "my run's notes"
    assert P.load_checkpoint(tmp_path / "ck", optimizer=optax.sgd(0.1))[2] == 1


# 4. A dead writer's temp directories are swept; the no-exchange fallback's old copy comes back.

_DEAD = """
import os, sys
sys.path.insert(0, sys.argv[2])
from vjpsplit_cli.pipeline.training import checkpoint as ckpt
def killed(tmp, target):
    if sys.argv[3] == "aside":
        os.rename(target, tmp + ".old")  # the fallback's first rename, then killed
    os._exit(9)
ckpt._swap_in = killed
ckpt.write_directory(sys.argv[1], {ckpt.PARAMS: {}}, {"kind": ckpt.KIND, "format": 2})
"""


def _dead_writer(target, how):
    root = os.path.dirname(os.path.dirname(os.path.abspath(ckpt.__file__)))
    root = os.path.dirname(os.path.dirname(root))
    r = subprocess.run([sys.executable, "-c", _DEAD, str(target), root, how], capture_output=True, timeout=120)
    assert r.returncode == 9, r.stderr.decode()


def _temps(parent):
    return sorted(n for n in os.listdir(parent) if n.startswith(".ck."))


def test_a_dead_writers_temp_directory_is_swept_by_the_next_save_and_restore(tmp_path):
    tr = _trainer()
    tr.save(tmp_path / "ck")
    _dead_writer(tmp_path / "ck", "before")
    assert len(_temps(tmp_path)) == 1  # a whole checkpoint's files, beside it
    P.Trainer.restore(tmp_path / "ck", _stages(), optimizer=optax.sgd(0.1)).close()
    assert _temps(tmp_path) == []
    _dead_writer(tmp_path / "ck", "before")
    tr.save(tmp_path / "ck")
    assert _temps(tmp_path) == [] and sorted(os.listdir(tmp_path / "ck")) == sorted(
        [ckpt.INDEX, ckpt.PARAMS, ckpt.OPT_STATE]
    )
    (tmp_path / ".ck.00000000.vjps1-0-00000000.tmp").mkdir()  # another host's, fresh: not judged by its pid
    tr.save(tmp_path / "ck")
    assert _temps(tmp_path) == [".ck.00000000.vjps1-0-00000000.tmp"]


def test_a_fallback_swap_cut_between_its_renames_returns_to_the_old_checkpoint(tmp_path):
    tr = _trainer()
    tr.fit(_batches(2), steps=2, checkpoint_dir=tmp_path / "ck")
    _dead_writer(tmp_path / "ck", "aside")  # no ck now: the old one at <tmp>.old, the new at <tmp>
    assert not (tmp_path / "ck").exists() and len(_temps(tmp_path)) == 2
    later, asked = _trainer(), []
    later.fit(lambda k: asked.append(k) or _batches(3)[k], steps=3, checkpoint_dir=tmp_path / "ck")
    assert asked == [2]  # it began from the old checkpoint's step 2, not from step 0
    assert _temps(tmp_path) == [] and P.load_checkpoint(tmp_path / "ck", optimizer=optax.sgd(0.1))[2] == 3


def test_a_temp_directory_holding_a_users_file_is_not_swept(tmp_path):
    (tmp_path / "ck").mkdir()
    dead = tmp_path / ".ck.0123abcd.vjps999999999-0-{}.tmp".format(temps.writer_tag().rsplit("-", 1)[1])
    dead.mkdir()
    (dead / ckpt.PARAMS).write_bytes(b"x")
    (dead / "mine.txt").write_text("keep")
    ckpt.tidy(tmp_path / "ck")
    assert sorted(os.listdir(dead)) == ["mine.txt"]


# 5. Ctrl-C during a background write: the write finishes before KeyboardInterrupt leaves fit.


def test_ctrl_c_while_fit_waits_for_a_write_lets_the_write_finish(tmp_path, monkeypatch):
    real, finished = fit_module.save_checkpoint, []

    def slow(directory, ck):
        if ck.step == 1:
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # while fit waits for this write
            time.sleep(1.5)
        real(directory, ck)
        finished.append(ck.step)

    monkeypatch.setattr(fit_module, "save_checkpoint", slow)
    with pytest.raises(KeyboardInterrupt):
        _trainer().fit(_batches(3), steps=3, checkpoint_dir=tmp_path / "ck", checkpoint_every=1)
    assert finished == [1]  # done before fit let the interrupt out
    assert _temps(tmp_path) == [] and P.load_checkpoint(tmp_path / "ck", optimizer=optax.sgd(0.1))[2] == 1


# 6. A reader racing a writer never pairs one save's index with another's arrays.


def test_a_read_racing_a_save_never_pairs_one_steps_index_with_anothers_arrays(tmp_path, monkeypatch):
    tr = _trainer()
    tr.save(tmp_path / "ck")
    tr.step(_batches(1)[0])
    want = tr.params()
    real, raced = ckpt.load_arrays, []

    def racing(path):
        if not raced:  # the index of step 0 is read; step 1's save swaps in before the arrays are
            raced.append(path)
            tr.save(tmp_path / "ck")
        return real(path)

    monkeypatch.setattr(ckpt, "load_arrays", racing)
    params, _, step = P.load_checkpoint(tmp_path / "ck", optimizer=optax.sgd(0.1))
    assert raced and step == 1
    np.testing.assert_array_equal(params["w0"], want["w0"])


# 7. A non-finite loss or gradient norm stops fit; the last finite checkpoint stays.


def test_a_nonfinite_step_stops_fit_and_keeps_the_last_finite_checkpoint(tmp_path):
    batches = _batches(4)
    batches[2] = (np.full((8, D), np.nan, np.float32), batches[2][1])
    tr = _trainer()
    with pytest.raises(VjpsplitError, match=r"step 2: the loss is nan .*ck keeps the state after 2 steps"):
        tr.fit(batches, steps=4, checkpoint_dir=tmp_path / "ck", checkpoint_every=1)
    saved, _, step = P.load_checkpoint(tmp_path / "ck", optimizer=optax.sgd(0.1))
    assert step == 2 and all(np.isfinite(v).all() for v in saved.values())
    on = _trainer()
    losses = on.fit(batches, steps=4, stop_on_nonfinite=False)
    assert len(losses) == 4 and np.isnan(losses[2])


def test_a_nonfinite_gradient_norm_with_a_finite_loss_stops_fit():
    params = _params()
    params["w1"] = np.full_like(params["w1"], 3e18)  # loss ~4e37, but the squared gradients overflow float32
    tr = P.Trainer(_stages(), params, optimizer=optax.sgd(0.0), microbatches=2)
    with pytest.raises(VjpsplitError, match=r"step 0: the loss is [0-9.]+e\+37 and the gradients' global norm inf"):
        tr.fit(_batches(2), steps=2)
    assert tr.step_count == 1


# 8. load and restore check the parameters' shapes and dtypes.


def test_resuming_and_restore_refuse_a_wrong_shaped_parameter_naming_it(tmp_path):
    small = {"w0": np.zeros((D, D), np.float32), "w1": np.zeros((D, OUT + 1), np.float32)}
    index = _changed(("step",), 0)
    d = _write(tmp_path)
    ckpt.write_directory(
        d,
        {ckpt.PARAMS: {"params/w0": small["w0"], "params/w1": small["w1"]}, ckpt.OPT_STATE: {}},
        {k: v for k, v in index.items() if k != "id"},
    )
    tr = _trainer()
    before = tr.params()
    with pytest.raises(
        VjpsplitError, match=r"parameter 'params/w1' is float32\[4, 3\], the stages take float32\[4, 2\]"
    ):
        tr.fit(_batches(2), steps=2, checkpoint_dir=d)  # resumes from d: refused before any step
    np.testing.assert_array_equal(tr.params()["w1"], before["w1"])  # the Trainer keeps its parameters
    with pytest.raises(VjpsplitError, match=r"parameter 'params/w1' is float32\[4, 3\]"):
        P.Trainer.restore(d, _stages(), optimizer=optax.sgd(0.1))
    wide = {"params/w0": small["w0"].astype(np.float64), "params/w1": np.zeros((D, OUT), np.float32)}
    ckpt.write_directory(d, {ckpt.PARAMS: wide, ckpt.OPT_STATE: {}}, {k: v for k, v in index.items() if k != "id"})
    with pytest.raises(VjpsplitError, match=r"parameter 'params/w0' is float64\[4, 4\], the stages take float32"):
        tr.fit(_batches(2), steps=2, checkpoint_dir=d)  # resumes from d: refused before any step


# 9. NumPy scalars where numbers are expected; save never raises json's TypeError.


def test_numpy_scalars_work_as_numbers_and_a_string_clip_is_one_error(tmp_path):
    tr = _trainer(clip_global_norm=np.float32(0.5), microbatches=np.int64(2))
    tr.fit(_batches(1), steps=1, checkpoint_dir=tmp_path / "ck")
    meta = json.loads((tmp_path / "ck" / ckpt.INDEX).read_text())["meta"]
    assert meta["clip_global_norm"] == 0.5 and meta["microbatches"] == 2
    auto = _trainer(schedule=P.Schedule("auto", memory_limit=np.int64(4)))
    auto.save(tmp_path / "auto")
    assert json.loads((tmp_path / "auto" / ckpt.INDEX).read_text())["meta"]["memory_limit"] == 4
    with pytest.raises(VjpsplitError, match="clip_global_norm='1' is a str; give a positive number"):
        _trainer(clip_global_norm="1")
    ck = tr.host_checkpoint()
    bad = ckpt.HostCheckpoint(ck.params, ck.leaves, ck.structure, ck.opt_state, ck.step, {"note": object()})
    with pytest.raises(VjpsplitError, match="cannot record meta 'note' = <object"):
        ckpt.save_checkpoint(tmp_path / "other", bad)
    assert not (tmp_path / "other").exists()


# 10. The callback hears of re-run steps.


def test_the_callback_hears_which_steps_run_again_after_a_restart(tmp_path, monkeypatch):
    tr, batches = _trainer(), _batches(5)
    real_step, lost = tr.step, []

    def step(batch, **kw):
        if tr.step_count == 3 and not lost:  # the worker "dies" in step 3, after the checkpoint of step 2
            lost.append(1)
            raise WorkerLost("stage 0 lost", [0], "ACTOR_DIED")
        return real_step(batch, **kw)

    monkeypatch.setattr(tr, "step", step)
    monkeypatch.setattr(tr.backend, "replace", lambda workers: None, raising=False)
    new, old = [], []
    tr.fit(
        batches,
        steps=5,
        checkpoint_dir=tmp_path / "ck",
        checkpoint_every=2,
        max_restarts=1,
        callback=lambda k, loss, rerun: new.append((k, rerun)),
    )
    assert new == [(0, False), (1, False), (2, False), (2, True), (3, False), (4, False)]
    lost.clear()
    tr2 = _trainer()
    real2 = tr2.step

    def step2(batch, **kw):
        if tr2.step_count == 3 and not lost:
            lost.append(1)
            raise WorkerLost("stage 0 lost", [0], "ACTOR_DIED")
        return real2(batch, **kw)

    monkeypatch.setattr(tr2, "step", step2)
    monkeypatch.setattr(tr2.backend, "replace", lambda workers: None, raising=False)
    tr2.fit(  # a callback of two arguments, as before
        batches,
        steps=5,
        checkpoint_dir=tmp_path / "ck2",
        checkpoint_every=2,
        max_restarts=1,
        callback=lambda k, v: old.append(k),
    )
    assert old == [0, 1, 2, 2, 3, 4]


def test_restore_in_the_per_stage_form_refuses_a_wrong_shaped_parameter(tmp_path):
    from models import mlp_stage_artifacts

    arts, params = mlp_stage_artifacts(2, np.random.default_rng(0), D, OUT, scale=2.0)
    tr = P.Trainer(arts, params, optimizer=optax.sgd(0.1), microbatches=2)
    tr.save(tmp_path / "ck")
    index = json.loads((tmp_path / "ck" / ckpt.INDEX).read_text())
    flat, _ = load_arrays(tmp_path / "ck" / ckpt.PARAMS)
    key = sorted(flat)[0]
    flat[key] = np.zeros(flat[key].shape + (1,), flat[key].dtype)
    opt, _ = load_arrays(tmp_path / "ck" / ckpt.OPT_STATE)
    ckpt.write_directory(
        tmp_path / "ck", {ckpt.PARAMS: flat, ckpt.OPT_STATE: opt}, {k: v for k, v in index.items() if k != "id"}
    )
    with pytest.raises(VjpsplitError, match=f"parameter '{key}' is float32\\[.*, 1\\], the stages take float32"):
        P.Trainer.restore(tmp_path / "ck", arts, optimizer=optax.sgd(0.1))
    with pytest.raises(VjpsplitError, match=f"parameter '{key}' is float32"):
        tr.fit(_batches(2), steps=2, checkpoint_dir=tmp_path / "ck")
