"""One process of a jax.distributed job the tests start (``python -m vjpsplit_cli.pipeline.launch -n N``): the
GPT of ``stage_models`` (4 stages, a tied embedding) trained on ``runner=P.Distributed()`` once per schedule
asked, its losses and params written to ``<out>/<process id>-<schedule>.npz``; and the messages of
``Distributed``'s refusals, to ``<out>/<process id>-refusals.json`` and ``-fit.txt``. Then the phases asked:

* ``write``: the last schedule's Trainer goes on to step ``steps + 1`` under ``fit(checkpoint_dir=<out>/ck)``, and
  saves to ``<out>/saved`` too (the checkpoint after ``steps + 1`` steps, written by this job); then saves to
  ``<out>/bad``, which process 0 first fills with a file of its own: what each process's save said, its
  ``checkpoint_times``' write seconds and whether both checkpoints were there on return, to
  ``<out>/<process id>-write.json``.
* ``resume``: ``Trainer.restore(<out>/saved)`` and a new Trainer under ``fit(checkpoint_dir=<out>/ck)`` (which
  begins at its checkpoint) each go on to step ``steps + 3``: their losses and params to
  ``<out>/<process id>-restored.npz`` and ``-resumed.npz``; fit writes ``<out>/ck`` again.
* ``replicas``: PP 2 x DP 2 (``runner=P.Distributed(data_parallel=2)``, each stage's two replicas on two devices
  of one process; ZB-H1's given by ``devices=``, each process's two the other way round) on
  ``stage_models.tied`` (a tied embedding), once per schedule asked, ``steps`` steps of
  ``tied_batches(steps, rows=16)``: its losses, params, placement (by process, and device ids) and norms to
  ``<out>/<process id>-dp-<schedule>.npz``, the optimizer bytes on each of this process's devices to
  ``-dp-memory.json``; the last Trainer saves to ``<out>/dp-saved`` and evaluates the first batch (its loss and
  outputs to ``-dp-eval.npz``); the refusals of a stage's replicas on two
  processes, of two devices per stage without data_parallel=2, and of replicas that fit no process, to
  ``-dp-refusals.json``.
* ``timed``: the GPT under ``Observe(timeline=True, trace_dir=<out>/trace-<process id>)`` (every step timed; 1F1B,
  ``clip``), ``steps + 1`` steps, then ``evaluate`` of ``batch(20)`` (with ``outputs=True``): the losses, each step's
  stragglers and busy seconds, the last step's events (stage, kind, mb) and phase names, the evaluation's loss and
  outputs to ``<out>/<process id>-timed.npz`` (and ``.json``); then ``stage_models.mlp`` cut in 4 (stages 1 and 2
  cost the same: peers, one in each process), ``steps + 1`` timed steps: its losses and every step's stragglers
  to the ``.json``, with its ``costs()``, and the losses, choice, races and last plans of a Trainer of
  ``schedule=P.Schedule("auto", trial_rounds=1)`` over ``AUTO_STEPS`` untimed steps of the MLP.
* ``aux``: two 2-stage Trainers, stage 0 in process 0 and stage 1 in process 1 (``devices=``), 2 steps of
  ``dropout_batches(2)`` then ``evaluate`` of the first (with ``outputs=True``): ``stage_models.aux_loss``
  (``has_aux=True``) and ``stage_models.dropout_loss`` with ``rng=jax.random.key(3)``; their losses, aux leaves and
  evaluations to ``<out>/<process id>-aux.npz``.
* ``kill``: the resumed Trainer steps on; process 1 exits (``os._exit(1)``) before that step, the others write the
  error their step raised, and how long it took, to ``<out>/<process id>-lost.json``, then raise it.

Arguments: ``out schedules clip steps [phases]`` (``schedules`` and ``phases`` comma-separated; ``clip`` 0: none).
Batch ``k`` of a run is ``gpt_batch(8, seed=10 + k)``."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(__file__))

from vjpsplit_cli.pipeline import launch  # noqa: E402

launch.initialize(timeout=120)
if os.environ.get("DEBUG_DUMP"):
    import faulthandler

    faulthandler.dump_traceback_later(int(os.environ["DEBUG_DUMP"]), exit=True)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from stage_models import (  # noqa: E402
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

import vjpsplit_cli as vs  # noqa: E402
from vjpsplit_cli import pipeline as P  # noqa: E402
from vjpsplit_cli.errors import VjpsplitError  # noqa: E402

AUTO_STEPS = 8  # the timed phase's schedule="auto" Trainer: 2 measuring steps, then a race of 1 round a candidate


def refusals() -> dict[str, str]:
    """What ``Distributed`` says of devices that are not one device of the job per stage."""
    out = {}
    for name, devices in {"two devices": [jax.devices()[:2]], "a string": [["cpu:0"]]}.items():
        out[name] = said(lambda: P.Distributed(devices=devices, data_parallel=1))
    return out


def said(make: Callable[[], object]) -> str:
    """The message of the ``VjpsplitError`` ``make()`` raised, or ``"accepted"``."""
    try:
        make()
        return "accepted"
    except VjpsplitError as e:
        return str(e)


def batch(k: int) -> tuple[np.ndarray, ...]:
    return gpt_batch(8, seed=10 + k)


def record(path: str, tr: P.Trainer, losses: list[float]) -> None:
    """``losses``, ``tr``'s params, placement and gradient norms to ``path`` (an npz)."""
    leaves = jax.tree_util.tree_flatten_with_path(tr.params())[0]
    flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}
    placement = np.asarray([[d.process_index for d in g] for g in tr.placement])
    ids = np.asarray([[d.id for d in g] for g in tr.placement])
    norms = np.asarray([h.grad_norm for h in tr.history])
    np.savez(path, losses=np.asarray(losses), placement=placement, ids=ids, norms=norms, **flat)


