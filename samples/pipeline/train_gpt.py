"""Train a small character-level GPT over 4 pipeline stages, beside the same model trained in one process.

    python samples/pipeline/train_gpt.py [--steps 200] [--runner inprocess|ray] [--schedule 1f1b] [--out DIR]

The text is this repository's own documentation (``docs/*.md``). The model is
written once: a token embedding that is tied (stage 0 embeds with it, stage 3
reads it again for the logits), two attention + MLP blocks, ``stage_boundary``
marks between. It trains as models do: with dropout (the loss takes a PRNG key;
``Trainer(rng=key)`` hands microbatch ``i`` of step ``t`` the key
``fold_in(fold_in(key, t), i)``), reporting its next-token accuracy (the loss
returns ``(loss, {"accuracy": ...})``, exported with ``has_aux=True``), on
windows of two lengths (each microbatch 4 windows of 32 or of 16 characters,
``P.Microbatches`` weighted by their token counts, so the step's loss is the mean
per token). ``export_stages`` cuts it; ``pipeline.Trainer`` trains the stages
(every stage's AdamW update where its parameters live); the reference trains
the same parameters in one process, ``jit(value_and_grad)`` per microbatch with
the same keys, their token-weighted sum and the same optax update.
Prints the first and last losses (the first near ln(vocab), a uniform guess) and accuracies,
the two runs' largest differences, and writes ``loss.png``; the last step is timed and traced
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
WIDTH, HEADS, MICROBATCHES, ROWS = 32, 4, 4, 4  # ROWS windows in each microbatch
LENGTHS = (32, 16)  # the two sequence lengths (buckets): each microbatch's windows are of one of them
SEQ = max(LENGTHS)  # the positions the model has
DROPOUT = 0.1


def corpus() -> tuple[np.ndarray, int]:
    """The docs as one array of character ids, and the vocabulary size."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    chars = sorted(set(text))
    ids = {c: i for i, c in enumerate(chars)}
    return np.array([ids[c] for c in text], np.int32), len(chars)


def rms(h):
    return h / jnp.sqrt(jnp.mean(h**2, -1, keepdims=True) + 1e-6)


def dropout(key, site: int, h):
    """Inverted dropout at rate DROPOUT, its mask drawn from the microbatch's key folded with ``site``."""
    keep = jax.random.bernoulli(jax.random.fold_in(key, site), 1 - DROPOUT, h.shape)
    return jnp.where(keep, h / (1 - DROPOUT), 0.0)


def block(p, h, key, site: int):
    """Causal self-attention then an MLP, pre-norm, residual, each output dropped out (sites ``site``, ``site + 1``)."""
    x = rms(h)
    q, k, v = (jnp.einsum("btd,dhe->bthe", x, p[n]) for n in ("q", "k", "v"))
    scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(q.shape[-1])
    t = h.shape[1]  # the microbatch's length: symbolic at export
    causal = jnp.tril(jnp.ones((t, t), bool))
    att = jax.nn.softmax(jnp.where(causal[None, None], scores, -1e9), -1)
    h = h + dropout(key, site, jnp.einsum("bhqk,bkhe,hed->bqd", att, v, p["o"]))
    return h + dropout(key, site + 1, jax.nn.gelu(rms(h) @ p["up"]) @ p["down"])


def loss(params, key, tokens, labels):
    """The whole GPT: embed | block 0 | block 1 | tied logits; the mean cross-entropy and the next-token accuracy."""
    positions = jnp.arange(tokens.shape[1])  # the microbatch's length (symbolic at export) of the SEQ positions
    h = jnp.take(params["embed"], tokens, axis=0) + jnp.take(params["pos"], positions, axis=0)
    h = vs.stage_boundary(dropout(key, 0, h))
    h = vs.stage_boundary(block(params["blocks"][0], h, key, 1))
    h = vs.stage_boundary(block(params["blocks"][1], h, key, 3))
    logits = rms(h) @ params["embed"].T  # the tied embedding again
    lp = jax.nn.log_softmax(logits)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return -jnp.mean(jnp.take_along_axis(lp, labels[..., None], -1)), {"accuracy": accuracy}


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
    """``steps`` steps of MICROBATCHES microbatches ``(tokens, next tokens)``, each ROWS windows drawn at random
    from the text, all of one length drawn from LENGTHS."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        step = []
        for length in rng.choice(LENGTHS, MICROBATCHES):
            starts = rng.integers(0, len(ids) - length - 1, ROWS)
            win = np.stack([ids[s : s + length + 1] for s in starts])
            step.append((win[:, :-1], win[:, 1:]))
        yield step


def tokens_of(step) -> list[int]:
    """Each microbatch's token count: its loss weight."""
    return [tokens.size for tokens, _ in step]


