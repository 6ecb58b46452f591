"""The training benchmarks' models: a GPT of any width and depth cut into stages, and tiny stages of negligible work.

The GPT is ``samples/pipeline/train_gpt.py``'s (a tied token embedding, pre-norm causal
attention + MLP blocks, the mean cross-entropy), written once with ``stage_boundary``
marks between equal runs of blocks, on windows of this repository's docs.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jexport

import vjpsplit_cli as vs

ROOT = Path(__file__).resolve().parents[1]


def _sample():
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "samples" / "pipeline" / "train_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@dataclass(frozen=True)
class GPT:
    """A GPT of ``blocks`` blocks of ``width``, ``heads`` heads, over ``seq`` tokens, cut into ``stages``."""

    width: int = 256
    blocks: int = 4
    seq: int = 64
    heads: int = 4
    stages: int = 2

    def loss(self, params, tokens, labels):
        """The whole model: embed | blocks (a boundary every blocks/stages) | tied logits, mean cross-entropy."""
        h = jnp.take(params["embed"], tokens, axis=0) + params["pos"]
        per = self.blocks // self.stages
        for i, p in enumerate(params["blocks"]):
            if i and i % per == 0:
                h = vs.stage_boundary(h)
            h = self._block(p, h)
        lp = jax.nn.log_softmax(_rms(h) @ params["embed"].T)
        return -jnp.mean(jnp.take_along_axis(lp, labels[..., None], -1))

    def _block(self, p, h):
        x = _rms(h)
        q, k, v = (jnp.einsum("btd,dhe->bthe", x, p[n]) for n in ("q", "k", "v"))
        scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones((self.seq, self.seq), bool))
        att = jax.nn.softmax(jnp.where(causal[None, None], scores, -1e9), -1)
        h = h + jnp.einsum("bhqk,bkhe,hed->bqd", att, v, p["o"])
        return h + jax.nn.gelu(_rms(h) @ p["up"]) @ p["down"]

    def init(self, vocab: int, seed: int = 0):
        """GPT-2's scales: the tied logits start near 0, the first loss near ln(vocab)."""
        rng = np.random.default_rng(seed)
        W, H, e = self.width, self.heads, self.width // self.heads

        def n(*shape, scale):
            return (rng.normal(size=shape) * scale).astype(np.float32)

        blocks = [
            {
                **{k: n(W, H, e, scale=W**-0.5) for k in ("q", "k", "v")},
                "o": n(H, e, W, scale=W**-0.5 / 2),
                "up": n(W, 4 * W, scale=W**-0.5),
                "down": n(4 * W, W, scale=(4 * W) ** -0.5 / 2),
            }
            for _ in range(self.blocks)
        ]
        return {"embed": n(vocab, W, scale=0.02), "pos": n(self.seq, W, scale=0.01), "blocks": blocks}

    def export(self, params, platform: str = "cpu", policy: str | None = None):
        """The ``Stages`` of this model (one microbatch's batch spec with a symbolic size) under ``policy``."""
        (b,) = jexport.symbolic_shape("b")
        spec = jax.ShapeDtypeStruct
        tree = jax.tree_util.tree_map(lambda a: spec(a.shape, a.dtype), params)
        tok = spec((b, self.seq), jnp.int32)
        return vs.export_stages(self.loss, tree, tok, tok, wrt="params", platforms=platform, policy=policy)


def _rms(h):
    return h / jnp.sqrt(jnp.mean(h**2, -1, keepdims=True) + 1e-6)


def docs_batches(seq: int, batch: int, count: int, seed: int = 1):
    """The vocabulary size and ``count`` batches of (tokens, next tokens): windows of the docs."""
    ids, vocab = _sample().corpus()
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        starts = rng.integers(0, len(ids) - seq - 1, batch)
        win = np.stack([ids[s : s + seq + 1] for s in starts])
        out.append((win[:, :-1], win[:, 1:]))
    return vocab, out


def tiny_stages(
    width: int = 16, layers: int = 8, rows: int = 4, microbatches: int = 16, seed: int = 0, platform: str = "cpu"
):
    """Stages of negligible work: ``layers`` gelu layers of ``width`` cut in two, and one batch for them."""
    half = layers // 2

    def loss(params, x, labels):
        for i, p in enumerate(params[:-1]):
            if i == half:
                x = vs.stage_boundary(x)
            x = jax.nn.gelu(x @ p["w"] + p["b"])
        logits = x @ params[-1]["w"] + params[-1]["b"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))

    rng = np.random.default_rng(seed)
    params = [
        {"w": (rng.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32), "b": np.zeros(width, np.float32)}
        for _ in range(layers)
    ]
    n = rows * microbatches
    batch = (rng.normal(size=(n, width)).astype(np.float32), rng.integers(0, width, n).astype(np.int32))
    (b,) = jexport.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct
    tree = jax.tree_util.tree_map(lambda a: spec(a.shape, a.dtype), params)
    stages = vs.export_stages(
        loss, tree, spec((b, width), jnp.float32), spec((b,), jnp.int32), wrt="params", platforms=platform
    )
    return stages, params, batch, loss
