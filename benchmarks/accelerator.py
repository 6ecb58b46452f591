"""One prepared run for a machine with a GPU or TPU: correctness on the device, then the training
table, offload, fwd+bwd, residual I/O and pipeline benchmarks, written as one JSON and one markdown report.

    bash benchmarks/accelerator.sh [OUTDIR] [--full]      # installs what is missing, then the run below; <= 10 min
    python -m benchmarks --accelerator [--quick] [--full] [--out OUTDIR] [--budget SECONDS]

Steps, in order of worth: the environment (which device jax sees), a correctness pass
(the benchmark workloads exported, saved, loaded and run on the device, outputs and
gradients against ``jax.value_and_grad`` there, plus a residual file round trip and a
symbolic batch size: each workload under one policy, the policies taken in turn;
``--full``: every workload under every policy), training (issue 68's table: a GPT's
Trainer steps, 1F1B, ZB-H1 and auto, against one process doing the same math, and which
of the issue's targets they meet; ``benchmarks/train_accel.py``), residuals off the device
(the mid GPT's two stages with and without offload to the device's ``pinned_host``
memory: peak residual bytes, step times, parameters bitwise; ``benchmarks/offload.py``),
fwd+bwd against fused, residual I/O (host files, and the device-to-file path) and the
pipeline schedules (in-process, stages exported for the device).

The report is written when the run starts, when each step starts, with every row as it is
measured, and when each step ends, so a run cut short keeps what it measured. Each step
runs within its share of the budget (correctness a third of it, every other step what
is left) and is cut there: the report keeps its rows and says ``cut at the budget after N
rows``. A step that would not fit in what is left of the budget is skipped; a step that
fails says why (the exception and its traceback) and the next one runs.

On a machine without an accelerator the same steps run on the CPU: that is the
smoke test ``python -m benchmarks --quick`` runs (section ``accelerator``).
"""

from __future__ import annotations

import argparse
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
RTOL = 1e-4  # of the largest magnitude, with matmuls at full f32 precision on both sides
# Seconds a step needs at least to be worth starting, full and --quick (compiles dominate on an accelerator).
ESTIMATE = {
    "correctness": (90, 45),
    "train": (150, 60),
    "offload": (90, 45),
    "overhead": (150, 60),
    "io": (60, 25),
    "pipeline": (120, 45),
}
SHARE = {"correctness": 1 / 3}  # at most this share of the whole budget; every other step: what is left
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
    """The (workload, policy) pairs correctness runs: every workload once with the policies taken in turn (so
    every policy runs once at least); ``--full``: every workload under every policy."""
    makes = list({m.__name__: m for m in (*ALL, *PERF)}.values())
    if opts.full:
        return [(m, p) for m in makes for p in POLICIES]
    return [(m, POLICIES[i % len(POLICIES)]) for i, m in enumerate(makes)]


def correctness(opts: Options, log: StepLog) -> str:
    """Each workload's artifact on the device under its policy, against jax.value_and_grad on the device."""
    plat = export_platform()
    refs: dict[str, tuple] = {}
    with tempfile.TemporaryDirectory() as d, jax.default_matmul_precision("highest"):
        for make, policy in correctness_cases(opts):
            w = make()
            log.doing(f"{w.name}, policy {policy}")
            t0 = time.perf_counter()
            row = {"workload": w.name, "policy": policy}
            try:
                wrt = tuple(
                    i
                    for i, a in enumerate(w.args)
                    if all(np.issubdtype(x.dtype, np.floating) for x in jax.tree_util.tree_leaves(a))
                )
                args = jax.device_put(w.args)
                specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), w.args)
                if w.name not in refs:
                    refs[w.name] = jax.jit(jax.value_and_grad(w.fn, argnums=wrt))(*args)
                want_out, want_g = refs[w.name]
                path = Path(d) / f"{w.name}-{policy}.vjps"
                vs.export(w.fn, *specs, wrt=wrt, policy=policy).save(path)
                art = vs.load(path)
                out, res = art.fwd(*args)
                g = art.bwd(res)
                rpath = Path(d) / f"{w.name}-{policy}.npz"
                vs.save_residuals(rpath, res)
                loaded = vs.load_residuals(rpath, inputs=args)
                g_file = art.bwd(jax.device_put(loaded))
                row.update(
                    out_err=_rel_err(out, want_out),
                    grad_err=_rel_err(g, want_g),
                    file_exact=all(
                        np.array_equal(np.asarray(v), np.asarray(loaded.stored[k])) for k, v in res.stored.items()
                    ),
                    file_err=_rel_err(g_file, want_g),
                    on_device=_on_device((out, g, g_file), plat),
                    residual_bytes=sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in res.stored.values()),
                )
                row["ok"] = bool(
                    row["on_device"]
                    and row["file_exact"]
                    and max(row["out_err"], row["grad_err"], row["file_err"]) <= RTOL
                )
            except Exception as e:  # reported in the table; the next workload still runs
                row.update(ok=False, error=_said(e, 300))
            row["seconds"] = time.perf_counter() - t0
            log.add(row)
        log.doing("a symbolic batch size")
        log.add(_symbolic_batch(plat))
    return correctness_table(log.step["rows"], plat)


