"""Train a small character-level GPT over 4 pipeline stages, beside the same model trained in one process.

    python samples/pipeline/train_gpt.py [--steps 200] [--runner inprocess|ray] [--schedule 1f1b] [--out DIR]

The text is this repository's own documentation (``docs/*.md``). The model is
written once: a token embedding that is tied (stage 0 embeds with it, stage 3
reads it again for the logits), two attention + MLP blocks, ``stage_boundary``
marks between. ``export_stages`` cuts it; ``pipeline.Trainer`` trains the stages
(every stage's AdamW update where its parameters live); the reference trains
the same parameters with ``jit(value_and_grad)`` and optax on the same batches.
Prints the first and last losses (the first near ln(vocab), a uniform guess), the two loss
curves' largest relative difference, and writes ``loss.png``; the last step is timed and traced
(``step-<n>.trace.json``: open it in ui.perfetto.dev or chrome://tracing), and ``timeline.png``
is that step drawn from the trace file.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import export as jexport

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.pipeline.schedules.plots import plot_loss

ROOT = Path(__file__).resolve().parents[2]
WIDTH, SEQ, HEADS, BATCH, MICROBATCHES = 32, 32, 4, 16, 4


def corpus() -> tuple[np.ndarray, int]:
    """The docs as one array of character ids, and the vocabulary size."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    chars = sorted(set(text))
    ids = {c: i for i, c in enumerate(chars)}
    return np.array([ids[c] for c in text], np.int32), len(chars)


def rms(h):
    return h / jnp.sqrt(jnp.mean(h**2, -1, keepdims=True) + 1e-6)


def block(p, h):
    """Causal self-attention then an MLP, pre-norm, residual."""
    x = rms(h)
    q, k, v = (jnp.einsum("btd,dhe->bthe", x, p[n]) for n in ("q", "k", "v"))
    scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
    att = jax.nn.softmax(jnp.where(causal[None, None], scores, -1e9), -1)
    h = h + jnp.einsum("bhqk,bkhe,hed->bqd", att, v, p["o"])
    return h + jax.nn.gelu(rms(h) @ p["up"]) @ p["down"]


def loss(params, tokens, labels):
    """The whole GPT: embed | block 0 | block 1 | tied logits and the mean cross-entropy."""
    h = jnp.take(params["embed"], tokens, axis=0) + params["pos"]
    h = vs.stage_boundary(h)
    h = vs.stage_boundary(block(params["blocks"][0], h))
    h = vs.stage_boundary(block(params["blocks"][1], h))
    logits = rms(h) @ params["embed"].T  # the tied embedding again
    lp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(lp, labels[..., None], -1))


def init(vocab: int, seed: int = 0):
    """The parameters: the tied token embedding, the positions and the two blocks."""
    rng = np.random.default_rng(seed)

    def n(*shape, scale):
        return (rng.normal(size=shape) * scale).astype(np.float32)

    e = WIDTH // HEADS
    blocks = [
        {
            **{k: n(WIDTH, HEADS, e, scale=WIDTH**-0.5) for k in ("q", "k", "v")},
            "o": n(HEADS, e, WIDTH, scale=WIDTH**-0.5 / 2),
            "up": n(WIDTH, 4 * WIDTH, scale=WIDTH**-0.5),
            "down": n(4 * WIDTH, WIDTH, scale=(4 * WIDTH) ** -0.5 / 2),
        }
        for _ in range(2)
    ]
    # GPT-2's embedding scales: the tied logits start near 0, so the first loss is near ln(vocab),
    # a uniform guess. At 0.5 the logit of each input character itself was large: 10.4 at first.
    return {"embed": n(vocab, WIDTH, scale=0.02), "pos": n(SEQ, WIDTH, scale=0.01), "blocks": blocks}


