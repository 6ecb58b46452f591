"""One prepared run for a machine with a GPU or TPU: correctness on the device, then the training
table, offload, fwd+bwd, residual I/O and pipeline benchmarks, written as one JSON and one markdown report.

    bash benchmarks/accelerator.sh [OUTDIR] [--full]      # installs what is missing, then the run below; <= 10 min
    python -m benchmarks --accelerator [--quick] [--full] [--out OUTDIR] [--budget SECONDS]

Steps, in order of worth: the environment (which device jax sees), a correctness pass
(the benchmark workloads exported, saved, loaded and run on the device, outputs and
gradients against ``jax.value_and_grad`` there, plus a residual file round trip and a
symbolic batch size), residuals off the device (the mid GPT's two stages, 1F1B, with and
without offload to the device's ``pinned_host`` memory: the first stage's peak residual
bytes in an untimed step against issue 68's 50%, step times, parameters bitwise;
``benchmarks/offload.py``), training (issue 68's table: a GPT's Trainer steps, 1F1B,
ZB-H1 and auto, against one process doing the same math, and which of the issue's
targets they meet; ``benchmarks/train_accel.py``), fwd+bwd against fused, residual I/O
(host files, and the device-to-file path) and the pipeline schedules (in-process, stages
exported for the device). The last three are no targets: where the budget is spent they
are skipped, each saying so.

Correctness by default runs ``DEFAULT_CASES``: the MLP under ``nothing``, the transformer
block under ``dots`` and the pre-LN block under ``everything`` (each policy once), then the
symbolic batch on the MLP; ``--full`` runs every workload (MLP, transformer, pre-LN
block, conv net) under every policy. Its cost on a TPU is its compiles (a few seconds
each there; the TPU v5e ran the MLP's row in 16 s and the transformer's in 20 s): a row
compiles 3 programs (the reference, the artifact's fwd and bwd; the backward from the
residuals file reuses bwd's, its inputs committed to the device as fwd's are) and checks
the loaded artifact's modules in a child process, about 15-20 s; the symbolic batch
compiles 5 (fwd and bwd at two sizes, the reference at the second), about 20 s: about
70 s of the 180 s the step has at the default budget. Each row says its seconds, its
compiles and its slowest parts; a row past 40% of the step's seconds is cut, says in
which part, and the next row runs.

The report is written when the run starts, when each step starts, with every row as it is
measured, and when each step ends, so a run cut short keeps what it measured. Each step
runs within its share of the budget (correctness a third of it, offload a fifth, every
other step what is left) and is cut there: the report keeps its rows and says ``cut at the
budget after N rows``. A step that would not fit in what is left of the budget is
skipped; a step that fails says why (the exception and its traceback) and the next one
runs.

``passed`` is true only when correctness passed (ran to its end, every row passing) and
every one of issue 68's targets was measured and met: the train step's at widths 1024
and 512 and the offload step's; the report names each target met, missed or not
measured. ``correctness_passed`` is correctness alone; the exit status is 0 when
correctness passed and every step ran.

On a machine without an accelerator the same steps run on the CPU: that is the
smoke test ``python -m benchmarks --quick`` runs (section ``accelerator``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import platform as pyplatform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import jax
import numpy as np

import vjpsplit_cli as vs
from benchmarks.timing import interleaved
from benchmarks.workloads import ALL, PERF

BUDGET_S = 540  # the Python part; accelerator.sh keeps the whole command within 10 minutes
POLICIES = ("everything", "dots", "nothing")
# Correctness's cases without --full: each policy once, on the workloads the TPU ran fast (a row there is 3
# compiles of a few seconds each and a child process: 15-20 s). Not the conv net: on the TPU v5e the compile of
# its reference (jit of value_and_grad at full f32 precision) alone ran past 67 s, cut there; --full runs it.
DEFAULT_CASES = (("mlp", "nothing"), ("transformer", "dots"), ("block", "everything"))
ROW_SHARE = 0.4  # a correctness row is cut past this share of the step's seconds (the next row still runs)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_COMPILED = [0, 0.0]  # this process's XLA compiles and their seconds so far (``_listen_for_compiles``)
RTOL = 1e-4  # of the largest magnitude, with matmuls at full f32 precision on both sides
# Seconds a step needs at least to be worth starting, full and --quick (compiles dominate on an accelerator).
ESTIMATE = {
    "correctness": (90, 45),
    "offload": (45, 30),
    "train": (150, 60),
    "overhead": (150, 60),
    "io": (60, 25),
    "pipeline": (120, 45),
}
# At most this share of the whole budget; every other step: what is left. Offload runs before training with a
# fifth (its untimed peak is one of issue 68's targets, and training would leave it nothing): 23 compiles on the
# CPU, about 70 s on a TPU; at 540 s, correctness (about 70 s of its 180 on a TPU) and offload leave training
# 250 s at the worst (its TPU run: 230 s).
SHARE = {"correctness": 1 / 3, "offload": 1 / 5}
OPEN_TRIES, OPEN_WAIT_S = 3, 5.0  # a TPU let go by another program just now can refuse the next for seconds


@dataclass(frozen=True)
class Options:
    """What the command line asked for: ``quick`` (fewer rounds and widths) and ``full`` (every correctness case,
    and the accelerator's widths even on a CPU)."""

    quick: bool = False
    full: bool = False


def export_platform() -> str:
    """The ``jax.export`` platform name of the default device: cpu, cuda, rocm or tpu."""
    d = jax.devices()[0]
    if d.platform == "gpu":
        return "rocm" if "rocm" in getattr(d.client, "platform_version", "").lower() else "cuda"
    return d.platform


def accelerator_hardware() -> str | None:
    """What accelerator this machine has, whether or not jax sees it (None: none found)."""
    if shutil.which("nvidia-smi"):
        try:
            got = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
            if got.returncode == 0 and got.stdout.strip():
                return got.stdout.strip().splitlines()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    if Path("/dev/accel0").exists() or Path("/dev/vfio/0").exists():
        return "TPU (device files present)"
    if Path("/dev/kfd").exists():
        return "AMD GPU (/dev/kfd present)"
    return None


def open_devices(tries: int = OPEN_TRIES, wait: float = OPEN_WAIT_S) -> list:
    """jax's devices, asked for again ``wait`` seconds apart up to ``tries`` times where jax cannot open them.

    A TPU that another program (accelerator.sh's probe of jax's backend, say) let go of just now can refuse
    the next program for a few seconds; jax then raises, and keeps only the backends it opened (the CPU), so
    its backends are cleared before asking again.

    Raises:
        RuntimeError: jax's last error, after ``tries`` tries.
    """
    for i in range(tries):
        try:
            return jax.devices()
        except RuntimeError as e:
            if i == tries - 1:
                raise
            print(f"[accelerator] jax could not open the devices ({e}); again in {wait:.0f} s", file=sys.stderr)
            from jax._src import xla_bridge

            getattr(xla_bridge, "_clear_backends", lambda: None)()
            time.sleep(wait)
    raise AssertionError("unreachable")


def environment() -> tuple[str, dict]:
    """Which devices jax sees, and whether it missed an accelerator that is there."""
    from vjpsplit_cli.safeio import checksum

    devs = open_devices()
    hw = accelerator_hardware()
    info = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "platform": export_platform(),
        "devices": [f"{d.device_kind} ({d.platform}:{d.id})" for d in devs],
        "device_count": len(devs),
        "hardware": hw,
        "vjpsplit": vs.__version__,
        "crc32": checksum.BACKEND,
        "python": pyplatform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    if hw and info["backend"] == "cpu":
        info["warning"] = (
            f"this machine has {hw} but jax runs on the CPU: install jax's plugin for it "
            "(accelerator.sh does, e.g. jax[cuda12]) and run again"
        )
    lines = ["| what | value |", "|---|---|"]
    lines += [f"| {k} | {', '.join(v) if isinstance(v, list) else v} |" for k, v in info.items()]
    return "\n".join(lines), info


class StepLog:
    """One step's entry in the report while it runs: each row added, and what it is doing, is written at once."""

    def __init__(self, step: dict, write: Callable[[], None]):
        self.step, self._write = step, write
        step.setdefault("rows", [])

    def add(self, *rows: dict) -> None:
        """Add measured rows to the step and write the report."""
        self.step["rows"].extend(rows)
        self._write()

    def doing(self, what: str | None) -> None:
        """Say what the step measures next (in the report while it runs; a run that dies there says it)."""
        self.step["doing"] = what
        self._write()

    def note(self, **fields: object) -> None:
        """Set fields of the step's entry (``targets``, say) and write the report."""
        self.step.update(fields)
        self._write()


def _rel_err(got, want) -> float:
    """Largest |got - want| over the tree, relative to the largest |want| (1 where want is all zeros)."""
    pairs = zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))
    err = scale = 0.0
    for g, w in pairs:
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape:
            return math.inf
        err = max(err, float(np.max(np.abs(g - w), initial=0.0)))
        scale = max(scale, float(np.max(np.abs(w), initial=0.0)))
    return err / (scale or 1.0)