def replicas(out: str, me: int, schedules: list[str], clip: float, steps: int) -> None:
    """The ``replicas`` phase (the module docstring)."""
    stages = vs.export_stages(tied, *tied_specs(), wrt="params", platforms="cpu")
    tx, batches = optax.adamw(1e-2), tied_batches(steps, rows=16)
    every = jax.devices()
    given = [[every[1], every[0]], [every[3], every[2]]]  # ZB-H1's: each process's two devices, the other way round
    for schedule in schedules:
        tr = P.Trainer(
            stages,
            tied_params(),
            optimizer=tx,
            schedule=schedule,
            microbatches=2,
            clip_global_norm=clip or None,
            runner=P.Distributed(data_parallel=2, devices=given if schedule == "zbh1" else None),
            observe=P.Observe(step_timeout=150),
        )
        losses = [tr.step(b) for b in batches]
        record(os.path.join(out, f"{me}-dp-{schedule}.npz"), tr, losses)
    tr.save(os.path.join(out, "dp-saved"))
    loss, outputs = tr.evaluate(batches[0], outputs=True)  # each replica its part, as the step's F
    np.savez(os.path.join(out, f"{me}-dp-eval.npz"), loss=loss, **{f"out{m}": o[0] for m, o in enumerate(outputs)})
    with open(os.path.join(out, f"{me}-dp-memory.json"), "w") as f:
        json.dump([[m.device.id, list(m.stages), m.optimizer] for m in tr.memory()], f)
    apart = [[every[1], every[2]], [every[0], every[3]]]  # stage 0's replicas on processes 0 and 1
    refused = {
        "apart": said(lambda: P.Distributed(devices=apart, data_parallel=2)),
        "count": said(
            lambda: P.Trainer(stages, tied_params(), optimizer=tx, microbatches=2, runner=P.Distributed(devices=given))
        ),
        "too few": said(
            lambda: P.Trainer(
                stages, tied_params(), optimizer=tx, microbatches=2, runner=P.Distributed(data_parallel=4)
            )
        ),
    }
    with open(os.path.join(out, f"{me}-dp-refusals.json"), "w") as f:
        json.dump(refused, f)