def correctness_table(rows: list[dict], plat: str) -> str:
    """The markdown of correctness's rows."""
    lines = [
        f"On `{plat}`, matmuls at full f32 precision on both sides; pass: outputs and gradients within "
        f"{RTOL:g} of the largest magnitude (the backward also from a residuals file, whose arrays must "
        "come back bit for bit), every result on the device.",
        "",
        "| workload | policy | out err | grad err | grad err, residuals from file | file exact | on device "
        "| residuals | ok | seconds |",
        "|---|---|---:|---:|---:|---|---|---:|---|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['workload']} | {r['policy']} | | | | | | | **failed**: {r['error']} | {r['seconds']:.1f} |"
            )
        else:
            mib = "—" if r["residual_bytes"] is None else f"{r['residual_bytes'] / 2**20:.1f} MiB"
            lines.append(
                f"| {r['workload']} | {r['policy']} | {r['out_err']:.1e} | {r['grad_err']:.1e} "
                f"| {'—' if r['file_err'] is None else format(r['file_err'], '.1e')} "
                f"| {'—' if r['file_exact'] is None else r['file_exact']} | {r['on_device']} | {mib} "
                f"| {'ok' if r['ok'] else '**FAILED**'} | {r['seconds']:.1f} |"
            )
    return "\n".join(lines)


def _said(e: BaseException, most: int) -> str:
    """An exception in one line: its type and its message, at most ``most`` characters of it."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:most]}"


def _symbolic_batch(plat: str) -> dict:
    """One artifact with a symbolic batch dim, run at two sizes on the device."""
    w = ALL[0]()  # the MLP
    (b,) = jax.export.symbolic_shape("b")
    params, x, labels = w.args
    specs = (
        jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params),
        jax.ShapeDtypeStruct((b, x.shape[1]), x.dtype),
        jax.ShapeDtypeStruct((b,), labels.dtype),
    )
    row = {"workload": f"{w.name}, batch b", "policy": "everything"}
    t0 = time.perf_counter()
    try:
        art = vs.export(w.fn, *specs, wrt=(0, 1))
        errs, on_dev = [], True
        for n in (x.shape[0], 7):
            args = jax.device_put((params, x[:n], labels[:n]))
            out, res = art.fwd(*args)
            g = art.bwd(res)
            want_out, want_g = jax.value_and_grad(w.fn, argnums=(0, 1))(*args)
            errs += [_rel_err(out, want_out), _rel_err(g, want_g)]
            on_dev = on_dev and _on_device((out, g), plat)
        row.update(
            out_err=max(errs[0::2]),
            grad_err=max(errs[1::2]),
            file_err=None,
            file_exact=None,
            on_device=on_dev,
            residual_bytes=None,
            ok=bool(on_dev and max(errs) <= RTOL),
        )
    except Exception as e:
        row.update(ok=False, error=_said(e, 300))
    row["seconds"] = time.perf_counter() - t0
    return row


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
    cfg = train_accel.config(small)
    for width, blocks in cfg["widths"]:
        log.doing(f"GPT width {width}, {blocks} blocks")
        log.add(*train_accel.measure_width(width, blocks, cfg["rounds"], plat, cfg["seq"], cfg["trial_rounds"]))
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
    """Residuals off the device: the mid GPT's 2 stages in-process on the visible devices, with and without
    offload (``"host"`` is the device's ``pinned_host`` memory on a GPU or TPU), peaks, step times, bitwise."""
    from benchmarks import offload

    if opts.quick:  # offload's own --quick (a small GPT), under GPipe
        cfg = {**offload._config(True), "schedules": ["gpipe"]}
    else:
        cfg = {"ms": [8], "schedules": ["gpipe", "1f1b", "zbh1"], "rounds": 5, "block": 1}
    data = offload.measure(opts.quick, platform=export_platform(), cfg=cfg)
    log.add(*[dict(r, part="offload") for r in data["rows"]])
    return offload.table(data)


STEPS: dict[str, tuple[str, Callable[[Options, StepLog], str]]] = {
    "correctness": ("Correctness on the device (artifacts vs jax.value_and_grad)", correctness),
    "train": ("Training: the Trainer's step against one process doing the same math (issue 68)", train_step),
    "offload": ("Residuals off the device (pinned_host on an accelerator): peaks and step times", offload_step),
    "overhead": ("Forward + backward: split and artifact vs fused", overhead_step),
    "io": ("Residual file I/O", io_step),
    "pipeline": ("Pipeline schedules, stages exported for the device (in-process, no Ray)", pipeline_step),
}


class StepCut(BaseException):
    """A step ran past its share of the budget (raised by ``cut_after``'s alarm; not an ``Exception``, so the
    step's own handlers of failed rows let it through)."""


@contextmanager
def cut_after(seconds: float) -> Iterator[dict]:
    """Raise ``StepCut`` in this thread ``seconds`` from now (SIGALRM; where there is none, or off the main
    thread, nothing). Yields a dict whose ``fired`` says whether the alarm went off."""
    state = {"fired": False}
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield state
        return

    def fire(signum: int, frame: object) -> None:
        state["fired"] = True
        raise StepCut()

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield state
    finally:
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


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"# vjpsplit on `{env.get('platform', '?')}`",
        "",
        f"Command: `{report['command']}`; {report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget; "
        f"correctness {'passed' if report['passed'] else 'FAILED'}.",
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
    ``passed``: correctness ran to its end and every row of it passed.
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
        "seconds": 0.0,
    }

    def write() -> None:
        report["seconds"] = time.perf_counter() - t_start
        report["targets"] = next((s["targets"] for s in report["steps"] if "targets" in s), [])
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
            report["passed"] = step["status"] == "ok" and bool(step["rows"]) and all(r["ok"] for r in step["rows"])
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
    if bad or not report["passed"]:
        raise RuntimeError(
            f"accelerator run: correctness {'passed' if report['passed'] else 'FAILED'}, steps not ok: "
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
    ok = report["passed"] and all(s["status"] == "ok" for s in report["steps"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
