"""runner=P.Distributed(): N local CPU processes of one jax.distributed job (gloo), each running the same script
(tests/distributed_job.py, started by ``python -m vjpsplit_cli.pipeline.launch``), train as one process does.

Two jobs, to keep CI short: 4 processes train and write a checkpoint (``four``); 2 processes (``two``) train,
restore that checkpoint and go on, train PP 2 x DP 2, time steps, evaluate, train stages with aux and with a
PRNG key, then lose a process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax._src import xla_bridge
from models import optax_reference
from stage_models import (
    aux_loss,
    dropout_batches,
    dropout_loss,
    dropout_params,
    dropout_specs,
    gpt,
    gpt_batch,
    gpt_params,
    gpt_specs,
    mlp,
    mlp_params,
    specs_like,
    tied,
    tied_batches,
    tied_params,
    tied_specs,
)

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.pipeline import launch

JOB = Path(__file__).with_name("distributed_job.py")
ROOT = Path(__file__).resolve().parents[1]
STEPS, CLIP = 3, 0.5
AUTO_STEPS = 8  # distributed_job.AUTO_STEPS (that module starts jax.distributed when imported)
# Whether this jax moves an array between CPU processes (0.10 does; 0.6.2, CI's oldest, does not: there every
# process of the job refuses P.Distributed() with one error naming the fix, which the tests check instead).
MOVES = hasattr(xla_bridge, "CROSS_HOST_TRANSFER_SOCKET_ADDRESS")


def _launch(
    out: Path, processes: int, devices: int, schedules: str, clip: float, phases: str = "", fails: bool = False
) -> bool:
    """The job on ``processes`` local processes of ``devices`` CPU devices each, a bounded wait; whether it ran
    (where this jax cannot move arrays between processes: that it stopped at the refusal). ``fails``: the job
    loses a process on purpose (the launcher's exit code is then that process's, 1)."""
    cmd = [sys.executable, "-m", "vjpsplit_cli.pipeline.launch", "-n", str(processes), "--devices", str(devices)]
    cmd += ["--grace", "60", str(JOB), str(out), schedules, str(clip), str(STEPS), phases]
    return _ran(subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=400), fails)


def _env() -> dict[str, str]:
    """This process's environment for a child job: CPU only, its devices as the launcher sets them (no XLA_FLAGS
    of this process), this checkout and tests/ importable."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(
        JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    )
    return env


def _ran(done: subprocess.CompletedProcess, fails: bool = False) -> bool:
    """Whether a launched job ran: where this jax cannot move arrays between processes, that it stopped at the
    refusal instead (False); else that it exited 0 (1 where it ``fails``: loses a process on purpose)."""
    if not MOVES:
        assert done.returncode != 0 and "cannot move an array between processes" in done.stderr, done.stderr[-4000:]
        return False
    assert done.returncode == (1 if fails else 0), done.stderr[-4000:]
    return True


