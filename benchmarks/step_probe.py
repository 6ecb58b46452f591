"""The GPT step on one device, one process against the Trainer, and where the Trainer's time goes.

    python -m benchmarks.step_probe 512:4 1024:8 [1024:8:profile] [1024:8:breakdown] [1024:8:ops] [1024:8@dots]

``benchmarks/gpt.py``'s GPT (sequence 256, 8 heads, vocab 512, batch 16 in 8
microbatches, AdamW), both stages on the first device: the one-process step on the
whole batch and over the same 8 microbatches in one ``jit`` (``lax.scan``), and the
Trainer's untimed, batch-on-device and timed steps (1F1B, ZB-H1), medians of 6.
``profile_step`` (``:profile``) profiles the untimed step's own thread; ``breakdown``
(``:breakdown``) splits the step by phase from the workers' rings; ``op_times`` (``:ops``) runs one stage's F
and B back to back (the device's time per call where it exceeds the host's). Run on
a TPU for the figures in ``benchmarks/results/2026-12-06-tpu-step.md``. ``@POLICY`` (``everything``,
``dots``, ``nothing``) exports the stages under that rematerialization policy.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.gpt import GPT
from benchmarks.train_accel import BATCH, HEADS, MICROBATCHES as M, REFERENCE, SEQ, VOCAB, _one_process
from vjpsplit_cli import pipeline as P

POLICY: str | None = None  # the stages' rematerialization policy (``@POLICY`` on the command line)


def med(fn, n=6, warm=2):
    """Median milliseconds of ``fn()`` over ``n`` calls after ``warm``."""
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def _gpt(width, blocks):
    """The GPT, its parameters, one batch (synthetic tokens), its stages for this backend, and the first device."""
    g = GPT(width=width, blocks=blocks, seq=SEQ, heads=HEADS, stages=2)
    params = g.init(VOCAB)
    win = np.random.default_rng(1).integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
    return g, params, (win[:, :-1], win[:, 1:]), g.export(params, jax.default_backend(), POLICY), jax.devices()[0]


def _trainer(stages, params, sched, d):
    """A Trainer of both stages on device ``d`` (AdamW, 8 microbatches)."""
    runner = P.InProcess(devices=[[d], [d]])
    return P.Trainer(stages, params, optimizer=optax.adamw(1e-3), microbatches=M, schedule=sched, runner=runner)


def main(width, blocks):
    """The one-process steps and the Trainer's (untimed, batch on the device, timed), printed in ms."""
    g, params, batch, stages, d = _gpt(width, blocks)
    dbatch = jax.device_put(batch, d)
    one = _one_process(g, params, optax.adamw(1e-3), d)
    rows = {
        "one process, full batch": med(lambda: one["full"](dbatch)),
        "one process, 8 microbatches in one jit": med(lambda: one[REFERENCE](dbatch)),
    }
    for sched in ("1f1b", "zbh1"):
        with _trainer(stages, params, sched, d) as tr:
            rows[f"Trainer {sched}"] = med(lambda: tr.step(batch))
            rows[f"Trainer {sched}, batch on device"] = med(lambda: tr.step(dbatch))
            rows[f"Trainer {sched}, timed"] = med(lambda: tr.step(batch, timed=True), n=3)
    for k, v in rows.items():
        print(f"w{width} b{blocks}  {k:45s} {v:8.2f} ms", flush=True)


def profile_step(width, blocks, sched="1f1b", steps=5):
    """cProfile of the untimed step's own thread, and its phases' wall times."""
    from vjpsplit_cli.pipeline.training import local_backend as LB

    _, params, batch, stages, d = _gpt(width, blocks)
    tr = _trainer(stages, params, sched, d)
    for _ in range(3):
        tr.step(batch)
    prof = cProfile.Profile()
    times = {"dispatch": [], "finish": []}
    orig_dispatch, orig_finish = LB.dispatch, LB.InProcessBackend._finish

    def dispatch(*a, **k):
        t0 = time.perf_counter()
        prof.enable()
        try:
            return orig_dispatch(*a, **k)
        finally:
            prof.disable()
            times["dispatch"].append(time.perf_counter() - t0)

    def finish(self, *a, **k):
        t0 = time.perf_counter()
        prof.enable()
        try:
            return orig_finish(self, *a, **k)
        finally:
            prof.disable()
            times["finish"].append(time.perf_counter() - t0)

    LB.dispatch, LB.InProcessBackend._finish = dispatch, finish
    tot = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tr.step(batch)
        tot.append(time.perf_counter() - t0)
    LB.dispatch, LB.InProcessBackend._finish = orig_dispatch, orig_finish
    print(
        f"w{width} {sched}: step {statistics.median(tot) * 1e3:.2f} ms, dispatch {statistics.median(times['dispatch']) * 1e3:.2f} ms, finish {statistics.median(times['finish']) * 1e3:.2f} ms"
    )
    print_profile(prof, 30, 40)
    tr.close()