def timed(out: str, me: int, clip: float, steps: int) -> None:
    """The ``timed`` phase (the module docstring)."""
    stages = vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")
    watch = P.Observe(step_timeout=150, timeline=True, trace_dir=os.path.join(out, f"trace-{me}"))
    tr = P.Trainer(
        stages,
        gpt_params(),
        optimizer=optax.adamw(1e-2),
        microbatches=4,
        clip_global_norm=clip or None,
        runner="distributed",
        observe=watch,
    )
    losses = [tr.step(batch(i)) for i in range(steps + 1)]
    r = tr.last_result
    loss, outputs = tr.evaluate(batch(20), outputs=True)
    np.savez(
        os.path.join(out, f"{me}-timed.npz"),
        losses=np.asarray(losses),
        events=np.asarray([[e.stage, "FBIW".index(str(e.kind)), e.mb] for e in r.events]),
        busy=np.asarray([h.busy for h in tr.history]),
        eval=np.asarray([tr.evaluate(batch(20)), loss]),
        **{f"out{m}_{i}": np.asarray(a) for m, o in enumerate(outputs) for i, a in enumerate(o)},
    )
    # The MLP's balanced cut gives stages 1 and 2, one in each process, the same cost signature: peers.
    params = mlp_params()
    x, labels = np.ones((8, 16), np.float32), np.arange(8, dtype=np.int32) % 4
    stages = vs.export_stages(mlp, *specs_like((params, x[:2], labels[:2])), wrt="params", stages=4, platforms="cpu")
    peers = P.Trainer(stages, params, optimizer=optax.sgd(0.1), microbatches=4, runner="distributed", observe=watch)
    mlp_losses = [peers.step((x, labels)) for _ in range(steps + 1)]
    schedule = P.Schedule("auto", trial_rounds=1)
    auto_tr = P.Trainer(
        stages, params, optimizer=optax.sgd(0.1), microbatches=4, schedule=schedule, runner="distributed"
    )
    auto_losses = [auto_tr.step((x, labels)) for _ in range(AUTO_STEPS)]
    auto = {
        "losses": auto_losses,
        "choice": auto_tr.auto.choice,
        "races": auto_tr.auto.races,
        "racing": auto_tr.auto.trial is not None,
        "ran": [[str(op) for op in ops] for ops in auto_tr.last_result.plans],
    }
    said_here = {
        "phases": [p.name for p in r.phases],
        "stragglers": [list(h.stragglers) for h in [*tr.history, *peers.history]],
        "mlp": mlp_losses,
        "auto": auto,
        "costs": peers.costs(),
    }
    with open(os.path.join(out, f"{me}-timed.json"), "w") as f:
        json.dump(said_here, f)


def aux(out: str, me: int) -> None:
    """The ``aux`` phase (the module docstring)."""
    p, _, x, y = dropout_specs(dropout_params())
    devices = [[jax.devices()[0]], [jax.devices()[2]]]
    got: dict[str, np.ndarray] = {}
    for name, stages, rng in [
        ("aux", vs.export_stages(aux_loss, p, x, y, wrt="params", platforms="cpu", has_aux=True), None),
        ("rng", vs.export_stages(dropout_loss, *dropout_specs(dropout_params()), wrt="params", platforms="cpu"), 3),
    ]:
        tr = P.Trainer(
            stages,
            dropout_params(),
            optimizer=optax.adam(1e-2),
            microbatches=4,
            rng=None if rng is None else jax.random.key(rng),
            runner=P.Distributed(devices=devices),
            observe=P.Observe(step_timeout=150),
        )
        steps = [tr.step(b) for b in dropout_batches(2)]
        evaluated = tr.evaluate(dropout_batches(1)[0], outputs=True)
        got[f"{name}-steps"] = np.asarray([jax.tree_util.tree_leaves(s) for s in steps], np.float64)
        got[f"{name}-eval"] = np.asarray(jax.tree_util.tree_leaves(evaluated[:-1]), np.float64)
        got[f"{name}-outputs"] = np.stack([np.asarray(o[0]) for o in evaluated[-1]])
    np.savez(os.path.join(out, f"{me}-aux.npz"), **got)


