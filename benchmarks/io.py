"""Residual file throughput (.npz, .msgpack) vs np.save/np.load of one buffer, and peak RSS while loading."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import vjpsplit_cli as vs
from benchmarks.workloads import transformer

_RSS_PROBE = """
import json, resource, sys, numpy as np, vjpsplit_cli as vs
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
kind, path = sys.argv[1], sys.argv[2]
data = np.load(path) if kind == "raw" else vs.load_arrays(path)[0]
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_kib": after - before}))
"""


def _time(fn, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def run(quick: bool) -> tuple[str, list[dict]]:
    rounds = 3 if quick else 15
    w = transformer()
    fwd, _ = vs.split(w.fn)
    _, res = fwd(*jax.device_put(w.args))
    stored = [np.asarray(a) for a in res.stored]
    nbytes = sum(a.nbytes for a in stored)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        blob = np.concatenate([a.reshape(-1).view(np.uint8) for a in stored])

        def raw_roundtrip():
            np.save(d / "raw.npy", blob)
            np.load(d / "raw.npy")

        cands = {"np.save + np.load, one buffer": raw_roundtrip}
        for ext in ("npz", "msgpack"):
            def roundtrip(ext=ext):
                vs.save_residuals(d / f"r.{ext}", res)
                vs.load_residuals(d / f"r.{ext}", inputs=w.args)
            cands[f"vjpsplit .{ext}"] = roundtrip
        # Interleave: each round runs every candidate once.
        samples = {k: [] for k in cands}
        for fn in cands.values():
            fn()
        for _ in range(rounds):
            for k, fn in cands.items():
                t0 = time.perf_counter()
                fn()
                samples[k].append(time.perf_counter() - t0)
        times = {k: float(np.median(v)) for k, v in samples.items()}
        raw_t = times["np.save + np.load, one buffer"]
        for k, t in times.items():
            kind, path = ("raw", d / "raw.npy") if k.startswith("np.") else ("v", d / f"r.{k.rsplit('.', 1)[1]}")
            probe = subprocess.run([sys.executable, "-c", _RSS_PROBE, kind, str(path)], capture_output=True, text=True)
            peak = json.loads(probe.stdout)["peak_kib"] * 1024 if probe.returncode == 0 else float("nan")
            rows.append({"what": k, "s": t, "gib_s": nbytes / t / 2**30, "vs_raw": raw_t / t, "peak_load_bytes": peak})
    lines = [f"Residuals of the transformer block: {len(stored)} arrays, {nbytes / 2**20:.1f} MiB; save + load, "
             "page cache warm.", "",
             "| format | save+load (median) | throughput | vs raw numpy | peak RSS growth while loading |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['s'] * 1e3:.1f} ms | {r['gib_s']:.2f} GiB/s | {r['vs_raw']:.2f}× "
                     f"| {r['peak_load_bytes'] / nbytes:.2f}× the data |")
    return "\n".join(lines), rows
