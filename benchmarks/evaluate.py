"""What evaluation holds against a training forward: live JAX array bytes on the stages' device, in-process.

    python -m benchmarks.evaluate [--quick]

The model: ``benchmarks/gpt.py``'s GPT (tied embedding, width 256, 4 blocks,
sequence 64) on windows of the docs, batch 16 in 8 microbatches, cut into 2
stages, AdamW, one Trainer in this process (both stages on the one CPU device).
After a step (everything compiled), the baseline is the bytes of every live
JAX array (``jax.live_arrays()``: parameters, optimizer state). Then, each
measured as the most bytes above that baseline after any one stage call
(waited for):

* a training forward: every microbatch's F on every stage through the stages'
  workers (GPipe's forward half: the residuals of all microbatches held until
  their backward), and one microbatch's F on every stage;
* ``trainer.evaluate(batch)``: the same microbatches through the evaluation
  programs.

It also counts the residual arrays the workers hold after each (F keeps them in
``StageWorker.res``; evaluation keeps none) and checks that the evaluation loss
equals the loss function in one process.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import numpy as np


def live_bytes() -> int:
    """The bytes of every live JAX array in this process."""
    return sum(a.nbytes for a in jax.live_arrays())


def measure(quick: bool) -> dict:
    """The figures of the module docstring, as a dict."""
    import optax

    from benchmarks.gpt import GPT, docs_batches
    from vjpsplit_cli import pipeline as P
    from vjpsplit_cli.pipeline.runtime.model import side_for
    from vjpsplit_cli.pipeline.stages.evalprograms import EvalProgram

    c = (
        {"width": 32, "blocks": 2, "seq": 16, "batch": 8, "microbatches": 4}
        if quick
        else {"width": 256, "blocks": 4, "seq": 64, "batch": 16, "microbatches": 8}
    )
    model = GPT(width=c["width"], blocks=c["blocks"], seq=c["seq"], heads=4, stages=2)
    vocab, batches = docs_batches(c["seq"], c["batch"], 2)
    params = model.init(vocab)
    stages = model.export(params)
    M = c["microbatches"]
    tr = P.Trainer(stages, params, optimizer=optax.adamw(1e-3), microbatches=M, schedule="gpipe")
    tr.step(batches[0])
    tr.evaluate(batches[1])  # compiles the evaluation calls
    workers = [t.worker for t in tr.backend.trainers]
    S = len(workers)
    mbs = tr.model.batch_microbatches(batches[1], M)
    jax.block_until_ready([t.params for t in tr.backend.trainers])
    base = live_bytes()

    def forward(count: int) -> tuple[int, int, int]:
        peak = 0
        for m, (x, side) in enumerate(mbs[:count]):
            for s, w in enumerate(workers):
                x = jax.block_until_ready(w.forward(m, x, side_for(side, s, S)))
                peak = max(peak, live_bytes() - base)
        arrays = [r for w in workers for res in w.res.values() for r in jax.tree_util.tree_leaves(res)]
        held = sum(len(w.res) for w in workers)
        for w in workers:
            w.reset()
        return peak, held, len(arrays)

    train_all, held_all, arrays_all = forward(M)
    train_one, _, arrays_one = forward(1)
    peak = [0]
    run = EvalProgram.run

    def sampled(self, *leaves):
        out = jax.block_until_ready(run(self, *leaves))
        peak[0] = max(peak[0], live_bytes() - base)
        return out

    EvalProgram.run = sampled  # type: ignore[method-assign]
    try:
        loss = tr.evaluate(batches[1])
    finally:
        EvalProgram.run = run  # type: ignore[method-assign]
    ref = float(model.loss(tr.params(), *batches[1]))
    tr.close()
    return {
        "config": c,
        "baseline_bytes": base,
        "training_forward_all_microbatches_bytes": train_all,
        "training_forward_residual_sets_held": held_all,
        "training_forward_residual_arrays": arrays_all,
        "training_forward_one_microbatch_bytes": train_one,
        "one_microbatch_residual_arrays": arrays_one,
        "evaluation_bytes": peak[0],
        "evaluation_residual_sets_held": sum(len(w.res) for w in workers),
        "evaluation_loss": loss,
        "one_process_loss": ref,
        "relative_difference": abs(loss - ref) / abs(ref),
        "load": os.getloadavg(),
    }


def main() -> None:
    """Print the measurement as JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny GPT (a smoke run)")
    args = ap.parse_args()
    print(json.dumps(measure(args.quick), indent=1, default=lambda v: np.asarray(v).tolist()))


if __name__ == "__main__":
    main()
