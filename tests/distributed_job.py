"""One process of a jax.distributed job the tests start (``python -m vjpsplit_cli.pipeline.launch -n N``): the
GPT of ``stage_models`` (4 stages, a tied embedding) trained on ``runner=P.Distributed()`` once per schedule
asked, its losses and params written to ``<out>/<process id>-<schedule>.npz``; and the messages of
``Distributed``'s refusals, to ``<out>/<process id>-refusals.json`` and ``-fit.txt``.

Arguments: ``out schedules clip steps`` (``schedules`` comma-separated; ``clip`` 0: none)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from vjpsplit_cli.pipeline import launch  # noqa: E402

launch.initialize(timeout=120)
if os.environ.get("DEBUG_DUMP"):
    import faulthandler

    faulthandler.dump_traceback_later(int(os.environ["DEBUG_DUMP"]), exit=True)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs  # noqa: E402

import vjpsplit_cli as vs  # noqa: E402
from vjpsplit_cli import pipeline as P  # noqa: E402
from vjpsplit_cli.errors import VjpsplitError  # noqa: E402


def refusals() -> dict[str, str]:
    """What ``Distributed`` says of devices that are not one device of the job per stage."""
    out = {}
    for name, devices in {"two devices": [jax.devices()[:2]], "a string": [["cpu:0"]]}.items():
        try:
            P.Distributed(devices=devices)
            out[name] = "accepted"
        except VjpsplitError as e:
            out[name] = str(e)
    return out


def main() -> None:
    out, schedules, clip, steps = sys.argv[1], sys.argv[2].split(","), float(sys.argv[3]), int(sys.argv[4])
    me = jax.process_index()
    with open(os.path.join(out, f"{me}-refusals.json"), "w") as f:
        json.dump(refusals(), f)
    stages = vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")
    for schedule in schedules:
        tr = P.Trainer(
            stages,
            gpt_params(),
            optimizer=optax.adamw(1e-2),
            schedule=schedule,
            microbatches=4,
            clip_global_norm=clip or None,
            runner="distributed",
            observe=P.Observe(step_timeout=150),
        )
        losses = [tr.step(gpt_batch(8, seed=10 + i)) for i in range(steps)]
        try:
            tr.fit([gpt_batch(8)], steps + 1, max_restarts=1)
            said = "accepted"
        except VjpsplitError as e:
            said = str(e)
        with open(os.path.join(out, f"{me}-fit.txt"), "w") as f:
            f.write(said)
        leaves = jax.tree_util.tree_flatten_with_path(tr.params())[0]
        flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}
        placement = np.asarray([d.process_index for (d,) in tr.placement])
        norms = np.asarray([h.grad_norm for h in tr.history])
        path = os.path.join(out, f"{me}-{schedule}.npz")
        np.savez(path, losses=np.asarray(losses), placement=placement, norms=norms, **flat)


main()