def _on_device(tree, plat: str) -> bool:
    want = {"cuda": "gpu", "rocm": "gpu"}.get(plat, plat)
    return all(
        d.platform == want
        for leaf in jax.tree_util.tree_leaves(tree)
        if isinstance(leaf, jax.Array)
        for d in leaf.devices()
    )


def correctness_cases(opts: Options) -> list[tuple[Callable, str]]:
    """The (workload, policy) pairs correctness runs: ``DEFAULT_CASES`` (each policy once); ``--full``: every
    workload under every policy."""
    makes = {m.__name__: m for m in (*ALL, *PERF)}
    if opts.full:
        return [(m, p) for m in makes.values() for p in POLICIES]
    return [(makes[name], p) for name, p in DEFAULT_CASES]


@functools.cache
def _listen_for_compiles() -> None:
    """From now on, count this process's XLA compiles and their seconds in ``_COMPILED`` (once per process: jax
    0.6 cannot unregister a listener)."""

    def noted(event: str, duration_secs: float, **kwargs: object) -> None:
        if event == COMPILE_EVENT:
            _COMPILED[0] += 1
            _COMPILED[1] += duration_secs

    jax.monitoring.register_event_duration_secs_listener(noted)


class _Parts:
    """One correctness row's parts as it runs them: each part's seconds, and the compiles in the row."""

    def __init__(self, log: StepLog, label: str):
        _listen_for_compiles()
        self.log, self.label, self.seconds = log, label, {}
        self.at, self._compiled = "", tuple(_COMPILED)

    def __call__(self, part: str, fn: Callable[[], object]) -> object:
        """Run ``fn`` as part ``part`` (said in the report's ``doing`` first, so a cut says where), waiting for
        what it dispatched; its seconds go in ``seconds``."""
        self.at = part
        self.log.doing(f"{self.label}: {part}")
        t0 = time.perf_counter()
        got = jax.block_until_ready(fn())
        self.seconds[part] = time.perf_counter() - t0
        return got

    def fields(self) -> dict:
        """The row's ``parts`` (seconds by part), ``compiles`` and ``compile_s`` (XLA's compile seconds)."""
        return {
            "parts": dict(self.seconds),
            "compiles": _COMPILED[0] - self._compiled[0],
            "compile_s": _COMPILED[1] - self._compiled[1],
        }