def batches(ids: np.ndarray, steps: int, seed: int = 1):
    """``steps`` batches of (tokens, next tokens), windows drawn at random from the text."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, len(ids) - SEQ - 1, BATCH)
        win = np.stack([ids[s : s + SEQ + 1] for s in starts])
        yield win[:, :-1], win[:, 1:]


def single_process(params, tx, data) -> list[float]:
    """The reference: ``jit(value_and_grad)`` and the optax update in one process."""
    state, out = tx.init(params), []

    @jax.jit
    def step(p, s, tokens, labels):
        value, g = jax.value_and_grad(loss)(p, tokens, labels)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    for tokens, labels in data:
        params, state, value = step(params, state, tokens, labels)
        out.append(float(value))
    return out


def train(steps: int, runner: str = "inprocess", schedule: str = "1f1b", out: Path | None = None) -> dict:
    """Both runs; returns their loss curves and the largest relative difference."""
    ids, vocab = corpus()
    params = init(vocab)
    (b,) = jexport.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct
    stages = vs.export_stages(
        loss,
        jax.tree_util.tree_map(lambda a: spec(a.shape, a.dtype), params),
        spec((b, SEQ), jnp.int32),
        spec((b, SEQ), jnp.int32),
        wrt="params",
        platforms="cpu",
    )
    tx = optax.adamw(3e-3)
    data = list(batches(ids, steps))
    t0 = time.monotonic()
    reference = single_process(params, tx, data)
    t_ref = time.monotonic() - t0
    t0 = time.monotonic()
    traced = P.Observe(trace_dir=out, trace_every=steps) if out is not None else None  # the last step: timed, traced
    with P.Trainer(
        stages, params, optimizer=tx, schedule=schedule, microbatches=MICROBATCHES, runner=runner, observe=traced
    ) as tr:
        piped = [tr.step(batch) for batch in data]
        if out is not None:
            P.plot_timeline(
                out / f"step-{steps}.trace.json",
                None,
                out / "timeline.png",
                f"step {steps} ({schedule}, {runner}), from its trace file",
            )
            out.mkdir(parents=True, exist_ok=True)
            plot_loss(
                {f"pipeline ({schedule}, {runner})": piped, "one process": reference},
                out / "loss.png",
                f"char GPT on docs/*.md, 4 stages, {steps} steps",
            )
    t_pipe = time.monotonic() - t0
    rel = float(np.max(np.abs(np.array(piped) - reference) / np.abs(reference)))
    return {"pipeline": piped, "reference": reference, "max_rel_diff": rel, "times": (t_pipe, t_ref), "vocab": vocab}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps to train (default 200)")
    ap.add_argument(
        "--runner", choices=["inprocess", "ray"], default="inprocess", help="threads in this process, or Ray actors"
    )
    ap.add_argument("--schedule", default="1f1b", help="the schedule name (gpipe, 1f1b, zbh1, zbv, ...; default 1f1b)")
    ap.add_argument("--out", type=Path, default=None, help="where loss.png goes (default: a temp directory)")
    a = ap.parse_args(argv)
    out = a.out or Path(tempfile.mkdtemp(prefix="train_gpt."))
    r = train(a.steps, a.runner, a.schedule, out)
    p, ref = r["pipeline"], r["reference"]
    print(f"loss: step 1 {p[0]:.4f} -> step {len(p)} {p[-1]:.4f} (one process: {ref[0]:.4f} -> {ref[-1]:.4f})")
    print(f"a uniform guess over the {r['vocab']} characters scores ln({r['vocab']}) = {np.log(r['vocab']):.4f}")
    print(f"largest relative difference of the two loss curves: {r['max_rel_diff']:.2e}")
    print(f"time: pipeline {r['times'][0]:.1f} s (incl. export and compile), one process {r['times'][1]:.1f} s")
    print(
        f"loss plot: {out / 'loss.png'}; the last step's trace: {out / f'step-{a.steps}.trace.json'} ({out / 'timeline.png'})"
    )
    return 0 if r["max_rel_diff"] < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
