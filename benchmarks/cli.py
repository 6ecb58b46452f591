"""CLI wall time and peak memory: warm run-fwd / run-bwd against `python -c "import jax"`, paired round by round.

Targets (issue 14): a repeated `run-fwd` within 1.2× the import floor's wall time
(median of paired runs), and the peak RSS of `run-fwd`/`run-bwd` within 1.3× of
(bytes of its inputs + residuals + the import floor's peak RSS).

Issue 19: the load-time cost of trust (signature verification and the module checks
before compiling, with their verdicts cached as in a repeated command), measured in
one process, against the warm `run-fwd` wall time (target: under 5%); the first load
of an unsigned artifact pays for parsing its modules in a child process.
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


# Peak RSS of a command, reported by the child itself: VmHWM belongs to the memory map that
# exec creates, while ru_maxrss survives exec and so reports this (large) parent's RSS.
_HWM = """
import atexit, os, runpy, sys

def report():
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    with open(os.environ["VJPSPLIT_BENCH_HWM"], "w") as f:
        f.write(str(kib * 1024))

atexit.register(report)
module, sys.argv = sys.argv[1], sys.argv[1:]
if module == "jax":
    import jax
else:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def _run(cmd, env, cwd) -> float:
    """Wall seconds of one child process."""
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{cmd} failed: {r.stderr[-500:]}")
    return time.perf_counter() - t0


def _peak_rss(module: str, args: list, env, cwd) -> float:
    """Peak RSS bytes of ``python -m module args`` (NaN where /proc is missing)."""
    with tempfile.NamedTemporaryFile() as f:
        r = subprocess.run(
            [sys.executable, "-c", _HWM, module, *args],
            env={**env, "VJPSPLIT_BENCH_HWM": f.name},
            cwd=cwd,
            capture_output=True,
            text=True,
        )
        try:
            return float(open(f.name).read()) if r.returncode == 0 else float("nan")
        except ValueError:
            return float("nan")


def _array_bytes(path: Path) -> int:
    with np.load(path) as z:
        return sum(z[k].nbytes for k in z.files)