def _specs(tree):
    """``tree``'s arrays as ``jax.ShapeDtypeStruct``s (what ``vs.export`` takes)."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _reference(fn: Callable, wrt: tuple[int, ...], args: tuple) -> tuple:
    """``jax.value_and_grad`` of ``fn`` on ``args``, in one ``jit`` (one compile), on ``args``' device."""
    return jax.jit(jax.value_and_grad(fn, argnums=wrt))(*args)


def correctness(opts: Options, log: StepLog) -> str:
    """Each workload's artifact on the device under its policy, against jax.value_and_grad on the device, then
    one artifact with a symbolic batch size.

    A row compiles 3 programs (the reference, the artifact's fwd and bwd: the backward from the residuals file
    reuses bwd's) and checks the loaded artifact's modules once in a child process; each row's parts, seconds
    and compiles are in it. A row past its share of the step (``ROW_SHARE``) is cut, says in which part, and the
    next one runs."""
    plat = export_platform()
    dev = jax.devices()[0]
    refs: dict[str, tuple] = {}
    row_s = ROW_SHARE * log.step.get("allowed_s", SHARE["correctness"] * BUDGET_S)
    with tempfile.TemporaryDirectory() as d, jax.default_matmul_precision("highest"):
        rows: list[tuple[dict, Callable[[_Parts], dict]]] = [
            (
                {"workload": make.__name__, "policy": policy},
                lambda part, make=make, policy=policy: _correctness_row(make(), policy, dev, plat, Path(d), refs, part),
            )
            for make, policy in correctness_cases(opts)
        ]
        rows.append(
            (
                {"workload": "mlp, batch b", "policy": "everything"},
                lambda part: _symbolic_batch(plat, dev, refs.get("mlp"), part),
            )
        )
        for row, measure in rows:
            part = _Parts(log, f"{row['workload']}, policy {row['policy']}")
            t0 = time.perf_counter()
            try:
                with cut_after(row_s, RowCut):
                    row.update(measure(part))
            except RowCut:
                row.update(ok=False, error=f"cut after {row_s:.0f} s (its share of the step), in: {part.at}")
            except Exception as e:  # reported in the table; the next row still runs
                row.update(ok=False, error=f"{_said(e, 300)} (in: {part.at})")
            row.update(part.fields(), seconds=time.perf_counter() - t0)
            log.add(row)
    return correctness_table(log.step["rows"], plat)


