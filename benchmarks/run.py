"""Run the benchmarks and write a markdown report.

    python -m benchmarks [--quick] [--only economy,...] [--out benchmarks/RESULTS.md]
    python -m benchmarks --accelerator [--quick] [--full] [--out DIR] [--budget S]   # benchmarks/accelerator.py

Every comparison is measured side by side in one process, candidates interleaved
round by round, and reported as medians and ratios. Wall-clock numbers belong
here, never in tests.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/run.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

SECTIONS = {
    "overhead": ("Forward + backward: split and artifact vs fused", "benchmarks.overhead"),
    "calls": ("One artifact call: fwd + bwd on a tiny function vs one jit call", "benchmarks.calls"),
    "auto": ("policy=\"auto\" vs the fixed policies", "benchmarks.auto"),
    "conv": ("The conv gap: where split fwd+bwd loses to fused", "benchmarks.conv"),
    "schedule": ("F1 F2 B2 B1 vs recompute", "benchmarks.schedule"),
    "io": ("Residual file I/O", "benchmarks.io"),
    "bindings": ("Binding residuals to their inputs (CRC-32)", "benchmarks.bindings"),
    "economy": ("Residual economy (policies)", "benchmarks.economy"),
    "cli": ("CLI wall time", "benchmarks.cli"),
    "pipeline": ("Pipeline schedules on 2 workers", "benchmarks.pipeline"),
    "autoschedule": ("Automatic schedules on the grid (modeled)", "benchmarks.autoschedule"),
    "train": ("Training steps: Trainer vs one process", "benchmarks.train"),
    "survive": ("Training that survives: checkpoint waits and restarts", "benchmarks.survive"),
    "optimizer_cut": ("The optimizer update cut by stage: its cost on the driver", "benchmarks.optimizer_cut"),
    "sharded": ("Sharded stages on 8 CPU devices", "benchmarks.sharded"),
    "data_parallel": ("Data parallel x pipeline on 8 CPU devices", "benchmarks.data_parallel"),
    # On a CPU-only machine, the accelerator command's own smoke test.
    "accelerator": ("The one-shot accelerator run, on this machine's default device", "benchmarks.accelerator"),
    "zbscan": ("Zero bubble inside scan: B then W vs fused", "benchmarks.zbscan"),
    "offload": ("Residuals off the device: peak residual bytes and step time", "benchmarks.offload"),
    "multihost": ("Multi-host on jax.distributed: 2 processes vs one, on the same devices", "benchmarks.multihost"),
}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, jax {jax.__version__}, "
        f"backend {jax.default_backend()}"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few rounds: proves the suite runs, numbers are rough")
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections: " + ", ".join(SECTIONS))
    ap.add_argument(
        "--out",
        default=None,
        help="write the markdown report here (default: print only); "
        "with --accelerator, the directory for its JSON and markdown reports",
    )
    ap.add_argument(
        "--accelerator",
        action="store_true",
        help="the one-shot GPU/TPU run (benchmarks/accelerator.sh installs what it needs first)",
    )
    ap.add_argument("--budget", type=float, default=None, help="with --accelerator: seconds for all its steps")
    ap.add_argument(
        "--full",
        action="store_true",
        help="with --accelerator: correctness of every workload under every policy, the accelerator's widths on a CPU",
    )
    args = ap.parse_args(argv)
    import importlib

    if args.accelerator:
        from benchmarks import accelerator

        return accelerator.main(
            (["--quick"] if args.quick else [])
            + (["--full"] if args.full else [])
            + (["--out", args.out] if args.out else [])
            + (["--budget", str(args.budget)] if args.budget is not None else [])
        )

    parts = [f"Machine: {machine()}. Command: `python -m benchmarks{' --quick' if args.quick else ''}`.", ""]
    for key in args.only.split(","):
        title, module = SECTIONS[key.strip()]
        t0 = time.perf_counter()
        table, _ = importlib.import_module(module).run(args.quick)
        parts += [f"### {title}", "", table, "", f"_({time.perf_counter() - t0:.0f} s)_", ""]
        print(f"[{key}] done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    report = "\n".join(parts)
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