def main() -> None:
    out, schedules, clip, steps = sys.argv[1], sys.argv[2].split(","), float(sys.argv[3]), int(sys.argv[4])
    phases = sys.argv[5].split(",") if len(sys.argv) > 5 else []
    me = jax.process_index()
    with open(os.path.join(out, f"{me}-refusals.json"), "w") as f:
        json.dump(refusals(), f)
    stages = vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")
    tx = optax.adamw(1e-2)
    for schedule in schedules:
        tr = P.Trainer(
            stages,
            gpt_params(),
            optimizer=tx,
            schedule=schedule,
            microbatches=4,
            clip_global_norm=clip or None,
            runner="distributed",
            observe=P.Observe(step_timeout=150),
        )
        losses = [tr.step(batch(i)) for i in range(steps)]
        try:
            tr.fit([gpt_batch(8)], steps + 1, max_restarts=1)
            said = "accepted"
        except VjpsplitError as e:
            said = str(e)
        with open(os.path.join(out, f"{me}-fit.txt"), "w") as f:
            f.write(said)
        record(os.path.join(out, f"{me}-{schedule}.npz"), tr, losses)
    ck, saved = os.path.join(out, "ck"), os.path.join(out, "saved")
    if "write" in phases:
        tr.fit(batch, steps + 1, checkpoint_dir=ck)
        tr.save(saved)
        bad = os.path.join(out, "bad")
        if me == 0:  # a directory only process 0 finds taken: its refusal is every process's error
            os.makedirs(bad)
            with open(os.path.join(bad, "notes.txt"), "w") as f:
                f.write("mine")
        try:
            tr.save(bad)
            said = "written"
        except VjpsplitError as e:
            said = str(e)
        with open(os.path.join(out, f"{me}-write.json"), "w") as f:
            writes = [t.write for t in tr.checkpoint_times]
            json.dump({"bad": said, "writes": writes, "written": os.path.isdir(ck) and os.path.isdir(saved)}, f)
    if "resume" in phases:
        watch = P.Observe(step_timeout=60)
        restored = P.Trainer.restore(saved, stages, optimizer=tx, runner="distributed", observe=watch)
        record(os.path.join(out, f"{me}-restored.npz"), restored, restored.fit(batch, steps + 3))
        tr = P.Trainer(
            stages,
            gpt_params(),
            optimizer=tx,
            microbatches=4,
            clip_global_norm=clip or None,
            runner="distributed",
            observe=watch,
        )
        record(os.path.join(out, f"{me}-resumed.npz"), tr, tr.fit(batch, steps + 3, checkpoint_dir=ck))
    if "replicas" in phases:
        replicas(out, me, schedules, clip, steps)
    if "timed" in phases:
        timed(out, me, clip, steps)
    if "aux" in phases:
        aux(out, me)
    if "kill" in phases:
        if me == 1:
            # Not before process 0 has its results: their gathers read from this process while it lives.
            deadline = time.monotonic() + 120
            written = {"resume": "0-resumed.npz", "replicas": "0-dp-refusals.json", "timed": "0-timed.json"}
            last = [f for p, f in {**written, "aux": "0-aux.npz"}.items() if p in phases][-1]
            while "resume" in phases and not os.path.exists(os.path.join(out, last)):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            time.sleep(1.0)
            os._exit(1)
        t0 = time.monotonic()
        try:
            tr.step(batch(tr.step_count))
        except VjpsplitError as e:
            with open(os.path.join(out, f"{me}-lost.json"), "w") as f:
                json.dump({"error": str(e), "seconds": time.monotonic() - t0}, f)
            raise


main()