def _correctness_row(w, policy: str, dev, plat: str, d: Path, refs: dict[str, tuple], part: _Parts) -> dict:
    """One workload under one policy: its fields of the row (errors, file check, on device, residual bytes, ok).

    Arguments are committed to ``dev``, and so are the residuals read back from the file: the backward from the
    file then runs bwd's compiled program (uncommitted arrays would be another signature, another compile).
    """
    wrt = tuple(
        i
        for i, a in enumerate(w.args)
        if all(np.issubdtype(x.dtype, np.floating) for x in jax.tree_util.tree_leaves(a))
    )
    args = jax.device_put(w.args, dev)
    if w.name not in refs:
        refs[w.name] = part("reference (jit of value_and_grad: a compile)", lambda: _reference(w.fn, wrt, args))
    want_out, want_g = refs[w.name]
    path = d / f"{w.name}-{policy}.vjps"
    part("export and save", lambda: vs.export(w.fn, *_specs(w.args), wrt=wrt, policy=policy).save(path))
    art = part("load (its modules checked in a child process)", lambda: vs.load(path))
    out, res = part("fwd (a compile)", lambda: art.fwd(*args))
    g = part("bwd (a compile)", lambda: art.bwd(res))
    rpath = d / f"{w.name}-{policy}.npz"
    loaded = part(
        "residuals to a file and back",
        lambda: (vs.save_residuals(rpath, res), vs.load_residuals(rpath, inputs=args))[1],
    )
    g_file = part("bwd from the file's residuals", lambda: art.bwd(jax.device_put(loaded, dev)))
    row = {
        "out_err": _rel_err(out, want_out),
        "grad_err": _rel_err(g, want_g),
        "file_exact": all(np.array_equal(np.asarray(v), np.asarray(loaded.stored[k])) for k, v in res.stored.items()),
        "file_err": _rel_err(g_file, want_g),
        "on_device": _on_device((out, g, g_file), plat),
        "residual_bytes": sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in res.stored.values()),
    }
    row["ok"] = bool(
        row["on_device"] and row["file_exact"] and max(row["out_err"], row["grad_err"], row["file_err"]) <= RTOL
    )
    return row


def correctness_table(rows: list[dict], plat: str) -> str:
    """The markdown of correctness's rows: each with its seconds, its compiles and its slowest parts."""
    lines = [
        f"On `{plat}`, matmuls at full f32 precision on both sides; pass: outputs and gradients within "
        f"{RTOL:g} of the largest magnitude (the backward also from a residuals file, whose arrays must "
        "come back bit for bit), every result on the device.",
        "",
        "| workload | policy | out err | grad err | grad err, residuals from file | file exact | on device "
        "| residuals | ok | seconds | compiles (seconds) | slowest parts |",
        "|---|---|---:|---:|---:|---|---|---:|---|---:|---:|---|",
    ]
    for r in rows:
        spent = f"| {r['seconds']:.1f} | {r.get('compiles', '?')} ({r.get('compile_s', 0.0):.1f} s) | {_slowest(r)} |"
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['policy']} | | | | | | | **failed**: {r['error']} {spent}")
        else:
            mib = "—" if r["residual_bytes"] is None else f"{r['residual_bytes'] / 2**20:.1f} MiB"
            lines.append(
                f"| {r['workload']} | {r['policy']} | {r['out_err']:.1e} | {r['grad_err']:.1e} "
                f"| {'—' if r['file_err'] is None else format(r['file_err'], '.1e')} "
                f"| {'—' if r['file_exact'] is None else r['file_exact']} | {r['on_device']} | {mib} "
                f"| {'ok' if r['ok'] else '**FAILED**'} {spent}"
            )
    return "\n".join(lines)


def _slowest(row: dict, most: int = 2) -> str:
    """A row's ``most`` slowest parts, with their seconds."""
    parts = sorted((row.get("parts") or {}).items(), key=lambda kv: -kv[1])[:most]
    return ", ".join(f"{k}: {v:.1f} s" for k, v in parts)


def _said(e: BaseException, most: int) -> str:
    """An exception in one line: its type and its message, at most ``most`` characters of it."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:most]}"


def _symbolic_batch(plat: str, dev, full_ref: tuple | None, part: _Parts) -> dict:
    """One artifact with a symbolic batch dim, run at two sizes on the device: its fields of the row.

    4 compiles (fwd and bwd at each size) and the reference's at the second size (at the full size, the MLP
    row's reference where it ran)."""
    w = ALL[0]()  # the MLP
    (b,) = jax.export.symbolic_shape("b")
    params, x, labels = w.args
    specs = (_specs(params), jax.ShapeDtypeStruct((b, x.shape[1]), x.dtype), jax.ShapeDtypeStruct((b,), labels.dtype))
    art = part("export", lambda: vs.export(w.fn, *specs, wrt=(0, 1)))
    errs, on_dev = [], True
    for n in (x.shape[0], 7):
        args = jax.device_put((params, x[:n], labels[:n]), dev)
        out, res = part(f"fwd at batch {n} (a compile)", lambda args=args: art.fwd(*args))
        g = part(f"bwd at batch {n} (a compile)", lambda res=res: art.bwd(res))
        if n == x.shape[0] and full_ref is not None:
            want_out, want_g = full_ref
        else:
            want_out, want_g = part(f"reference at batch {n}", lambda args=args: _reference(w.fn, (0, 1), args))
        errs += [_rel_err(out, want_out), _rel_err(g, want_g)]
        on_dev = on_dev and _on_device((out, g), plat)
    return {
        "out_err": max(errs[0::2]),
        "grad_err": max(errs[1::2]),
        "file_err": None,
        "file_exact": None,
        "on_device": on_dev,
        "residual_bytes": None,
        "ok": bool(on_dev and max(errs) <= RTOL),
    }


