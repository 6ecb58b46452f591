"""Issue 68's table on an accelerator: a GPT's pipelined Trainer step against one process doing the same math.

    python -m benchmarks --accelerator [--quick]      # its ``train`` step (benchmarks/accelerator.py)

The GPT of ``benchmarks/gpt.py`` (RMS-norm blocks, tied embedding) with sequence 256, 8 heads,
vocabulary 512 (synthetic token ids), batch 16 in 8 microbatches, AdamW, cut into 2 stages, at
width 512 with 4 blocks and width 1024 with 8 (``--quick``: width 32 with 2 blocks, sequence 64, and
``auto`` racing each plan it rates close for one step instead of 3). The stages
run on the first two visible devices; on a machine with one device both share it
(``InProcess(devices=[[d], [d]])``). The candidates, each a whole optimizer step whose loss
the host fetches:

- one process, full batch: ``jit`` of ``value_and_grad`` and the optax update, on the first device;
- one process, the same 8 microbatches accumulated in one ``jit`` (``lax.scan``): the reference;
- the Trainer's untimed 1F1B, ZB-H1 and ``auto`` steps on a host batch;
- the 1F1B Trainer's untimed step on a batch already on the device, and its timed step;
- with ``--full``, the 1F1B Trainer's untimed step with its stages exported under the default policy
  ``everything`` (another compile of the step's program on one chip: 93 s at width 1024 on a TPU v5e).

The Trainer rows but the last export the stages with ``policy="dots"`` (``POLICY``).

Each candidate warms up (2 steps; ``auto`` until its trial steps are done), then the
candidates run interleaved round by round; a row gives the median step and its ratio to
the reference. ``targets`` says which of the issue's targets the rows meet.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy as np

from benchmarks.timing import interleaved_samples

SEQ, HEADS, VOCAB, BATCH, MICROBATCHES = 256, 8, 512, 16, 8
WIDTHS = ((512, 4), (1024, 8))  # (width, blocks)
QUICK_WIDTHS = ((32, 2),)
QUICK_SEQ = 64
ROUNDS, QUICK_ROUNDS = 6, 3
QUICK_TRIAL_ROUNDS = 1  # auto's steps per close plan with --quick (None: the Trainer's default)
REFERENCE = "accumulated"
# key: the row's label in the report
CANDIDATES = {
    "full": "one process, full batch",
    REFERENCE: f"one process, the same {MICROBATCHES} microbatches in one jit",
    "1f1b": "Trainer 1F1B",
    "zbh1": "Trainer ZB-H1",
    "auto": "Trainer auto",
    "1f1b_device": "Trainer 1F1B, batch on the device",
    "1f1b_timed": "Trainer 1F1B, timed",
    "1f1b_everything": "Trainer 1F1B, stages exported with policy everything",
}
# The rematerialization policy the Trainer rows' stages are exported with (``export_stages(policy=)``): ``dots``
# keeps the matmuls' outputs and recomputes the rest in B, as XLA does inside one ``jit``; ``everything`` (the
# default) writes every residual, 3.3x the bytes at width 1024 (the 1f1b_everything row).
POLICY = "dots"
WARMUP = 2
AUTO_STEPS_AT_MOST = 70  # auto's two timed steps and its trial steps (benchmarks/autotrain.py's bound)
# Issue 68's targets: the untimed 1F1B and ZB-H1 steps against the reference, by width.
RATIO_LIMITS = {1024: 1.15, 512: 2.0}
TIMED_LIMIT = 1.2  # a timed step against an untimed one


def config(quick: bool, full: bool = False) -> dict:
    """What ``measure_width`` runs: the widths (with their blocks), the rounds after warm-up and (``full``) whether
    the ``1f1b_everything`` candidate runs."""
    return {
        "everything": full,
        "widths": [list(w) for w in (QUICK_WIDTHS if quick else WIDTHS)],
        "rounds": QUICK_ROUNDS if quick else ROUNDS,
        "seq": QUICK_SEQ if quick else SEQ,
        "trial_rounds": QUICK_TRIAL_ROUNDS if quick else None,
        "heads": HEADS,
        "vocab": VOCAB,
        "batch": BATCH,
        "microbatches": MICROBATCHES,
        "policy": POLICY,
    }


def _one_process(g, params, tx, device) -> dict[str, Callable]:
    """The two one-process steps on ``device``: the full batch, and the microbatches accumulated by a scan."""
    import jax
    import jax.numpy as jnp
    import optax

    M = MICROBATCHES

    @jax.jit
    def full(prm, st, tokens, labels):
        v, grads = jax.value_and_grad(g.loss)(prm, tokens, labels)
        u, st = tx.update(grads, st, prm)
        return optax.apply_updates(prm, u), st, v

    @jax.jit
    def accumulated(prm, st, tokens, labels):
        split = lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:])  # noqa: E731

        def body(acc, xs):
            v, gr = jax.value_and_grad(g.loss)(prm, *xs)
            return (acc[0] + v / M, jax.tree_util.tree_map(lambda a, b: a + b / M, acc[1], gr)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree_util.tree_map(jnp.zeros_like, prm))
        (v, grads), _ = jax.lax.scan(body, zero, (split(tokens), split(labels)))
        u, st = tx.update(grads, st, prm)
        return optax.apply_updates(prm, u), st, v

    steps = {}
    for key, fn in (("full", full), (REFERENCE, accumulated)):
        state = [jax.device_put(params, device), jax.device_put(tx.init(params), device)]

        def step(batch, fn=fn, state=state) -> float:
            state[0], state[1], v = fn(state[0], state[1], *batch)
            return float(v)

        steps[key] = step
    return steps


def measure_width(
    width: int,
    blocks: int,
    rounds: int,
    platform: str,
    seq: int = SEQ,
    trial_rounds: int | None = None,
    everything: bool = True,
) -> list[dict]:
    """Every candidate at one width, side by side: one row each, with its median and ratio to the reference.

    Args:
        width: the GPT's width.
        blocks: its blocks (cut into 2 stages of equal runs).
        rounds: interleaved rounds after warm-up; each candidate's median is over these.
        platform: the platform the stages are exported for (``jax.export``'s name).
        seq: the GPT's sequence length.
        trial_rounds: ``Schedule(trial_rounds=)`` of the ``auto`` Trainer (None: the Trainer's default).
        everything: whether the ``1f1b_everything`` candidate runs.

    Returns:
        One row per candidate (``CANDIDATES``' order): width, blocks, key, candidate, ms, ratio, samples_ms.

    Raises:
        RuntimeError: the ``auto`` Trainer still racing after ``AUTO_STEPS_AT_MOST`` steps.
    """
    import jax
    import optax

    from benchmarks.gpt import GPT
    from vjpsplit_cli import pipeline as P

    g = GPT(width=width, blocks=blocks, seq=seq, heads=HEADS, stages=2)
    params = g.init(VOCAB)
    win = np.random.default_rng(1).integers(0, VOCAB, (BATCH, seq + 1)).astype(np.int32)
    batch = (win[:, :-1], win[:, 1:])
    have = jax.local_devices()
    d0, d1 = have[0], have[1 % len(have)]
    device_batch = jax.device_put(batch, d0)
    tx = optax.adamw(1e-3)
    stages = g.export(params, platform, POLICY)
    steps = _one_process(g, params, tx, d0)
    trainers = {}
    try:
        for key, schedule in (
            ("1f1b", "1f1b"),
            ("zbh1", "zbh1"),
            ("auto", P.Schedule("auto", trial_rounds=trial_rounds)),
            *([("1f1b_everything", "1f1b")] if everything else []),
        ):
            trainers[key] = P.Trainer(
                g.export(params, platform) if key == "1f1b_everything" else stages,
                params,
                optimizer=tx,
                microbatches=MICROBATCHES,
                schedule=schedule,
                runner=P.InProcess(devices=[[d0], [d1]]),
            )
        one = trainers["1f1b"]
        cands: dict[str, Callable[[], float]] = {
            "full": lambda: steps["full"](device_batch),
            REFERENCE: lambda: steps[REFERENCE](device_batch),
            "1f1b": lambda: one.step(batch),
            "zbh1": lambda: trainers["zbh1"].step(batch),
            "auto": lambda: trainers["auto"].step(batch),
            "1f1b_device": lambda: one.step(device_batch),
            "1f1b_timed": lambda: one.step(batch, timed=True),
        }
        if everything:
            cands["1f1b_everything"] = lambda: trainers["1f1b_everything"].step(batch)
        for fn in cands.values():
            for _ in range(WARMUP):
                fn()
        auto = trainers["auto"]
        for _ in range(AUTO_STEPS_AT_MOST):
            if auto.auto is None or auto.auto.trial is None:
                break
            auto.step(batch)
        else:
            raise RuntimeError(f"the auto Trainer was still racing after {AUTO_STEPS_AT_MOST} steps")
        t0 = time.perf_counter()
        samples = interleaved_samples(cands, rounds, warmup=0)
        seconds = time.perf_counter() - t0
        kept = None if auto.auto is None else auto.auto.choice
    finally:
        for tr in trainers.values():
            tr.close()
    ref = statistics.median(samples[REFERENCE])
    rows = []
    for key, got in samples.items():
        med = statistics.median(got)
        row = {
            "width": width,
            "blocks": blocks,
            "key": key,
            "candidate": CANDIDATES[key],
            "ms": med * 1e3,
            "ratio": med / ref,
            "samples_ms": [s * 1e3 for s in got],
        }
        if key == "auto":
            row["kept"] = kept
        rows.append(row)
    rows[0]["rounds_seconds"] = seconds
    rows[0]["devices"] = [str(d0), str(d1)]
    return rows


def targets(rows: list[dict]) -> list[dict]:
    """Issue 68's targets against ``rows``: each with its measured value, its limit and ``met`` (None: the rows
    hold no measurement for it).

    Args:
        rows: ``measure_width``'s rows, of any widths measured so far.

    Returns:
        One entry per target: target (its words), width, value, limit, met.
    """
    by = {(r["width"], r["key"]): r for r in rows}
    out = []
    for width, limit in sorted(RATIO_LIMITS.items(), reverse=True):
        for key in ("1f1b", "zbh1"):
            r = by.get((width, key))
            out.append(
                {
                    "target": f"{CANDIDATES[key]}, untimed, at width {width}: at most {limit}× the one-process step "
                    "over the same microbatches",
                    "width": width,
                    "value": None if r is None else r["ratio"],
                    "limit": limit,
                    "met": None if r is None else bool(r["ratio"] <= limit),
                }
            )
    for width in sorted({r["width"] for r in rows}, reverse=True):
        host, dev, timed = (by.get((width, k)) for k in ("1f1b", "1f1b_device", "1f1b_timed"))
        if host is None:
            continue
        for name, other, limit in (
            ("a batch on the device no slower than one on the host (1F1B)", dev, 1.0),
            (f"a timed step at most {TIMED_LIMIT}× an untimed one (1F1B)", timed, TIMED_LIMIT),
        ):
            value = None if other is None else other["ms"] / host["ms"]
            out.append(
                {
                    "target": f"{name}, at width {width}",
                    "width": width,
                    "value": value,
                    "limit": limit,
                    "met": None if value is None else bool(value <= limit),
                }
            )
    return out


def table(rows: list[dict], cfg: dict, platform: str) -> str:
    """The markdown report: one line per width (each candidate's median and its ratio), then the targets."""
    keys = list(CANDIDATES)
    lines = [
        f"GPT (`benchmarks/gpt.py`), sequence {cfg['seq']}, {cfg['heads']} heads, vocabulary {cfg['vocab']} "
        f"(synthetic token ids), batch {cfg['batch']} in {cfg['microbatches']} microbatches, AdamW, 2 stages, "
        f"on `{platform}`; medians of {cfg['rounds']} interleaved rounds after warm-up, and each against the "
        f"one-process step over the same microbatches in one `jit` ({CANDIDATES[REFERENCE]}).",
        "",
        "| width, blocks | " + " | ".join(CANDIDATES[k] for k in keys) + " |",
        "|---|" + "---:|" * len(keys),
    ]
    for width in dict.fromkeys(r["width"] for r in rows):
        by = {r["key"]: r for r in rows if r["width"] == width}
        cells = [f"{by[k]['ms']:.1f} ms ({by[k]['ratio']:.2f}×)" if k in by else "—" for k in keys]
        lines.append(f"| {width}, {next(iter(by.values()))['blocks']} | " + " | ".join(cells) + " |")
    placed = next((r["devices"] for r in rows if "devices" in r), None)
    if placed:
        lines += ["", f"Stages on {placed[0]} and {placed[1]}; the one-process steps on {placed[0]}."]
    auto = [r for r in rows if r["key"] == "auto" and r.get("kept")]
    if auto:
        lines += ["", "auto kept: " + ", ".join(f"{r['kept']} (width {r['width']})" for r in auto) + "."]
    lines += ["", "| target | measured | limit | met |", "|---|---:|---:|---|"]
    for t in targets(rows):
        value = "not measured" if t["value"] is None else f"{t['value']:.2f}×"
        met = "—" if t["met"] is None else ("met" if t["met"] else "**missed**")
        lines.append(f"| {t['target']} | {value} | {t['limit']}× | {met} |")
    return "\n".join(lines)
