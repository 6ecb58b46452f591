"""Side-by-side timing: candidates interleaved round by round, medians and ratios."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Mapping

import jax


def interleaved(candidates: Mapping[str, Callable[[], object]], rounds: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each candidate, calls interleaved so drift hits all alike."""
    return {k: statistics.median(v) for k, v in interleaved_samples(candidates, rounds, warmup).items()}


def interleaved_samples(
    candidates: Mapping[str, Callable[[], object]],
    rounds: int,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Seconds of every call of each candidate, calls interleaved round by round.

    ``clock=time.process_time`` counts this process's CPU time instead of wall time: on a
    machine shared with other work it is less disturbed by their scheduling.
    """
    for _ in range(warmup):
        for fn in candidates.values():
            jax.block_until_ready(fn())
    samples: dict[str, list[float]] = {k: [] for k in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            t0 = clock()
            jax.block_until_ready(fn())
            samples[name].append(clock() - t0)
    return samples


def looped(
    candidates: Mapping[str, Callable[[], object]], calls: int = 300, rounds: int = 15, warmup: int = 50
) -> dict[str, float]:
    """Median seconds per call of each candidate, each timed in a loop of its own ``calls`` calls.

    A loop is how a user's training loop calls: one candidate after another warms caches
    (Python's, the CPU's, XLA's thread pool) for the next call as a loop does, which calls
    interleaved one by one do not. The loops are interleaved ``rounds`` times, so drift of
    a shared machine hits every candidate alike; the median of the rounds is given.
    """
    for fn in candidates.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    per_round: dict[str, list[float]] = {k: [] for k in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                jax.block_until_ready(fn())
            per_round[name].append((time.perf_counter() - t0) / calls)
    return {k: statistics.median(v) for k, v in per_round.items()}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


SINGLE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def run_child(module: str, quick: bool, devices: int | None = None, single_thread: bool = True) -> dict:
    """``python -m MODULE --child [--quick]``, by default with single-threaded XLA (one core, as one device per stage).

    ``devices``: that many host CPU devices in the child (``--xla_force_host_platform_device_count``).
    ``single_thread=False`` leaves XLA's threading as it is (an SPMD program over the devices uses the cores).
    Returns the JSON object the child prints as its last line.
    """
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if devices is None or "device_count" not in f]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env = dict(os.environ, XLA_FLAGS=" ".join([*flags, *([SINGLE_THREAD] if single_thread else [])]))
    cmd = [sys.executable, "-m", module, "--child"] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    if proc.returncode != 0:
        raise RuntimeError(f"{module} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def in_child_with_devices(module: str, argv: list[str], devices: int) -> int | None:
    """Outside ``--child``: run ``python -m MODULE --child ARGV`` with ``devices`` host CPU devices (JAX reads the
    flag once, at start) and return its exit code; inside the child: None, so the caller measures."""
    if "--child" in argv:
        return None
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.call([sys.executable, "-m", module, "--child", *argv], env=env)


def run_section(module: str, quick: bool, table, devices: int | None = None) -> tuple[str, list[dict]]:
    """A section measured by ``run_child``: its markdown ``table(data)`` and its rows."""
    data = run_child(module, quick, devices)
    return table(data), data["rows"]


def section_main(
    doc: str | None,
    measure: Callable[[bool], dict],
    run: Callable[[bool], tuple[str, list[dict]]],
    argv: list[str] | None = None,
    report: Callable[[list[dict]], None] | None = None,
) -> int:
    """A ``run_child`` section's command line: ``--child`` measures and prints JSON (what ``run`` reads);
    otherwise run the section and print its markdown, then ``report(rows)`` where given."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the short run CI makes")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.quick)))
        return 0
    text, rows = run(args.quick)
    print(text)
    if report is not None:
        print()
        report(rows)
    return 0