def device_io(quick: bool) -> tuple[str, list[dict]]:
    """Where a residual file's time goes from the device: device->host, save, load, host->device."""
    w = PERF[1]()  # the pre-LN block
    args = jax.device_put(w.args)
    specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), w.args)
    art = vs.export(w.fn, *specs, wrt=(0, 1))
    _, res = art.fwd(*args)
    nbytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in res.stored.values())
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "r.npz"
        vs.save_residuals(p, res)
        loaded = vs.load_residuals(p, inputs=w.args)
        t = interleaved(
            {
                "device -> host": lambda: jax.device_get(res.stored),
                "save_residuals (device -> file)": lambda: vs.save_residuals(p, res),
                "load_residuals (file -> host)": lambda: vs.load_residuals(p, inputs=w.args),
                "host -> device": lambda: jax.device_put(loaded.stored),
            },
            3 if quick else 15,
        )
    rows = [{"what": k, "s": v, "gib_s": nbytes / v / 2**30} for k, v in t.items()]
    lines = [
        f"The pre-LN block's stored residuals, {nbytes / 2**20:.1f} MiB, on `{export_platform()}`.",
        "",
        "| step | median | throughput |",
        "|---|---:|---:|",
    ]
    lines += [f"| {r['what']} | {r['s'] * 1e3:.2f} ms | {r['gib_s']:.2f} GiB/s |" for r in rows]
    return "\n".join(lines), rows


def io_step(opts: Options, log: StepLog) -> str:
    """Residual file I/O on the host, then from the device."""
    from benchmarks import io as io_bench

    host_table, host_rows = io_bench.run(opts.quick)
    log.add(*host_rows)
    dev_table, dev_rows = device_io(opts.quick)
    log.add(*[dict(r, part="device") for r in dev_rows])
    return host_table + "\n\n" + dev_table


def overhead_step(opts: Options, log: StepLog) -> str:
    """Forward + backward: split and artifact against fused (``benchmarks/overhead.py``)."""
    from benchmarks import overhead

    text, rows = overhead.run(opts.quick)
    log.add(*rows)
    return text


def pipeline_step(opts: Options, log: StepLog) -> str:
    """The pipeline schedules in-process, stages exported for the device (``benchmarks/pipeline.py``, no Ray)."""
    from benchmarks import pipeline

    data = pipeline.measure(opts.quick, platform=export_platform(), ray=False)
    log.add(*data["rows"], *[dict(r, part="B+W") for r in data["bw"]])
    return pipeline.table(data)


def train_step(opts: Options, log: StepLog) -> str:
    """Issue 68's table (``benchmarks/train_accel.py``), one width at a time: its rows and the targets they meet
    are in the report as each width is measured; then the host's time per operation (``benchmarks/untimed.py``). On a CPU backend, the widths of ``--quick`` unless ``--full``
    (the accelerator's widths take many seconds a step on a CPU)."""
    from benchmarks import train_accel, untimed

    plat = export_platform()
    small = opts.quick or (jax.default_backend() == "cpu" and not opts.full)
    cfg = train_accel.config(small, opts.full)
    for width, blocks in cfg["widths"]:
        log.doing(f"GPT width {width}, {blocks} blocks")
        log.add(
            *train_accel.measure_width(
                width, blocks, cfg["rounds"], plat, cfg["seq"], cfg["trial_rounds"], cfg["everything"]
            )
        )
        log.note(targets=train_accel.targets(log.step["rows"]))
        gc.collect()  # this width's Trainers and states off the device before the next
    text = train_accel.table(log.step["rows"], cfg, plat)
    gpt_targets = train_accel.targets(log.step["rows"])
    log.doing("the host's time per operation")
    per_op = untimed.tiny_per_op(10 if opts.quick else 100, plat)  # the tiny stages: dispatch-bound
    log.add(*[dict(r, part="host per operation") for r in per_op])
    log.note(targets=gpt_targets + untimed.per_op_targets(per_op))
    text += "\n\n" + untimed.per_op_table(per_op)
    if small and not opts.quick:
        text += "\n\nOn the CPU, the widths of `--quick` only: `--full` runs the accelerator's."
    return text


