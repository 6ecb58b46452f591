"""Residuals off the device between F and B (``offload=``): bitwise the same gradients and training, and one
clear error for an offload file that is missing, damaged or another microbatch's."""

from __future__ import annotations

import functools
import os
import shutil

import jax
import numpy as np
import optax
import pytest
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.pipeline.runtime.offload import Offloader

M = 4


@functools.lru_cache(maxsize=None)
def _stages():
    return vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")


def _batches(n):
    return [gpt_batch(2 * M, seed=60 + i) for i in range(n)]


def _bitwise(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb) and la
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def _offloads(tmp_path):
    return {"host": "host", "files": P.Offload(to="files", directory=str(tmp_path / "off"))}


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1", "gpipe"])
@pytest.mark.parametrize("to", ["host", "files"])
def test_gradients_bitwise_with_offload(schedule, to, tmp_path):
    params, batch = gpt_params(), _batches(1)[0]
    for timed in (False, True):
        ref = P.run_inprocess(_stages(), params, batch, microbatches=M, schedule_name=schedule, timed=timed)
        got = P.run_inprocess(
            _stages(),
            params,
            batch,
            microbatches=M,
            schedule_name=schedule,
            timed=timed,
            offload=_offloads(tmp_path)[to],
        )
        _bitwise(got.grads, ref.grads)
        assert got.loss == ref.loss
    if to == "files":
        assert os.listdir(tmp_path / "off") == []  # each file is removed once read back


def _train(schedule, offload, steps=3, **kw):
    params, tx = gpt_params(), optax.adamw(1e-2)
    with P.Trainer(
        _stages(), params, optimizer=tx, schedule_name=schedule, microbatches=M, offload=offload, **kw
    ) as tr:
        losses = [tr.step(b, timed=i == 1) for i, b in enumerate(_batches(steps))]
        peaks = [t.worker.peak_residual_bytes for t in tr.backend.trainers]
        return losses, tr.params(), tr.state()[1], peaks, tr


FIXED = {"F": [1.0] * 4, "B": [1.0] * 4, "W": [0.8] * 4, "comm": 0.1}


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1", "auto"])
def test_training_steps_bitwise_with_offload(schedule, tmp_path, monkeypatch):
    if schedule == "auto":
        # auto plans from measured times: fixed costs give both runs the same plans.
        monkeypatch.setattr(P.Trainer, "costs", lambda self: FIXED)
    ref_losses, ref_params, ref_state, ref_peaks, ref_tr = _train(schedule, None)
    for to, off in _offloads(tmp_path).items():
        losses, params, state, peaks, tr = _train(schedule, off)
        assert losses == ref_losses, to
        _bitwise(params, ref_params)
        _bitwise(state, ref_state)
        assert tr.last_result.plans == ref_tr.last_result.plans
        # The first stage holds fewer residual bytes at its peak; the last (its B follows its F) the same.
        assert peaks[0] < ref_peaks[0], (to, peaks, ref_peaks)
        assert peaks[-1] == ref_peaks[-1]


def test_gpipe_first_stage_peak_drops_with_host_offload():
    _, _, _, ref, _ = _train("gpipe", None, steps=1)
    _, _, _, got, _ = _train("gpipe", P.Offload(stages=[0]), steps=1)
    # GPipe's first stage holds all M microbatches without offload; with it, at most the one made, the one
    # on its way out and the one on its way back.
    assert got[0] <= ref[0] * 3 // M and got[1:] == ref[1:]


def test_offload_only_some_microbatches(tmp_path):
    ref_losses, ref_params, _, _, _ = _train("1f1b", None, steps=2)
    losses, params, _, _, _ = _train("1f1b", P.Offload(microbatches=[1, 2]), steps=2)
    assert losses == ref_losses
    _bitwise(params, ref_params)


def _damaged(monkeypatch, how):
    write = Offloader._write

    def damaging(self, path, res):
        write(self, path, res)
        if self.stage == 0 and path.endswith("mb1.npz"):
            if how == "missing":
                os.unlink(path)
            elif how == "flipped":
                data = bytearray(open(path, "rb").read())
                data[len(data) // 2] ^= 0xFF
                open(path, "wb").write(bytes(data))
            else:  # another microbatch's file in its place
                other = path.replace("mb1.npz", "mb0.npz")
                assert os.path.exists(other)  # mb0's write ran first on this thread, its B not yet
                shutil.copyfile(other, path)

    monkeypatch.setattr(Offloader, "_write", damaging)


@pytest.mark.parametrize("how", ["missing", "flipped", "swapped"])
@pytest.mark.parametrize("timed", [False, True])
def test_damaged_or_missing_offload_file_is_one_clear_error(how, timed, tmp_path, monkeypatch):
    _damaged(monkeypatch, how)
    off = P.Offload(to="files", directory=str(tmp_path / "off"))
    params, batch = gpt_params(), _batches(1)[0]
    with pytest.raises(VjpsplitError) as e:
        # GPipe: every first-stage F runs before any B, so mb0's file is still there when mb1's is written.
        P.run_inprocess(_stages(), params, batch, microbatches=M, schedule_name="gpipe", timed=timed, offload=off)
    msg = str(e.value)
    path = str(tmp_path / "off" / "stage0-mb1.npz")
    assert msg.startswith(f"stage 0 microbatch 1: offloaded residuals {path}: "), msg
    assert "\n" not in msg
    want = {"missing": "no such", "flipped": "corrupt|CRC", "swapped": "another forward"}
    assert any(w.lower() in msg.lower() for w in want[how].split("|")), msg


def test_bad_offload_values_are_refused():
    with pytest.raises(VjpsplitError, match="offload='disk'"):
        P.Trainer(_stages(), gpt_params(), optimizer=optax.sgd(0.1), microbatches=M, offload="disk")
    with pytest.raises(VjpsplitError, match="needs directory="):
        P.Offload(to="files")
    with pytest.raises(VjpsplitError, match="'host' or 'files'"):
        P.Offload(to="gpu")
    with pytest.raises(VjpsplitError, match="microbatches="):
        P.Offload(microbatches=["0"])


@pytest.mark.parametrize("timed", [False, True])
def test_host_offload_without_a_host_memory_kind_copies_to_numpy(timed, monkeypatch):
    from vjpsplit_cli.pipeline.runtime import offload

    copies = []
    to_host = offload._to_host

    def spy(arrays):
        copies.append(len(arrays))
        return to_host(arrays)

    monkeypatch.setattr(offload, "_has_pinned_host", lambda a: False)  # a platform without pinned_host
    monkeypatch.setattr(offload, "_to_host", spy)
    params, batch = gpt_params(), _batches(1)[0]
    ref = P.run_inprocess(_stages(), params, batch, microbatches=M, schedule_name="zbh1", timed=timed)
    got = P.run_inprocess(_stages(), params, batch, microbatches=M, schedule_name="zbh1", timed=timed, offload="host")
    _bitwise(got.grads, ref.grads)
    assert copies  # the NumPy path ran
