"""runner=P.Distributed(): N local CPU processes of one jax.distributed job (gloo), each running the same script
(tests/distributed_job.py, started by ``python -m vjpsplit_cli.pipeline.launch``), train as one process does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax._src import xla_bridge
from models import optax_reference
from stage_models import gpt, gpt_batch, gpt_params

from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError

JOB = Path(__file__).with_name("distributed_job.py")
ROOT = Path(__file__).resolve().parents[1]
STEPS, CLIP = 3, 0.5
# Whether this jax moves an array between CPU processes (0.10 does; 0.6.2, CI's oldest, does not: there every
# process of the job refuses P.Distributed() with one error naming the fix, which the tests check instead).
MOVES = hasattr(xla_bridge, "CROSS_HOST_TRANSFER_SOCKET_ADDRESS")


def _launch(out: Path, processes: int, devices: int, schedules: str, clip: float) -> bool:
    """The job on ``processes`` local processes of ``devices`` CPU devices each, a bounded wait; whether it ran
    (where this jax cannot move arrays between processes: that it stopped at the refusal)."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "vjpsplit_cli.pipeline.launch", "-n", str(processes), "--devices", str(devices)]
    cmd += [str(JOB), str(out), schedules, str(clip), str(STEPS)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    if not MOVES:
        assert done.returncode != 0 and "cannot move an array between processes" in done.stderr, done.stderr[-4000:]
        return False
    assert done.returncode == 0, done.stderr[-4000:]
    return True


def _reference(clip: float) -> tuple[list[float], dict[str, np.ndarray]]:
    tx = optax.adamw(1e-2)
    tx = optax.chain(optax.clip_by_global_norm(clip), tx) if clip else tx
    losses, params = optax_reference(gpt, gpt_params(), tx, [gpt_batch(8, seed=10 + i) for i in range(STEPS)])
    return losses, {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def _check_equal_one_process(out: Path, processes: int, schedules: list[str], clip: float) -> list[dict]:
    ref_losses, ref_params = _reference(clip)
    got = []
    for schedule in schedules:
        runs = [np.load(out / f"{p}-{schedule}.npz") for p in range(processes)]
        for run in runs:
            np.testing.assert_allclose(run["losses"], ref_losses, rtol=1e-6)
            for k, v in ref_params.items():
                np.testing.assert_allclose(run[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
            # every process the same numbers, bitwise
            np.testing.assert_array_equal(run["losses"], runs[0]["losses"])
            np.testing.assert_array_equal(run["norms"], runs[0]["norms"])
        got.append(runs[0])
    return got


def test_two_processes_with_two_devices_each_train_as_one_process(tmp_path):
    """PP 4 over 2 processes (stages 0-1 in the first, 2-3 in the second): 1F1B and ZB-H1, the tied embedding
    summed across processes, the global norm clipped; every process gets the same losses and params()."""
    if not _launch(tmp_path, 2, 2, "1f1b,zbh1", CLIP):
        return
    runs = _check_equal_one_process(tmp_path, 2, ["1f1b", "zbh1"], CLIP)
    for run in runs:
        assert run["placement"].tolist() == [0, 0, 1, 1]
        assert min(run["norms"]) > 2 * CLIP  # clipping acted on every step, so a missing scale would show
    refused = json.loads((tmp_path / "0-refusals.json").read_text())
    assert "stage 0 has [CpuDevice(id=0), CpuDevice(id=1)]" in refused["two devices"]
    assert "give one list of one device of jax.devices() per stage" in refused["a string"]
    said = (tmp_path / "1-fit.txt").read_text()
    assert said.startswith("fit(max_restarts=1): a jax.distributed job cannot replace a lost process"), said


def test_four_processes_one_stage_each_train_as_one_process(tmp_path):
    """PP 4 on 4 processes, one device each: every activation and cotangent crosses processes."""
    if not _launch(tmp_path, 4, 1, "gpipe", CLIP):
        return
    (run,) = _check_equal_one_process(tmp_path, 4, ["gpipe"], CLIP)
    assert run["placement"].tolist() == [0, 1, 2, 3]


def test_distributed_before_jax_distributed_initialize_is_one_clear_error():
    assert not jax.distributed.is_initialized()
    with pytest.raises(VjpsplitError, match=r"call jax.distributed.initialize\(\) first, in every process"):
        P.Distributed()
    with pytest.raises(VjpsplitError, match=r"call jax.distributed.initialize\(\) first"):
        P.Trainer([], [], optimizer=optax.sgd(0.1), microbatches=2, runner="distributed")
    with pytest.raises(VjpsplitError, match=r"data_parallel=2\): replicas across processes are not supported yet"):
        P.Distributed(data_parallel=2)
