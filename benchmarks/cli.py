"""CLI wall time and peak memory: warm run-fwd / run-bwd against `python -c "import jax"`, paired round by round.

Targets (issue 14): a repeated `run-fwd` within 1.2× the import floor's wall time
(median of paired runs), and the peak RSS of `run-fwd`/`run-bwd` within 1.3× of
(bytes of its inputs + residuals + the import floor's peak RSS).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, env, cwd) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of one child process."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise RuntimeError(f"{cmd} failed: {err.decode()[-500:]}")
    return wall, usage.ru_maxrss * 1024  # Linux: KiB


def _array_bytes(path: Path) -> int:
    with np.load(path) as z:
        return sum(z[k].nbytes for k in z.files)


def run(quick: bool) -> tuple[str, list[dict]]:
    rounds = 5 if quick else 11
    py = sys.executable
    cli = [py, "-m", "vjpsplit_cli"]
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        env = {**os.environ, "VJPSPLIT_CACHE_DIR": str(d / "cache")}
        subprocess.run([py, "samples/mlp.py", "make-inputs", str(d / "in.npz"), "--batch", "256"], cwd=ROOT,
                       check=True, capture_output=True)
        subprocess.run(cli + ["export", "samples/mlp.py:loss", "--shapes", "params=@samples/mlp.py:param_shapes",
                              "--shapes", "x=f32[b,784]", "--shapes", "labels=i32[b]", "-o", str(d / "mlp.vjps")],
                       cwd=ROOT, env=env, check=True, capture_output=True)

        def fwd(extra=()):
            return _run(cli + [*extra, "run-fwd", str(d / "mlp.vjps"), "--inputs", str(d / "in.npz"),
                               "--residuals", str(d / "r.npz")], env, ROOT)

        def bwd(extra=()):
            return _run(cli + [*extra, "run-bwd", str(d / "mlp.vjps"), "--residuals", str(d / "r.npz"),
                               "--inputs", str(d / "in.npz"), "--grads", str(d / "g.npz")], env, ROOT)

        first = (fwd(), bwd())  # empty caches: lowers, compiles, saves the executables
        s: dict[str, list] = {"floor": [], "run-fwd": [], "run-bwd": [], "run-fwd --no-cache": []}
        for _ in range(rounds):
            s["floor"].append(_run([py, "-c", "import jax"], env, ROOT))
            s["run-fwd"].append(fwd())
            s["run-bwd"].append(bwd())
            s["run-fwd --no-cache"].append(fwd(["--no-cache"]))
        in_bytes, res_bytes = _array_bytes(d / "in.npz"), _array_bytes(d / "r.npz")
    floor_wall = statistics.median(w for w, _ in s["floor"])
    floor_rss = statistics.median(r for _, r in s["floor"])
    rows = []
    for name in ("run-fwd", "run-bwd", "run-fwd --no-cache"):
        walls = [w for w, _ in s[name]]
        paired = statistics.median(w / f for (w, _), (f, _) in zip(s[name], s["floor"]))
        rss = max(r for _, r in s[name])
        rows.append({"run": name, "wall_s": statistics.median(walls), "vs_floor": paired, "peak_rss": rss,
                     "rss_ratio": rss / (floor_rss + in_bytes + res_bytes)})
    lines = [f"Quick-start MLP (samples/mlp.py, 784-256-10), batch 256, artifact for cpu,cuda,tpu; {rounds} paired "
             f"rounds, load average {os.getloadavg()[0]:.1f} when done. Floor: `python -c 'import jax'` "
             f"{floor_wall:.2f} s, peak RSS {floor_rss / 2**20:.0f} MiB; inputs {in_bytes / 2**20:.2f} MiB, "
             f"residuals {res_bytes / 2**20:.2f} MiB. First run (empty caches): run-fwd {first[0][0]:.2f} s, "
             f"run-bwd {first[1][0]:.2f} s.", "",
             "| command (warm) | wall (median) | / import floor, paired (target ≤ 1.2×) | peak RSS "
             "| / (floor RSS + inputs + residuals) (target ≤ 1.3×) |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['wall_s']:.2f} s | {r['vs_floor']:.2f}× | {r['peak_rss'] / 2**20:.0f} MiB "
                     f"| {r['rss_ratio']:.2f}× |")
    return "\n".join(lines), rows