def offload_step(opts: Options, log: StepLog) -> str:
    """Residuals off the device: the mid GPT's 2 stages in-process on the visible devices, 1F1B over 8
    microbatches, without offload and with ``InProcess(offload="host")`` (the device's ``pinned_host`` memory on
    a GPU or TPU), peaks, step times, parameters bitwise (``benchmarks/offload.py``); ``--full`` adds residual
    files, GPipe and ZB-H1. Its target (``offload_target``): the first stage's peak residual bytes in an untimed
    step with offload at most ``OFFLOAD_LIMIT`` of its peak without. Its cost is its compiles (23 on the CPU: each
    Trainer's stage programs, update and offload's copies; about 70 s on a TPU), then 2 warm-up steps, 3 rounds
    and a timed step of each candidate."""
    from benchmarks import offload

    if opts.quick:  # offload's own --quick (a small GPT, 4 microbatches)
        cfg = {**offload._config(True), "schedules": ["1f1b"], "offloads": ("none", "host")}
    elif opts.full:
        cfg = {"ms": [8], "schedules": ["1f1b", "gpipe", "zbh1"], "rounds": 5, "block": 1}
    else:
        cfg = {"ms": [8], "schedules": ["1f1b"], "rounds": 3, "block": 1, "offloads": ("none", "host")}
    log.doing(f"the mid GPT, {', '.join(cfg['schedules'])}, m={cfg['ms'][0]}: with and without offload")
    data = offload.measure(opts.quick, platform=export_platform(), cfg=cfg)
    log.add(*[dict(r, part="offload") for r in data["rows"]])
    log.note(targets=[offload_target(data["rows"])])
    return offload.table(data) + "\n\n" + targets_table(log.step["targets"])


OFFLOAD_LIMIT = 0.5  # issue 68: offload to host holds at most half the first stage's peak residual bytes
OFFLOAD_TARGET = (
    f"an untimed step (1F1B) with offload to host holds at most {OFFLOAD_LIMIT:.0%} of the first stage's peak "
    "residual bytes without it"
)


def offload_target(rows: list[dict]) -> dict:
    """Issue 68's offload target against the offload step's rows: the first 1F1B row's untimed stage-0 peaks,
    with offload to host against without (``met`` None where not measured)."""
    row = next((r for r in rows if r["schedule"] == "1f1b" and "host" in r and "none" in r), None)
    value = None
    if row is not None and row["none"]["peaks_untimed"][0] > 0:
        value = row["host"]["peaks_untimed"][0] / row["none"]["peaks_untimed"][0]
    return {
        "target": OFFLOAD_TARGET,
        "value": value,
        "limit": OFFLOAD_LIMIT,
        "met": None if value is None else bool(value <= OFFLOAD_LIMIT),
        "unit": "of the peak",
    }


def targets_table(targets: list[dict]) -> str:
    """The markdown of targets: each with what was measured, its limit and whether it was met."""
    lines = ["| target | measured | limit | met |", "|---|---:|---:|---|"]
    for t in targets:
        pct = t.get("unit") == "of the peak"
        fmt = (lambda v: f"{v:.0%}") if pct else (lambda v: f"{v:.2f}×")
        value = "not measured" if t["value"] is None else fmt(t["value"])
        met = "not measured" if t["met"] is None else ("met" if t["met"] else "**missed**")
        lines.append(f"| {t['target']} | {value} | {fmt(t['limit'])} | {met} |")
    return "\n".join(lines)


def required_targets() -> list[str]:
    """Issue 68's targets a passing report has measured and met: the train step's at the accelerator's widths
    (``benchmarks/train_accel.py``'s ``targets``, as it names them when every candidate was measured) and the
    offload step's."""
    from benchmarks import train_accel

    every = [
        {"width": w, "blocks": b, "key": k, "ms": 1.0, "ratio": 1.0}
        for w, b in train_accel.WIDTHS
        for k in train_accel.CANDIDATES
    ]
    try:
        train = [t["target"] for t in train_accel.targets(every)]
    except Exception as e:  # rows it needs more of: a target no report meets, naming why (the report is still written)
        train = [f"the train step's targets (not listed: {_said(e, 200)})"]
    return [*train, OFFLOAD_TARGET]


def verdict(report: dict) -> dict:
    """Whether the report passes issue 68: correctness ran to its end with every row passing, and every target
    in ``required_targets`` (and any other a step reported) was measured and met.

    Returns:
        passed, correctness_passed, and the targets by outcome (met, missed, not_measured: their names).
    """
    got = {t["target"]: t for t in report["targets"]}
    names = list(dict.fromkeys([*required_targets(), *got]))
    out: dict = {"met": [], "missed": [], "not_measured": []}
    for n in names:
        met = got[n]["met"] if n in got else None
        out["not_measured" if met is None else "met" if met else "missed"].append(n)
    out["correctness_passed"] = bool(report.get("correctness_passed"))
    out["passed"] = out["correctness_passed"] and not out["missed"] and not out["not_measured"]
    return out


STEPS: dict[str, tuple[str, Callable[[Options, StepLog], str]]] = {
    "correctness": ("Correctness on the device (artifacts vs jax.value_and_grad)", correctness),
    "offload": ("Residuals off the device (pinned_host on an accelerator): peaks and step times", offload_step),
    "train": ("Training: the Trainer's step against one process doing the same math (issue 68)", train_step),
    "overhead": ("Forward + backward: split and artifact vs fused", overhead_step),
    "io": ("Residual file I/O", io_step),
    "pipeline": ("Pipeline schedules, stages exported for the device (in-process, no Ray)", pipeline_step),
}