def run(quick: bool) -> tuple[str, list[dict]]:
    rounds = 1 if quick else 11  # quick proves the section runs (CI)
    py = sys.executable
    cli = [py, "-m", "vjpsplit_cli"]
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        env = {**os.environ, "VJPSPLIT_CACHE_DIR": str(d / "cache")}
        subprocess.run(
            [py, "samples/mlp.py", "make-inputs", str(d / "in.npz"), "--batch", "256"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        subprocess.run(
            cli
            + [
                "export",
                "samples/mlp.py:loss",
                "--shapes",
                "params=@samples/mlp.py:param_shapes",
                "--shapes",
                "x=f32[b,784]",
                "--shapes",
                "labels=i32[b]",
                "-o",
                str(d / "mlp.vjps"),
            ],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
        )

        args = {
            "run-fwd": ["run-fwd", str(d / "mlp.vjps"), "--inputs", str(d / "in.npz"), "--residuals", str(d / "r.npz")],
            "run-bwd": [
                "run-bwd",
                str(d / "mlp.vjps"),
                "--residuals",
                str(d / "r.npz"),
                "--inputs",
                str(d / "in.npz"),
                "--grads",
                str(d / "g.npz"),
            ],
        }
        args["run-fwd --no-cache"] = ["--no-cache", *args["run-fwd"]]
        subprocess.run(cli + ["keygen", "-o", str(d / "key")], cwd=ROOT, env=env, check=True, capture_output=True)
        signed = _signed_copy(d / "mlp.vjps", d / "key", d / "signed.vjps")
        args["run-fwd signed, --trust-key"] = [
            "run-fwd",
            str(signed),
            "--trust-key",
            str(d / "key.pub"),
            "--inputs",
            str(d / "in.npz"),
            "--residuals",
            str(d / "r.npz"),
        ]
        first = {k: _run(cli + args[k], env, ROOT) for k in ("run-fwd", "run-bwd")}  # empty caches
        s: dict[str, list] = {"floor": [], **{k: [] for k in args}}
        for _ in range(rounds):
            s["floor"].append(_run([py, "-c", "import jax"], env, ROOT))
            for k in args:
                s[k].append(_run(cli + args[k], env, ROOT))
        rss = {k: _peak_rss("vjpsplit_cli", args[k], env, ROOT) for k in args}
        floor_rss = _peak_rss("jax", [], env, ROOT)
        in_bytes, res_bytes = _array_bytes(d / "in.npz"), _array_bytes(d / "r.npz")
        trust = _trust_costs(d / "mlp.vjps", signed, d / "key.pub", d / "cache", rounds)
    floor_wall = statistics.median(s["floor"])
    rows = []
    for name in args:
        paired = statistics.median(w / f for w, f in zip(s[name], s["floor"]))
        rows.append(
            {
                "run": name,
                "wall_s": statistics.median(s[name]),
                "vs_floor": paired,
                "peak_rss": rss[name],
                "rss_ratio": rss[name] / (floor_rss + in_bytes + res_bytes),
            }
        )
    lines = [
        f"Quick-start MLP (samples/mlp.py, 784-256-10), batch 256, artifact for cpu,cuda,tpu; {rounds} paired "
        f"rounds, load average {os.getloadavg()[0]:.1f} when done. Floor: `python -c 'import jax'` "
        f"{floor_wall:.2f} s, peak RSS {floor_rss / 2**20:.0f} MiB; inputs {in_bytes / 2**20:.2f} MiB, "
        f"residuals {res_bytes / 2**20:.2f} MiB. First run (empty caches): run-fwd {first['run-fwd']:.2f} s, "
        f"run-bwd {first['run-bwd']:.2f} s.",
        "",
        "| command (warm) | wall (median) | / import floor, paired (target ≤ 1.2×) | peak RSS "
        "| / (floor RSS + inputs + residuals) (target ≤ 1.3×) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['wall_s']:.2f} s | {r['vs_floor']:.2f}× | {r['peak_rss'] / 2**20:.0f} MiB "
            f"| {r['rss_ratio']:.2f}× |"
        )
    warm = statistics.median(s["run-fwd"])
    lines += [
        "",
        "Trust (issue 19), added to every load, measured in one process (median of "
        f"{trust['n']} loads) against the warm run-fwd above ({warm * 1e3:.0f} ms):",
        "",
        "| step | time | / warm run-fwd (target ≤ 5% together) |",
        "|---|---:|---:|",
    ]
    for name in (
        "verify signature",
        "import cryptography (once per command)",
        "module checks, verdicts cached",
        "module checks, first load, signed and trusted (in process)",
        "module checks, first load (child process)",
    ):
        lines.append(f"| {name} | {trust[name] * 1e3:.1f} ms | {100 * trust[name] / warm:.1f}% |")
        rows.append({"run": f"trust: {name}", "wall_s": trust[name], "vs_warm_run_fwd": trust[name] / warm})
    return "\n".join(lines), rows


def _signed_copy(path: Path, key: Path, out: Path) -> Path:
    from vjpsplit_cli.artifact.loading import load

    art = load(path, cache_dir=None)
    art.sign(key)
    art.save(out)
    return out


def _trust_costs(path: Path, signed: Path, pub: Path, cache: Path, rounds: int) -> dict:
    """Seconds of each trust step of a load (median), in this process, on the benchmark's artifact."""
    import msgpack

    from vjpsplit_cli.artifact.loading import load
    from vjpsplit_cli.artifact.manifest import MAGIC
    from vjpsplit_cli.trust import checks, probes, signing, verdicts

    data = signed.read_bytes()
    body = data[len(MAGIC) :]
    top = msgpack.unpackb(body, raw=False)
    keys = signing.trusted_keys(str(pub), env=False)
    art = load(path, cache_dir=str(cache))
    modules = {k: e.mlir_module_serialized for k, e in art._exps.items()}
    out: dict = {"n": 5 * rounds}

    def median(fn) -> float:
        times = []
        for _ in range(out["n"]):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def module_checks(in_process=False, cache_dir=str(cache)):
        found = probes.probe_modules(modules, "bench", in_process=in_process, cache_dir=cache_dir)
        checks.check_modules("bench", art.manifest, art._exps, found, trusted_signer=in_process, allow_kernels=False)

    def cached_checks():
        verdicts.forget_verdicts()  # as in a fresh command: the verdicts come from the cache directory
        module_checks()

    def trusted_checks():
        verdicts.forget_verdicts()
        module_checks(in_process=True, cache_dir=None)  # a first load of a signed, trusted artifact

    def pack(obj):
        return msgpack.packb(obj, use_bin_type=True)

    out["verify signature"] = median(lambda: signing.verify(top, body, "bench", keys, pack))
    out["module checks, verdicts cached"] = median(cached_checks)
    out["module checks, first load, signed and trusted (in process)"] = median(trusted_checks)
    t0 = time.perf_counter()
    verdicts.forget_verdicts()
    module_checks(cache_dir=None)
    out["module checks, first load (child process)"] = time.perf_counter() - t0
    # Once per command that verifies a signature: importing the Ed25519 code, in a fresh process.
    code = (
        "import time; t = time.perf_counter(); "
        "from cryptography.hazmat.primitives.asymmetric import ed25519; print(time.perf_counter() - t)"
    )
    out["import cryptography (once per command)"] = statistics.median(
        float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
        for _ in range(rounds)
    )
    return out
