"""A small GPT written as one function, cut into 4 pipeline stages by ``stage_boundary`` marks.

    python samples/pipeline/gpt.py [--schedule zbh1] [--out DIR]

The token embedding is tied (stage 0 embeds with it, stage 3 reads it again for
the logits; its gradient is the sum of both), the attention mask is read only
by the stages that attend, the embedded tokens skip a stage (a residual from
stage 0 to stage 2), and the first boundary is a pytree (hidden state plus an
auxiliary loss sum). Exports the stages, saves and reloads them, runs one
pipelined step and checks loss and gradients against ``jax.value_and_grad``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jexport

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P

VOCAB, WIDTH, SEQ, HEADS = 64, 32, 16, 4


def attention(p, h, mask):
    """One causal self-attention block with a padding mask, pre-norm, residual."""
    x = h / jnp.sqrt(jnp.mean(h**2, -1, keepdims=True) + 1e-6)
    q, k, v = (jnp.einsum("btd,dhe->bthe", x, p[n]) for n in ("q", "k", "v"))
    scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
    keep = causal[None, None] & (mask[:, None, None, :] > 0)
    att = jax.nn.softmax(jnp.where(keep, scores, -1e9), -1)
    return h + jnp.einsum("bhqk,bkhe,hed->bqd", att, v, p["o"])


def mlp(p, h):
    x = h / jnp.sqrt(jnp.mean(h**2, -1, keepdims=True) + 1e-6)
    return h + jax.nn.gelu(x @ p["up"]) @ p["down"]


def loss(params, tokens, mask, labels):
    """The whole GPT; marks end stages 0, 1 and 2."""
    emb = jnp.take(params["embed"], tokens, axis=0) + params["pos"]
    h, aux = vs.stage_boundary((emb, jnp.zeros((), jnp.float32)))  # a pytree boundary
    h = mlp(params["blocks"][0]["mlp"], attention(params["blocks"][0]["att"], h, mask))
    aux = aux + jnp.mean(h**2)
    h, aux = vs.stage_boundary((h, aux))
    h = mlp(params["blocks"][1]["mlp"], attention(params["blocks"][1]["att"], h, mask)) + emb  # skips stage 1
    h = vs.stage_boundary(h)
    logits = h @ params["embed"].T  # tied
    lp = jax.nn.log_softmax(logits)
    per_token = -jnp.take_along_axis(lp, labels[..., None], -1)[..., 0]
    return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0) + 1e-3 * aux


def init(seed: int = 0):
    rng = np.random.default_rng(seed)

    def f(*shape):
        return (rng.normal(size=shape) / np.sqrt(shape[0])).astype(np.float32)

    block = lambda: {  # noqa: E731
        "att": {n: f(WIDTH, HEADS, WIDTH // HEADS) for n in ("q", "k", "v")} | {"o": f(HEADS, WIDTH // HEADS, WIDTH)},
        "mlp": {"up": f(WIDTH, 4 * WIDTH), "down": f(4 * WIDTH, WIDTH)},
    }
    return {"embed": f(VOCAB, WIDTH), "pos": f(SEQ, WIDTH) * 0.1, "blocks": [block(), block()]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedule", default="zbh1", choices=["gpipe", "1f1b", "zbh1", "zbv"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--out", default=None, help="where to save the stages (default: a temp dir)")
    args = ap.parse_args(argv)
    params = init()
    (b,) = jexport.symbolic_shape("b")
    S = jax.ShapeDtypeStruct
    specs = jax.tree_util.tree_map(lambda a: S(a.shape, a.dtype), params)
    stages = vs.export_stages(
        loss,
        specs,
        S((b, SEQ), jnp.int32),
        S((b, SEQ), jnp.float32),
        S((b, SEQ), jnp.int32),
        wrt="params",
        platforms="cpu",
    )
    out = Path(args.out or tempfile.mkdtemp(prefix="vjpsplit-gpt-")) / "gpt.stages"
    stages.save(out)
    stages = vs.load_stages(out)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, VOCAB, (args.batch, SEQ)).astype(np.int32)
    mask = (rng.random((args.batch, SEQ)) > 0.2).astype(np.float32)
    labels = np.roll(tokens, -1, axis=1)
    r = P.run(stages, params, (tokens, mask, labels), microbatches=args.microbatches, schedule=args.schedule)
    k = args.batch // args.microbatches

    def mean_loss(p):  # the pipeline's loss: the mean of the microbatches' losses
        parts = [
            loss(p, tokens[m * k : (m + 1) * k], mask[m * k : (m + 1) * k], labels[m * k : (m + 1) * k])
            for m in range(args.microbatches)
        ]
        return jnp.mean(jnp.stack(parts))

    want, grads = jax.value_and_grad(mean_loss)(params)
    worst = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(g))))
        for a, g in zip(jax.tree_util.tree_leaves(r.grads), jax.tree_util.tree_leaves(grads), strict=True)
    )
    for i, st in enumerate(stages.index.per_stage):
        held = [stages.index.params[j].key for j in st.params]
        reads = [stages.index.batch[j].key for j in st.batch]
        print(
            f"stage {i}: {len(held)} parameter leaves, reads {', '.join(reads) or 'no batch input'}, "
            f"receives {len(st.receives)} values"
        )
    ok = np.isclose(r.loss, want, rtol=1e-4) and worst < 1e-4
    print(
        f"{'OK' if ok else 'FAIL'}: loss {r.loss:.6f} (value_and_grad {float(want):.6f}), "
        f"largest gradient difference {worst:.1e}; stages saved in {out}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