class StepCut(BaseException):
    """A step ran past its share of the budget (raised by ``cut_after``'s alarm; not an ``Exception``, so the
    step's own handlers of failed rows let it through)."""


class RowCut(BaseException):
    """A correctness row ran past its share of the step (``cut_after``'s alarm inside the step's)."""


_ALARMS: list[dict] = []  # the open ``cut_after`` blocks, outermost first: each its deadline, exception, fired


def _arm() -> None:
    """Set the interval timer for the nearest deadline of the open ``cut_after`` blocks that have not fired (none
    left: no timer; a fired block's exception is on its way out)."""
    left = [a["at"] for a in _ALARMS if not a["fired"]]
    signal.setitimer(signal.ITIMER_REAL, max(min(left) - time.monotonic(), 1e-3) if left else 0)


@contextmanager
def cut_after(seconds: float, cut: type[BaseException] = StepCut) -> Iterator[dict]:
    """Raise ``cut`` in this thread ``seconds`` from now (SIGALRM; where there is none, or off the main thread,
    nothing). Blocks nest: an outer block's deadline still holds inside an inner one, and where both are due the
    outer one's exception is raised. Yields a dict whose ``fired`` says whether this block's alarm went off."""
    state = {"fired": False, "at": time.monotonic() + max(seconds, 1e-3), "cut": cut}
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield state
        return

    def fire(signum: int, frame: object) -> None:
        due = [a for a in _ALARMS if not a["fired"] and a["at"] <= time.monotonic() + 0.005]
        if not due:  # early by the clocks' difference: wait for it
            _arm()
            return
        due[0]["fired"] = True
        raise due[0]["cut"]()

    old = signal.signal(signal.SIGALRM, fire) if not _ALARMS else None
    _ALARMS.append(state)
    _arm()
    try:
        yield state
    finally:
        _ALARMS.remove(state)
        if _ALARMS:
            _arm()
        else:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def _plain(value):
    """JSON-safe: numpy scalars as Python numbers, non-finite floats as null."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def rows_table(rows: list[dict]) -> str:
    """Rows as they are, a markdown table over their scalar fields: a step's rows before its own table exists."""
    keys = list(dict.fromkeys(k for r in rows for k, v in r.items() if not isinstance(v, (list, dict))))

    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def verdict_text(report: dict) -> str:
    """The report's verdict in words: passed or not, correctness, and issue 68's targets met, missed and not
    measured (each named)."""
    met, missed, unmeasured = (report.get(k, []) for k in ("met", "missed", "not_measured"))
    lines = [
        f"**passed: {'true' if report.get('passed') else 'false'}**: correctness "
        f"{'passed' if report.get('correctness_passed') else 'did NOT pass'}; issue 68's targets: {len(met)} met, "
        f"{len(missed)} missed, {len(unmeasured)} not measured."
    ]
    for word, names in (("Missed", missed), ("Not measured", unmeasured)):
        if names:
            lines += ["", f"{word}:", "", *[f"- {n}" for n in names]]
    return "\n".join(lines)


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"# vjpsplit on `{env.get('platform', '?')}`",
        "",
        f"Command: `{report['command']}`; {report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget.",
        "",
        verdict_text(report),
        "",
    ]
    if report.get("error"):
        lines += [f"**The run could not start:** `{report['error']}`", ""]
    if env.get("warning"):
        lines += [f"**Warning:** {env['warning']}.", ""]
    lines += ["## Environment", "", report.get("environment_table", ""), ""]
    for s in report["steps"]:
        lines += [f"## {s['title']}", ""]
        rows = s.get("rows") or []
        if s["status"] == "ok":
            lines += [s["table"], "", f"_({s['seconds']:.0f} s)_", ""]
            continue
        if s["status"] == "skipped":
            lines += [f"Skipped: {s['why']}.", ""]
            continue
        if s["status"] == "running":
            lines += [
                f"**Running** (or the process ended in it): {s.get('doing') or 'starting'}; {len(rows)} rows so far.",
                "",
            ]
        elif s["status"] == "cut":
            lines += [f"**Cut**: {s['why']} ({s['seconds']:.0f} s; it was at: {s.get('doing') or '—'}).", ""]
        else:
            lines += [f"**Failed** after {s['seconds']:.0f} s: `{s['error']}`", ""]
        if rows:
            lines += [rows_table(rows), ""]
        if s.get("traceback"):
            lines += ["```", s["traceback"], "```", ""]
    return "\n".join(lines)