def print_profile(prof: cProfile.Profile, by_own: int, by_cumulative: int) -> None:
    """Print ``prof``'s top ``by_own`` functions by their own time, then its top ``by_cumulative`` by cumulative."""
    for key, n in (("tottime", by_own), ("cumulative", by_cumulative)):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(n)
        print(s.getvalue()[: 200 * n + 1000])


def breakdown(width, blocks, sched="1f1b"):
    """Unprofiled: the host's time in the untimed step's dispatch, by the ring's per-operation dispatch times."""
    from vjpsplit_cli.pipeline.training import local_backend as LB

    _, params, batch, stages, d = _gpt(width, blocks)
    tr = _trainer(stages, params, sched, d)
    marks = {}
    orig_dispatch, orig_finish = LB.dispatch, LB.InProcessBackend._finish

    def dispatch(*a, **k):
        marks["d0"] = time.monotonic()
        out = orig_dispatch(*a, **k)
        marks["d1"] = time.monotonic()
        return out

    def finish(self, *a, **k):
        out = orig_finish(self, *a, **k)
        marks["f1"] = time.monotonic()
        return out

    LB.dispatch, LB.InProcessBackend._finish = dispatch, finish
    rows = []
    for i in range(8):
        t0 = time.monotonic()
        tr.step(batch)
        t1 = time.monotonic()
        if i < 3:
            continue
        ring = [e for t in tr.backend.trainers for e in t.worker.ring if e[2] >= marks["d0"]]
        by = {}
        for kind, _, a, b, *_ in ring:
            by.setdefault(kind, []).append(b - a)
        call = sum(sum(v) for v in by.values())
        rows.append(
            (
                t1 - t0,
                marks["d1"] - marks["d0"],
                call,
                marks["f1"] - marks["d1"],
                t1 - marks["f1"],
                {k: statistics.mean(v) * 1e6 for k, v in by.items()},
                len(ring),
            )
        )
    LB.dispatch, LB.InProcessBackend._finish = orig_dispatch, orig_finish

    def ms(i):
        return statistics.median(r[i] for r in rows) * 1e3

    print(
        f"w{width} {sched}: step {ms(0):.2f} ms; dispatch {ms(1):.2f} ms of which in the ops' calls {ms(2):.2f} ms ({rows[-1][6]} ops; mean us by kind {rows[-1][5]}); finish {ms(3):.2f} ms; fetch+rest {ms(4):.2f} ms"
    )
    tr.close()


def op_times(width, blocks):
    """Per stage: an artifact F and B called 20 times back to back (wall / 20: the device's time where it is the
    longer), and the host's time to dispatch one."""
    _, params, batch, stages, d = _gpt(width, blocks)
    tr = _trainer(stages, params, "1f1b", d)
    ws = [t.worker for t in tr.backend.trainers]
    x, side = stages.stage_batch(batch, M)[0]
    x, side = jax.device_put(x, d), {k: jax.device_put(list(v), d) for k, v in side.items()}
    for s, w in enumerate(ws):
        f = w.calls.forward
        for _ in range(3):
            out, res = f(w.params, x, *side.get(s, []))
        jax.block_until_ready((out, res))
        ct = jax.device_put(jax.tree.map(jnp.ones_like, out) if s == 0 else jnp.float32(1 / M), d)
        for _ in range(3):
            gw, gx = w.calls.backward(res, ct)
        jax.block_until_ready((gw, gx))
        rows = []
        for call in (lambda: f(w.params, x, *side.get(s, [])), lambda: w.calls.backward(res, ct)):
            host = []
            t0 = time.perf_counter()
            for _ in range(20):
                a = time.perf_counter()
                o = call()
                host.append(time.perf_counter() - a)
            jax.block_until_ready(o)
            rows.append(((time.perf_counter() - t0) / 20 * 1e3, statistics.median(host) * 1e3))
        leaves = jax.tree_util.tree_leaves(res.stored)
        print(
            f"w{width} stage {s}: F {rows[0][0]:.2f} ms/call back to back (host {rows[0][1]:.2f}), "
            f"B {rows[1][0]:.2f} (host {rows[1][1]:.2f}); stored residuals {len(leaves)}, "
            f"{sum(a.nbytes for a in leaves) / 1e6:.0f} MB"
        )
        x = out
    tr.close()


if __name__ == "__main__":
    # WIDTH:BLOCKS[:profile|:breakdown|:ops] ...
    for arg in sys.argv[1:]:
        arg, _, POLICY = arg.partition("@")
        POLICY = POLICY or None
        print(f"-- {arg} policy {POLICY or 'everything'}", flush=True)
        w, b, *what = arg.split(":")
        {"profile": profile_step, "breakdown": breakdown, "ops": op_times}.get(what[0] if what else "", main)(
            int(w), int(b)
        )