def _reference(clip: float, steps: int = STEPS) -> tuple[list[float], dict[str, np.ndarray]]:
    tx = optax.adamw(1e-2)
    tx = optax.chain(optax.clip_by_global_norm(clip), tx) if clip else tx
    losses, params = optax_reference(gpt, gpt_params(), tx, [gpt_batch(8, seed=10 + i) for i in range(steps)])
    return losses, {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def _tied_reference(steps: int) -> tuple[list[float], dict[str, np.ndarray]]:
    """The ``replicas`` phase's model in one process: clipped adamw on ``tied_batches(steps, rows=16)``."""
    tx = optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(1e-2))
    losses, params = optax_reference(tied, tied_params(), tx, tied_batches(steps, rows=16))
    return losses, {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def _check_equal_one_process(
    out: Path,
    processes: int,
    schedules: list[str],
    clip: float,
    reference: tuple[list[float], dict[str, np.ndarray]] | None = None,
    prefix: str = "",
) -> list[dict]:
    """Every process's ``<p>-<prefix><schedule>.npz`` equal to ``reference`` (default: the GPT's in one process)."""
    ref_losses, ref_params = _reference(clip) if reference is None else reference
    got = []
    for schedule in schedules:
        runs = [np.load(out / f"{p}-{prefix}{schedule}.npz") for p in range(processes)]
        for run in runs:
            np.testing.assert_allclose(run["losses"], ref_losses, rtol=1e-6)
            for k, v in ref_params.items():
                np.testing.assert_allclose(run[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
            # every process the same numbers, bitwise
            np.testing.assert_array_equal(run["losses"], runs[0]["losses"])
            np.testing.assert_array_equal(run["norms"], runs[0]["norms"])
        got.append(runs[0])
    return got


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> Path | None:
    """The 4-process job (one device each, GPipe): STEPS steps, then one more under fit(checkpoint_dir=<out>/ck),
    and save(<out>/saved): both checkpoints after STEPS + 1 steps, written by 4 processes. None where this jax
    cannot run it."""
    out = tmp_path_factory.mktemp("four")
    return out if _launch(out, 4, 1, "gpipe", CLIP, "write") else None


@pytest.fixture(scope="module")
def two(four, tmp_path_factory) -> Path | None:
    """The 2-process job (two devices each): the GPT on 1F1B and ZB-H1, then resuming the checkpoint ``four``
    wrote (``resume``), PP 2 x DP 2 (``replicas``), timed steps and evaluation (``timed``), stages with aux and with
    a PRNG key (``aux``), and losing process 1 (``kill``). None where this jax cannot run it (checked: every
    process refused ``Distributed()``)."""
    out = tmp_path_factory.mktemp("two")
    if four is None:
        assert not _launch(out, 2, 2, "1f1b,zbh1", CLIP)
        return None
    for name in ("ck", "saved"):
        (out / name).mkdir()
        for f in (four / name).iterdir():
            (out / name / f.name).write_bytes(f.read_bytes())
    assert _launch(out, 2, 2, "1f1b,zbh1", CLIP, "resume,replicas,timed,aux,kill", fails=True)
    return out


def test_two_processes_with_two_devices_each_train_as_one_process(two):
    """PP 4 over 2 processes (stages 0-1 in the first, 2-3 in the second): 1F1B and ZB-H1, the tied embedding
    summed across processes, the global norm clipped; every process gets the same losses and params(). Then the
    checkpoint 4 processes wrote, restored on 2 (Trainer.restore, and fit's checkpoint_dir), goes on equal to an
    uninterrupted run; and once process 1 is gone, process 0 ends with one error naming it (the ``lost`` test)."""
    if two is None:
        return
    runs = _check_equal_one_process(two, 2, ["1f1b", "zbh1"], CLIP)
    for run in runs:
        assert run["placement"].tolist() == [[0], [0], [1], [1]]
        assert min(run["norms"]) > 2 * CLIP  # clipping acted on every step, so a missing scale would show
    refused = json.loads((two / "0-refusals.json").read_text())
    assert "stage 0 has [CpuDevice(id=0), CpuDevice(id=1)]" in refused["two devices"]
    assert "give one list of one device of jax.devices() per stage" in refused["a string"]
    said = (two / "1-fit.txt").read_text()
    assert said.startswith("fit(max_restarts=1): a jax.distributed job cannot replace a lost process"), said
    _check_continued(two)
    _check_lost(two)


@pytest.mark.filterwarnings("ignore:2 workers need 2 devices")  # one CPU device here: the stages take turns
def test_pp2_dp2_with_each_stages_replicas_in_one_process_trains_as_one_process(two):
    """Distributed(data_parallel=2) on 2 processes of 2 devices (by default, and by devices=): stage 0's two
    replicas in process 0, stage 1's in process 1, each replica's activations and cotangents moved to the matching
    replica of the other process; 1F1B and ZB-H1 with the tied embedding and clipping equal one-process optax on
    the whole batch, on every process. Each device holds its share of its stage's optimizer state (ZeRO-1), and
    the checkpoint the job wrote goes on in one process; the job's evaluation (each replica its part) equals that
    checkpoint's in one process. A stage's replicas on two processes, devices= of another
    count than data_parallel, and replicas no process has the devices for, are refused."""
    if two is None:
        return
    runs = _check_equal_one_process(two, 2, ["1f1b", "zbh1"], CLIP, _tied_reference(STEPS), prefix="dp-")
    for run in runs:
        assert run["placement"].tolist() == [[0, 0], [1, 1]]
        assert min(run["norms"]) > 2 * CLIP
    # ZB-H1 ran on devices= naming each process's devices the other way round; 1F1B on the default placement
    assert all(row == sorted(row) for row in runs[0]["ids"].tolist())
    assert runs[1]["ids"].tolist() == [row[::-1] for row in runs[0]["ids"].tolist()]
    params = tied_params()
    for p, held in enumerate(json.loads((two / f"{p}-dp-memory.json").read_text()) for p in range(2)):
        assert [stages for _, stages, _ in held] == [[p], [p]]
        # adamw's mu and nu, whole, would be twice the stage's parameters on each replica; sharded, about half that
        # (the step count and the scalar temperature's moments are whole on both)
        whole = 2 * sum(params[k].nbytes for k in (("embed", "w0", "b0"), ("embed", "w1", "temp"))[p])
        assert held[0][2] == held[1][2] < 0.6 * whole, (held, whole)
    ref_losses, ref_params = _tied_reference(STEPS + 2)
    stages = vs.export_stages(tied, *tied_specs(), wrt="params", platforms="cpu")
    tr = P.Trainer.restore(two / "dp-saved", stages, optimizer=optax.adamw(1e-2))
    assert tr.step_count == STEPS and tr.clip_global_norm == CLIP
    loss, outputs = tr.evaluate(tied_batches(STEPS, rows=16)[0], outputs=True)
    for p in range(2):  # the job's evaluation, each replica on its part, equals this one's on the whole microbatches
        evaluated = np.load(two / f"{p}-dp-eval.npz")
        np.testing.assert_allclose(evaluated["loss"], loss, rtol=1e-6)
        for m, o in enumerate(outputs):
            np.testing.assert_allclose(evaluated[f"out{m}"], o[0], rtol=1e-6, atol=1e-7)
    more = [tr.step(b) for b in tied_batches(STEPS + 2, rows=16)[STEPS:]]
    np.testing.assert_allclose(more, ref_losses[STEPS:], rtol=1e-6)
    got = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(tr.params())[0]}
    for k, v in ref_params.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    for p in range(2):
        refused = json.loads((two / f"{p}-dp-refusals.json").read_text())
        assert refused["apart"].startswith("Distributed(devices=...): stage 0's replicas are on processes [0, 1]")
        assert "leave devices= out" in refused["apart"]
        assert refused["count"].startswith("Distributed(devices=...): 2 devices per stage for data_parallel=1")
        assert refused["too few"].startswith("runner=Distributed(): 2 workers need 4 devices of one process each")
        assert "--xla_force_host_platform_device_count=4" in refused["too few"]


@pytest.mark.filterwarnings("ignore::vjpsplit_cli.pipeline.SharedDevicesWarning")
def test_timed_steps_time_each_processs_own_operations_and_evaluate_gives_the_in_process_result(two):
    """Observe(timeline=True) on 2 processes: every step timed, the losses those of the untimed one-process run on
    both processes; each process's last_result holds its own stages' operations (every F and B of them), its
    reductions, update and wait for the losses; each step's trace written. A worker of the other process is no
    one's peer: the MLP's workers 1 and 2 cost the same, and neither is named a straggler. costs() gives every
    process every stage's measured costs, the same figures (each process timed its own stages; their samples
    gathered), and schedule="auto" measures, races and keeps the same plans on every process, its losses those of
    optax on one process. Then evaluate (and outputs=True) equals the in-process runner's."""
    if two is None:
        return
    ref_losses, _ = _reference(CLIP, STEPS + 1)
    runs = [np.load(two / f"{p}-timed.npz") for p in range(2)]
    stages = vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")
    tr = P.Trainer(stages, gpt_params(), optimizer=optax.adamw(1e-2), microbatches=4, clip_global_norm=CLIP)
    for i in range(STEPS + 1):
        tr.step(gpt_batch(8, seed=10 + i))
    want_loss, want_outputs = tr.evaluate(gpt_batch(8, seed=30), outputs=True)  # the job's batch(20)
    plans = tr.plan.plans
    params = mlp_params()
    x, labels = np.ones((8, 16), np.float32), np.arange(8, dtype=np.int32) % 4
    stages = vs.export_stages(mlp, *specs_like((params, x[:2], labels[:2])), wrt="params", stages=4, platforms="cpu")
    peers = P.Trainer(stages, params, optimizer=optax.sgd(0.1), microbatches=4)
    mlp_losses = [peers.step((x, labels)) for _ in range(STEPS + 1)]
    ref = P.Trainer(stages, params, optimizer=optax.sgd(0.1), microbatches=4)
    auto_losses = [ref.step((x, labels)) for _ in range(AUTO_STEPS)]
    autos = [json.loads((two / f"{p}-timed.json").read_text())["auto"] for p in range(2)]
    assert autos[0] == autos[1]  # the same choice, races (each trial step's slowest process's time) and plans
    assert autos[0]["races"] and not autos[0]["racing"], autos[0]  # a race ran and ended within the steps
    np.testing.assert_allclose(autos[0]["losses"], auto_losses, rtol=1e-6)
    for p, run in enumerate(runs):
        np.testing.assert_allclose(run["losses"], ref_losses, rtol=1e-6)
        np.testing.assert_array_equal(run["losses"], runs[0]["losses"])
        mine = {2 * p, 2 * p + 1}
        ops = sorted((op.stage, "FBIW".index(str(op.kind)), op.mb) for w in plans for op in w if op.stage in mine)
        assert sorted(map(tuple, run["events"].tolist())) == ops
        said = json.loads((two / f"{p}-timed.json").read_text())
        assert {"run the operations", "reduce tied", "reduce norms", "update", "fetch the losses"} <= set(
            said["phases"]
        )
        assert said["stragglers"] == [[]] * 2 * (STEPS + 1)  # the MLP's workers 1 and 2 are peers, in two processes
        np.testing.assert_allclose(said["mlp"], mlp_losses, rtol=1e-6)
        costs = said["costs"]
        assert costs == json.loads((two / "0-timed.json").read_text())["costs"]  # the same on every process
        assert all(len(costs[k]) == 4 for k in "FBW") and all(v > 0 for v in costs["F"])
        assert all(costs["B"][s] + costs["W"][s] > 0 for s in range(4))
        assert costs["comm"] == costs["gap"] and costs["transfer"]["out"] > 0 and costs["transfer"]["back"] > 0
        busy = run["busy"]
        assert (busy[:, sorted(mine)] > 0).all() and (busy[:, sorted({0, 1, 2, 3} - mine)] == 0).all()
        assert len(list((two / f"trace-{p}").glob("step-*.trace.json"))) == STEPS + 1
        np.testing.assert_allclose(run["eval"], [want_loss, want_loss], rtol=1e-6)
        for m, o in enumerate(want_outputs):
            for i, a in enumerate(o):
                np.testing.assert_allclose(run[f"out{m}_{i}"], a, rtol=1e-6, atol=1e-7)


@pytest.mark.filterwarnings("ignore::vjpsplit_cli.pipeline.SharedDevicesWarning")
def test_stages_with_aux_and_a_prng_key_train_and_evaluate_as_in_process(two):
    """Stage 0 in process 0, stage 1 in process 1: stages exported with has_aux=True give every process the step's
    and the evaluation's aux; Trainer(rng=key) draws each microbatch's key as in-process; both equal the
    in-process runner's, on every process."""
    if two is None:
        return
    runs = [np.load(two / f"{p}-aux.npz") for p in range(2)]
    p, _, x, y = dropout_specs(dropout_params())
    for name, stages, rng in [
        ("aux", vs.export_stages(aux_loss, p, x, y, wrt="params", platforms="cpu", has_aux=True), None),
        ("rng", vs.export_stages(dropout_loss, *dropout_specs(dropout_params()), wrt="params", platforms="cpu"), 3),
    ]:
        key = None if rng is None else jax.random.key(rng)
        tr = P.Trainer(stages, dropout_params(), optimizer=optax.adam(1e-2), microbatches=4, rng=key)
        steps = [jax.tree_util.tree_leaves(tr.step(b)) for b in dropout_batches(2)]
        evaluated = tr.evaluate(dropout_batches(1)[0], outputs=True)
        assert len(steps[0]) == (1 if rng else 4)  # the loss, and the aux's 3 leaves
        for run in runs:
            np.testing.assert_allclose(run[f"{name}-steps"], steps, rtol=1e-6, err_msg=name)
            np.testing.assert_allclose(run[f"{name}-eval"], jax.tree_util.tree_leaves(evaluated[:-1]), rtol=1e-6)
            np.testing.assert_allclose(run[f"{name}-outputs"], [o[0] for o in evaluated[-1]], rtol=1e-6, atol=1e-7)
            np.testing.assert_array_equal(run[f"{name}-steps"], runs[0][f"{name}-steps"])


def _check_continued(out: Path) -> None:
    """The checkpoint 4 processes wrote after STEPS + 1 steps, restored on 2 (Trainer.restore; fit resuming from
    its checkpoint_dir, which then writes it again after STEPS + 3) goes on as an uninterrupted run does."""
    ref_losses, ref_params = _reference(CLIP, STEPS + 3)
    for p in range(2):
        for name in ("restored", "resumed"):
            run = np.load(out / f"{p}-{name}.npz")
            np.testing.assert_allclose(run["losses"], ref_losses[STEPS + 1 :], rtol=1e-6, err_msg=name)
            for k, v in ref_params.items():
                np.testing.assert_allclose(run[k], v, rtol=1e-5, atol=1e-6, err_msg=f"{name} {k}")
    params, _, step = P.load_checkpoint(out / "ck", optimizer=optax.adamw(1e-2))  # written by 2 processes
    assert step == STEPS + 3
    got = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    for k, v in ref_params.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


def _check_lost(out: Path) -> None:
    """Process 1 exited before step STEPS + 3: process 0's step ended with one error naming it, its stages and
    the step, well within its step_timeout (60 s) + 10 s; the launcher then exited with process 1's code."""
    lost = json.loads((out / "0-lost.json").read_text())
    assert lost["error"].startswith(f"process 1 (stages [2, 3]) was lost at step {STEPS + 3} (its heartbeat stopped)")
    assert "restart the job" in lost["error"]
    assert lost["seconds"] < 60 + 10


@pytest.mark.filterwarnings("ignore:4 workers need 4 devices")  # one CPU device here: the stages take turns
def test_a_checkpoint_four_processes_wrote_goes_on_in_one_process(four):
    """The checkpoint 4 processes wrote (save) restores in-process and goes on equal to an uninterrupted run."""
    if four is None:
        return
    ref_losses, ref_params = _reference(CLIP, STEPS + 3)
    stages = vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")
    tr = P.Trainer.restore(four / "saved", stages, optimizer=optax.adamw(1e-2))
    assert tr.step_count == STEPS + 1 and tr.clip_global_norm == CLIP
    np.testing.assert_allclose(
        tr.fit(lambda k: gpt_batch(8, seed=10 + k), STEPS + 3), ref_losses[STEPS + 1 :], rtol=1e-6
    )
    got = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(tr.params())[0]}
    for k, v in ref_params.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    params, _, step = P.load_checkpoint(four / "ck", optimizer=optax.adamw(1e-2))  # fit's, the same state
    assert step == STEPS + 1


_ON_RAY = """
import sys
import jax, numpy as np, optax, ray
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs
import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P

saved, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
stages = vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")
with P.Trainer.restore(saved, stages, optimizer=optax.adamw(1e-2), runner="ray") as tr:
    assert tr.step_count == steps - 2, tr.step_count
    losses = tr.fit(lambda k: gpt_batch(8, seed=10 + k), steps)
    flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(tr.params())[0]}
np.savez(out, losses=np.asarray(losses), **flat)
ray.shutdown()
"""


def test_a_checkpoint_four_processes_wrote_goes_on_on_ray(four, tmp_path):
    """The checkpoint 4 processes wrote (save) restores on Ray (4 actors, in a process of its own, as the Ray
    suite runs) and goes on equal to an uninterrupted run."""
    if four is None:
        return
    out = tmp_path / "ray.npz"
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _ON_RAY, str(four / "saved"), str(out), str(STEPS + 3)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    ref_losses, ref_params = _reference(CLIP, STEPS + 3)
    run = np.load(out)
    np.testing.assert_allclose(run["losses"], ref_losses[STEPS + 1 :], rtol=1e-6)
    for k, v in ref_params.items():
        np.testing.assert_allclose(run[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


def test_the_multi_host_page_runs_on_two_processes_as_written(tmp_path):
    """docs/howto/multi-host.md's script, started as its bash block says (2 processes, one CPU device each): both
    processes print the same losses, equal to the same steps in one process; where this jax cannot move arrays
    between processes, every process stops at the refusal."""
    page = (ROOT / "docs" / "howto" / "multi-host.md").read_text()
    code = re.findall(r"^```python\n(.*?)^```$", page, flags=re.M | re.S)[0]
    (command,) = re.findall(r"^```bash\n(.*?)\n```$", page, flags=re.M | re.S)
    (tmp_path / "train.py").write_text(code)
    assert command.startswith("python -m ")
    cmd = [sys.executable, *command.split()[1:], "--grace", "60"]
    done = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=400)
    if not _ran(done):
        return
    # Each line as its own match: two processes' prints can meet on one line (print writes the text, then "\n").
    said = dict(re.findall(r"process (\d): stages on .*?, losses (\[[^\]]*\])", done.stdout))
    assert sorted(said) == ["0", "1"], done.stdout
    assert said["0"] == said["1"]
    scope: dict = {}
    exec(compile(code.replace("launch.initialize()", "").split("tr = P.Trainer")[0], "train.py", "exec"), scope)
    tx, p = optax.adam(1e-2), scope["params"]
    state = tx.init(p)
    for got, batch in zip(json.loads(said["0"]), scope["batches"]):
        want, grads = jax.value_and_grad(scope["loss"])(p, *batch)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        updates, state = tx.update(grads, state, p)
        p = optax.apply_updates(p, updates)


def test_four_processes_one_stage_each_train_as_one_process(four):
    """PP 4 on 4 processes, one device each: every activation and cotangent crosses processes."""
    if four is None:
        return
    (run,) = _check_equal_one_process(four, 4, ["gpipe"], CLIP)
    assert run["placement"].tolist() == [[0], [1], [2], [3]]


def test_process_zero_writes_the_checkpoint_and_every_process_hears_how_it_went(four):
    """Process 0 writes (the others' write takes no time), every process returns once it is written, and a
    directory process 0 finds taken is every process's error, naming process 0 and the file."""
    if four is None:
        return
    for p in range(4):
        said = json.loads((four / f"{p}-write.json").read_text())
        assert said["written"]
        assert (said["writes"][0] > 0) == (p == 0), said["writes"]
        assert said["bad"].startswith("the checkpoint was not written (process 0: "), said["bad"]
        assert "exists and is not a vjpsplit checkpoint (it holds 'notes.txt')" in said["bad"]


def test_the_launcher_ends_the_others_once_one_fails(tmp_path):
    """One process exits 3 while the other would sleep for 10 minutes: the launcher kills it --grace seconds later
    and exits 3."""
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys, time\nif os.environ['JAX_PROCESS_ID'] == '1':\n    sys.exit(3)\ntime.sleep(600)\n"
    )
    t0 = time.monotonic()
    assert launch.main(["-n", "2", "--grace", "1", str(script)]) == 3
    assert time.monotonic() - t0 < 600  # the launcher waits for every process: it returned, so the sleeper was killed


def test_the_launchers_device_count_comes_first_in_xla_flags():
    """XLA reads no flag after a token that is not one, so --devices goes first (and replaces a count given)."""
    base = {"XLA_FLAGS": "intra_op_parallelism_threads=1 --xla_force_host_platform_device_count=8"}
    envs = launch.environments(2, devices=3, base=base)
    for i, env in enumerate(envs):
        assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=3 intra_op_parallelism_threads=1"
        assert env["JAX_PROCESS_ID"] == str(i) and env["JAX_NUM_PROCESSES"] == "2"


def test_distributed_before_jax_distributed_initialize_is_one_clear_error():
    assert not jax.distributed.is_initialized()
    with pytest.raises(VjpsplitError, match=r"call jax.distributed.initialize\(\) first, in every process"):
        P.Distributed()
    with pytest.raises(VjpsplitError, match=r"call jax.distributed.initialize\(\) first"):
        P.Trainer([], [], optimizer=optax.sgd(0.1), microbatches=2, runner="distributed")
    with pytest.raises(VjpsplitError, match=r"call jax.distributed.initialize\(\) first"):
        P.Distributed(data_parallel=2)
    with pytest.raises(VjpsplitError, match=r"data_parallel=0: give the number of replicas of every stage"):
        P.Distributed(data_parallel=0)
