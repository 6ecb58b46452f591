"""CLI wall time: run-fwd + run-bwd, first run (cold compilation cache) vs repeated, vs `import jax`."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _wall(cmd, env, cwd) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{cmd} failed: {r.stderr[-500:]}")
    return time.perf_counter() - t0


def run(quick: bool) -> tuple[str, list[dict]]:
    rounds = 3 if quick else 7
    py = sys.executable
    cli = [py, "-m", "vjpsplit_cli"]
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        env = {**os.environ, "VJPSPLIT_CACHE_DIR": str(d / "cache")}
        subprocess.run([py, "samples/mlp.py", "make-inputs", str(d / "in.npz"), "--batch", "256"], cwd=ROOT,
                       check=True, capture_output=True)
        for plats, name in (("cpu,cuda,tpu", "mlp3.vjps"), ("cpu", "mlp1.vjps")):
            subprocess.run(cli + ["export", "samples/mlp.py:loss", "--shapes", "params=@samples/mlp.py:param_shapes",
                                  "--shapes", "x=f32[b,784]", "--shapes", "labels=i32[b]", "--platforms", plats,
                                  "-o", str(d / name)], cwd=ROOT, env=env, check=True, capture_output=True)

        def pair(art, extra=()):
            fwd = cli + [*extra, "run-fwd", str(d / art), "--inputs", str(d / "in.npz"), "--residuals", str(d / "r.npz")]
            bwd = cli + [*extra, "run-bwd", str(d / art), "--residuals", str(d / "r.npz"), "--inputs",
                         str(d / "in.npz"), "--grads", str(d / "g.npz")]
            return _wall(fwd, env, ROOT) + _wall(bwd, env, ROOT)

        rows = {"first run (empty compilation cache)": pair("mlp3.vjps")}
        samples: dict[str, list[float]] = {"floor: 2 × `python -c 'import jax'`": [],
                                           "repeated, cached (artifact for cpu,cuda,tpu)": [],
                                           "repeated, cached (artifact for cpu only)": [],
                                           "repeated, `--no-cache`": []}
        pair("mlp1.vjps")  # fills the cache for the cpu-only artifact
        for _ in range(rounds):
            samples["floor: 2 × `python -c 'import jax'`"].append(
                _wall([py, "-c", "import jax"], env, ROOT) + _wall([py, "-c", "import jax"], env, ROOT))
            samples["repeated, cached (artifact for cpu,cuda,tpu)"].append(pair("mlp3.vjps"))
            samples["repeated, cached (artifact for cpu only)"].append(pair("mlp1.vjps"))
            samples["repeated, `--no-cache`"].append(pair("mlp3.vjps", ["--no-cache"]))
        rows.update({k: statistics.median(v) for k, v in samples.items()})
    floor = rows["floor: 2 × `python -c 'import jax'`"]
    lines = ["Quick-start MLP (784-256-10), batch 256; wall time of `run-fwd` + `run-bwd` (two processes).", "",
             "| run | wall time | minus the import floor |", "|---|---:|---:|"]
    for k, v in rows.items():
        lines.append(f"| {k} | {v:.2f} s | {v - floor:+.2f} s |")
    return "\n".join(lines), [{"run": k, "s": v} for k, v in rows.items()]
