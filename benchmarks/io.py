"""Residual file throughput (.npz, .msgpack) vs np.save/np.load of one buffer, and peak RSS while loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import vjpsplit_cli as vs
from benchmarks.workloads import transformer

# Peak RSS growth while loading, in a fresh process. ru_maxrss cannot be used: its
# high-water mark is set by the imports (jax), far above what a load adds. Writing
# "5" to /proc/self/clear_refs resets VmHWM to the current RSS, so VmHWM after the
# load minus VmRSS before it is exactly what loading added at its peak. A tiny file
# of the same kind is loaded first, so one-time imports and first-use setup (a few
# MiB, whatever the file size) are not counted as the load's.
_RSS_PROBE = """
import json, sys, numpy as np, vjpsplit_cli as vs

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

def load(path):
    return np.load(path) if kind == "raw" else vs.load_arrays(path)[0]

kind, path, warm = sys.argv[1:4]
load(warm)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
data = load(path)
print(json.dumps({"peak_kib": status("VmHWM") - before}))
"""

RAW = "np.save + np.load, one buffer"
RAW_FSYNC = "np.save + fsync + np.load, one buffer"


def _time(fn, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def _peak_load_bytes(kind: str, path: Path) -> float:
    warm = path.with_name("warm" + path.suffix)
    if kind == "raw":
        np.save(warm, np.zeros(4, np.float32))
    else:
        vs.save_arrays(warm, {"r/0": np.zeros(4, np.float32)}, {"kind": "warm-up"})
    probe = subprocess.run([sys.executable, "-c", _RSS_PROBE, kind, str(path), str(warm)],
                           capture_output=True, text=True)
    if probe.returncode != 0:  # no /proc (not Linux), or clear_refs not writable here
        return float("nan")
    return json.loads(probe.stdout)["peak_kib"] * 1024


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

        def raw_fsync_roundtrip():
            # Like with like: vjpsplit fsyncs every file it writes (crash safety), np.save does not.
            with open(d / "raw_fsync.npy", "wb") as f:
                np.save(f, blob)
                f.flush()
                os.fsync(f.fileno())
            np.load(d / "raw_fsync.npy")

        # name -> (round trip, what the RSS probe loads)
        cands = {RAW: (raw_roundtrip, ("raw", d / "raw.npy")),
                 RAW_FSYNC: (raw_fsync_roundtrip, ("raw", d / "raw_fsync.npy"))}
        for ext in ("npz", "msgpack"):
            def roundtrip(ext=ext):
                vs.save_residuals(d / f"r.{ext}", res)
                vs.load_residuals(d / f"r.{ext}", inputs=w.args)
            cands[f"vjpsplit .{ext}"] = (roundtrip, ("v", d / f"r.{ext}"))
        # Interleave: each round runs every candidate once.
        samples = {k: [] for k in cands}
        for fn, _ in cands.values():
            fn()
        for _ in range(rounds):
            for k, (fn, _) in cands.items():
                t0 = time.perf_counter()
                fn()
                samples[k].append(time.perf_counter() - t0)
        times = {k: float(np.median(v)) for k, v in samples.items()}
        for k, t in times.items():
            peak = _peak_load_bytes(*cands[k][1])
            rows.append({"what": k, "s": t, "gib_s": nbytes / t / 2**30, "vs_raw": times[RAW] / t,
                         "vs_raw_fsync": times[RAW_FSYNC] / t, "peak_load_bytes": peak})
    lines = [f"Residuals of the transformer block: {len(stored)} arrays, {nbytes / 2**20:.1f} MiB; save + load, "
             "page cache warm. vjpsplit fsyncs every file it saves (crash safety); plain np.save does not, so "
             "\"vs raw + fsync\" is the like-for-like ratio.", "",
             "| format | save+load (median) | throughput | vs raw numpy | vs raw + fsync "
             "| peak RSS growth while loading |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['s'] * 1e3:.1f} ms | {r['gib_s']:.2f} GiB/s | {r['vs_raw']:.2f}× "
                     f"| {r['vs_raw_fsync']:.2f}× | {r['peak_load_bytes'] / nbytes:.2f}× the data |")
    return "\n".join(lines), rows