def weighted(values, weights) -> float:
    """The weights' mean of ``values``: the mean per token where they are per-microbatch means."""
    return float(np.dot(values, weights) / np.sum(weights))


def single_process(params, tx, data, key) -> tuple[list[float], list[float]]:
    """The reference in one process: per microbatch ``i`` of step ``t``, ``jit(value_and_grad)`` of its loss
    weighted by its share of the step's tokens, with the key ``fold_in(fold_in(key, t), i)``; the sum of those
    gradients; the optax update. Returns each step's loss and accuracy (token-weighted means)."""
    state, losses, accuracies = tx.init(params), [], []

    @jax.jit
    def part(p, k, tokens, labels, share):  # one microbatch: compiles once per length
        (value, aux), g = jax.value_and_grad(lambda p: loss(p, k, tokens, labels), has_aux=True)(p)
        return value, aux["accuracy"], jax.tree_util.tree_map(lambda x: share * x, g)

    @jax.jit
    def update(p, s, parts):
        g = jax.tree_util.tree_map(lambda *x: sum(x), *parts)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for t, step in enumerate(data):
        w = tokens_of(step)
        keys = [jax.random.fold_in(jax.random.fold_in(key, t), i) for i in range(len(step))]
        out = [part(params, k, *mb, np.float32(wi / sum(w))) for k, mb, wi in zip(keys, step, w)]
        params, state = update(params, state, [g for _, _, g in out])
        losses.append(weighted([float(v) for v, _, _ in out], w))
        accuracies.append(weighted([float(a) for _, a, _ in out], w))
    return losses, accuracies


def train(steps: int, runner: str = "inprocess", schedule: str = "1f1b", out: Path | None = None) -> dict:
    """Both runs; returns their loss and accuracy curves and their largest differences."""
    ids, vocab = corpus()
    params = init(vocab)
    b, t = jexport.symbolic_shape("b, t")
    spec = jax.ShapeDtypeStruct
    stages = vs.export_stages(
        loss,
        jax.tree_util.tree_map(lambda a: spec(a.shape, a.dtype), params),
        spec((), jax.random.key(0).dtype),  # the dropout key: an argument of its own
        spec((b, t), jnp.int32),
        spec((b, t), jnp.int32),
        wrt="params",
        platforms="cpu",
        has_aux=True,
    )
    tx, key = optax.adamw(3e-3), jax.random.key(0)
    data = list(batches(ids, steps))
    t0 = time.monotonic()
    reference, ref_accuracy = single_process(params, tx, data, key)
    t_ref = time.monotonic() - t0
    t0 = time.monotonic()
    traced = P.Observe(trace_dir=out, trace_every=steps) if out is not None else None  # the last step: timed, traced
    piped, accuracy = [], []
    with P.Trainer(
        stages,
        params,
        optimizer=tx,
        schedule=schedule,
        microbatches=MICROBATCHES,
        runner=runner,
        observe=traced,
        rng=key,
        aux="per_microbatch",
    ) as tr:
        for step in data:
            w = tokens_of(step)
            value, aux = tr.step(P.Microbatches(step, weights=w))  # the loss: the mean per token
            piped.append(value)
            accuracy.append(weighted([a["accuracy"] for a in aux], w))
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
    acc_diff = float(np.max(np.abs(np.array(accuracy) - ref_accuracy)))
    return {
        "pipeline": piped,
        "reference": reference,
        "accuracy": accuracy,
        "reference_accuracy": ref_accuracy,
        "max_rel_diff": rel,
        "max_accuracy_diff": acc_diff,
        "times": (t_pipe, t_ref),
        "vocab": vocab,
    }


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
    acc, ref_acc = r["accuracy"], r["reference_accuracy"]
    print(
        f"next-token accuracy: step 1 {acc[0]:.4f} -> step {len(acc)} {acc[-1]:.4f} "
        f"(one process: {ref_acc[0]:.4f} -> {ref_acc[-1]:.4f})"
    )
    print(f"largest difference of the two accuracy curves: {r['max_accuracy_diff']:.2e}")
    print(f"time: pipeline {r['times'][0]:.1f} s (incl. export and compile), one process {r['times'][1]:.1f} s")
    print(
        f"loss plot: {out / 'loss.png'}; the last step's trace: {out / f'step-{a.steps}.trace.json'} ({out / 'timeline.png'})"
    )
    # An accuracy counts tokens: a logit a rounding apart may turn one token's argmax (1/64 of a microbatch's).
    return 0 if r["max_rel_diff"] < 1e-4 and r["max_accuracy_diff"] < 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