def run_all(opts: Options, budget: float, out: Path | None, command: str) -> dict:
    """Every step within ``budget`` seconds; the report (JSON + markdown under ``out``) written as it goes.

    Each step runs within its share of the budget (``SHARE``; otherwise what is left) and is cut there
    (``StepCut``), keeping its rows; one that would not fit (``ESTIMATE``) is skipped; a failed one says why.
    ``correctness_passed``: correctness ran to its end and every row of it passed; ``passed`` (``verdict``): that,
    and every one of issue 68's targets measured and met (``met``, ``missed``, ``not_measured`` list them).
    """
    t_start = time.perf_counter()
    report: dict = {
        "command": command,
        "budget_s": budget,
        "quick": opts.quick,
        "full": opts.full,
        "environment": {},
        "steps": [],
        "targets": [],
        "passed": False,
        "correctness_passed": False,
        "seconds": 0.0,
    }

    def write() -> None:
        report["seconds"] = time.perf_counter() - t_start
        report["targets"] = [t for s in report["steps"] for t in s.get("targets", [])]
        report.update(verdict(report))
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            for name, text in (
                ("accelerator.json", json.dumps(_plain(report), indent=1) + "\n"),
                ("accelerator.md", markdown(report)),
            ):
                tmp = out / f".{name}.part"
                tmp.write_text(text)
                tmp.replace(out / name)

    write()  # before jax opens a device: a run that cannot start still leaves a report
    try:
        report["environment_table"], report["environment"] = environment()
    except Exception as e:
        report.update(error=_said(e, 1000), traceback=traceback.format_exc()[-4000:])
        print(f"[accelerator] the run could not start: {report['error']}", file=sys.stderr)
        write()
        return report
    write()
    for name, (title, fn) in STEPS.items():
        left = budget - (time.perf_counter() - t_start)
        need = ESTIMATE[name][1 if opts.quick else 0]
        allowed = min(left, SHARE.get(name, 1.0) * budget)
        step: dict = {"name": name, "title": title}
        report["steps"].append(step)
        if left < need:
            step.update(status="skipped", why=f"{left:.0f} s of the budget left, the step needs up to {need} s")
            write()
            continue
        step.update(status="running", allowed_s=allowed)
        log = StepLog(step, write)
        write()
        t0 = time.perf_counter()
        stop, alarm = False, {"fired": False}
        try:
            with cut_after(allowed) as alarm:
                text = fn(opts, log)
            step.update(status="ok", table=text)
        except KeyboardInterrupt:  # accelerator.sh's timeout: keep what was measured and stop
            step.update(status="cut", why=f"interrupted (out of time) after {len(step['rows'])} rows")
            stop = True
        except BaseException as e:  # the step's cut, or its failure: either is reported
            if alarm["fired"]:  # StepCut, or what the code it hit made of it
                step.update(
                    status="cut",
                    why=f"cut at the budget after {len(step['rows'])} rows ({allowed:.0f} s for this step)",
                )
            else:
                step.update(status="failed", error=_said(e, 500), traceback=traceback.format_exc()[-4000:])
        step["seconds"] = time.perf_counter() - t0
        print(f"[accelerator] {name}: {step['status']} in {step['seconds']:.0f} s", file=sys.stderr)
        if name == "correctness":
            report["correctness_passed"] = (
                step["status"] == "ok" and bool(step["rows"]) and all(r["ok"] for r in step["rows"])
            )
        write()
        if stop:
            break
    write()
    return report


def run(quick: bool) -> tuple[str, list[dict]]:
    """The benchmark suite's section: every step on this machine's default device; fails if anything did."""
    report = run_all(
        Options(quick=quick), BUDGET_S, None, f"python -m benchmarks{' --quick' if quick else ''} --only accelerator"
    )
    bad = [s["name"] for s in report["steps"] if s["status"] != "ok"]
    if bad or not report["correctness_passed"]:
        raise RuntimeError(
            f"accelerator run: correctness {'passed' if report['correctness_passed'] else 'FAILED'}, steps not ok: "
            f"{bad}\n{markdown(report)}"
        )
    text = markdown(report).split("\n", 2)[2]  # without its own heading: run.py gives the section's
    return text.replace("\n## ", "\n#### "), [s for s in report["steps"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds and a small width: proves the run works")
    ap.add_argument(
        "--full",
        action="store_true",
        help="correctness of every workload under every policy (default: each workload once, the policies in turn)",
    )
    ap.add_argument(
        "--out",
        default="accelerator-report",
        help="directory for accelerator.json and accelerator.md (default: accelerator-report)",
    )
    ap.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for all steps (default {BUDGET_S})")
    args = ap.parse_args(argv)
    command = (
        "python -m benchmarks --accelerator" + (" --quick" if args.quick else "") + (" --full" if args.full else "")
    )
    report = run_all(Options(quick=args.quick, full=args.full), args.budget, Path(args.out), command)
    print(markdown(report))
    print(f"[accelerator] report: {Path(args.out) / 'accelerator.md'} and accelerator.json", file=sys.stderr)
    ok = report["correctness_passed"] and all(s["status"] == "ok" for s in report["steps"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
