"""One prepared run for a machine with a GPU or TPU: correctness on the device, then the fwd+bwd,
residual I/O, pipeline, training and offload benchmarks, written as one JSON and one markdown report.

    bash benchmarks/accelerator.sh [OUTDIR]      # installs what is missing, then the run below; <= 10 min
    python -m benchmarks --accelerator [--quick] [--out OUTDIR] [--budget SECONDS]

Steps, in order of worth: the environment (which device jax sees), a correctness pass
(every benchmark workload exported, saved, loaded and run on the device under each
policy, outputs and gradients against ``jax.value_and_grad`` there, plus a residual
file round trip and a symbolic batch size), fwd+bwd against fused, residual I/O (host
files, and the device-to-file path), the pipeline schedules (in-process, stages
exported for the device), and training across every visible device (a GPT cut into one
stage per device, the Trainer's step against the ideal pipelined step, and the runner's
own cost per operation; ``benchmarks/train.py``), and residuals off the device (the mid GPT's
two stages with and without offload to the device's ``pinned_host`` memory: peak residual bytes,
step times, parameters bitwise; ``benchmarks/offload.py``). A step that would not fit in what is left of the budget is
skipped; a step that fails is reported and the next one runs. The report is rewritten
after every step, so a run cut short still leaves what it measured.

On a machine without an accelerator the same steps run on the CPU: that is the
smoke test ``python -m benchmarks --quick`` runs (section ``accelerator``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform as pyplatform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import numpy as np

import vjpsplit_cli as vs
from benchmarks import io as io_bench
from benchmarks import offload, overhead, pipeline, train
from benchmarks.timing import interleaved
from benchmarks.workloads import ALL, PERF

BUDGET_S = 540  # the Python part; accelerator.sh keeps the whole command within 10 minutes
POLICIES = ("everything", "dots", "nothing")
RTOL = 1e-4  # of the largest magnitude, with matmuls at full f32 precision on both sides
# Seconds each step is expected to take at most on an accelerator (compiles dominate), full and --quick.
ESTIMATE = {
    "correctness": (90, 45),
    "overhead": (150, 60),
    "io": (60, 25),
    "pipeline": (120, 45),
    "train": (120, 60),
    "offload": (90, 45),
}


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


def environment(quick: bool) -> tuple[str, dict]:
    """Which devices jax sees, and whether it missed an accelerator that is there."""
    from vjpsplit_cli.safeio import checksum

    devs = jax.devices()
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


def correctness(quick: bool) -> tuple[str, list[dict]]:
    """Each workload's artifact on the device under each policy, against jax.value_and_grad on the device."""
    plat = export_platform()
    rows = []
    with tempfile.TemporaryDirectory() as d, jax.default_matmul_precision("highest"):
        for make in {m.__name__: m for m in (*ALL, *PERF)}.values():
            w = make()
            wrt = tuple(
                i
                for i, a in enumerate(w.args)
                if all(np.issubdtype(x.dtype, np.floating) for x in jax.tree_util.tree_leaves(a))
            )
            args = jax.device_put(w.args)
            specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), w.args)
            want_out, want_g = jax.jit(jax.value_and_grad(w.fn, argnums=wrt))(*args)
            for policy in POLICIES[:1] if quick else POLICIES:
                t0 = time.perf_counter()
                row = {"workload": w.name, "policy": policy}
                try:
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
                    row.update(ok=False, error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
                row["seconds"] = time.perf_counter() - t0
                rows.append(row)
        rows.append(_symbolic_batch(plat))
    lines = [
        f"On `{plat}`, matmuls at full f32 precision on both sides; pass: outputs and gradients within "
        f"{RTOL:g} of the largest magnitude (the backward also from a residuals file, whose arrays must "
        "come back bit for bit), every result on the device.",
        "",
        "| workload | policy | out err | grad err | grad err, residuals from file | file exact | on device "
        "| residuals | ok |",
        "|---|---|---:|---:|---:|---|---|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['policy']} | | | | | | | **failed**: {r['error']} |")
        else:
            mib = "—" if r["residual_bytes"] is None else f"{r['residual_bytes'] / 2**20:.1f} MiB"
            lines.append(
                f"| {r['workload']} | {r['policy']} | {r['out_err']:.1e} | {r['grad_err']:.1e} "
                f"| {'—' if r['file_err'] is None else format(r['file_err'], '.1e')} "
                f"| {'—' if r['file_exact'] is None else r['file_exact']} | {r['on_device']} | {mib} "
                f"| {'ok' if r['ok'] else '**FAILED**'} |"
            )
    return "\n".join(lines), rows


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
        row.update(ok=False, error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
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


def io_step(quick: bool) -> tuple[str, list[dict]]:
    host_table, host_rows = io_bench.run(quick)
    dev_table, dev_rows = device_io(quick)
    return host_table + "\n\n" + dev_table, host_rows + [dict(r, part="device") for r in dev_rows]


def pipeline_step(quick: bool) -> tuple[str, list[dict]]:
    data = pipeline.measure(quick, platform=export_platform(), ray=False)
    return pipeline.table(data), data["rows"] + [dict(r, part="B+W") for r in data["bw"]]


def train_step(quick: bool) -> tuple[str, list[dict]]:
    """The Trainer across every visible device (one stage each, at least 2 stages), in-process, against the ideal."""
    p = max(2, len(jax.local_devices()))
    cfg = {
        "tiny_rounds": 3 if quick else 6,
        "tiny_block": 2,
        "widths": [64] if quick else [256, 1024],
        "gpt_rounds": 2 if quick else 4,
        "gpt_block": 1,
        "devices": p,
    }
    data = train.measure(quick, platform=export_platform(), ray=False, cfg=cfg)
    return train.table(data), data["rows"] + [dict(r, part="tiny") for r in data["tiny"]["rows"]]


def offload_step(quick: bool) -> tuple[str, list[dict]]:
    """Residuals off the device: the mid GPT's 2 stages in-process on the visible devices, with and without
    offload (``"host"`` is the device's ``pinned_host`` memory on a GPU or TPU), peaks, step times, bitwise."""
    cfg = {"ms": [8], "schedules": ["gpipe"] if quick else ["gpipe", "1f1b", "zbh1"], "rounds": 2 if quick else 5}
    data = offload.measure(quick, platform=export_platform(), cfg={**cfg, "block": 1})
    return offload.table(data), [dict(r, part="offload") for r in data["rows"]]


STEPS = {
    "correctness": ("Correctness on the device (artifacts vs jax.value_and_grad)", correctness),
    "overhead": ("Forward + backward: split and artifact vs fused", overhead.run),
    "io": ("Residual file I/O", io_step),
    "pipeline": ("Pipeline schedules, stages exported for the device (in-process, no Ray)", pipeline_step),
    "train": ("Training across every visible device: the Trainer against the ideal pipelined step", train_step),
    "offload": ("Residuals off the device (pinned_host on an accelerator): peaks and step times", offload_step),
}


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


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"# vjpsplit on `{env.get('platform', '?')}`",
        "",
        f"Command: `{report['command']}`; {report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget; "
        f"correctness {'passed' if report['passed'] else 'FAILED'}.",
        "",
    ]
    if env.get("warning"):
        lines += [f"**Warning:** {env['warning']}.", ""]
    lines += ["## Environment", "", report["environment_table"], ""]
    for s in report["steps"]:
        lines += [f"## {s['title']}", ""]
        if s["status"] == "ok":
            lines += [s["table"], "", f"_({s['seconds']:.0f} s)_", ""]
        elif s["status"] == "skipped":
            lines += [f"Skipped: {s['why']}.", ""]
        else:
            lines += [f"**Failed** after {s['seconds']:.0f} s: `{s['error']}`", "", "```", s["traceback"], "```", ""]
    return "\n".join(lines)


def run_all(quick: bool, budget: float, out: Path | None, command: str) -> dict:
    """Every step within ``budget`` seconds; the report (JSON + markdown under ``out``) after each."""
    t_start = time.perf_counter()
    table, env = environment(quick)
    report = {
        "command": command,
        "budget_s": budget,
        "quick": quick,
        "environment": env,
        "environment_table": table,
        "steps": [],
        "passed": False,
        "seconds": 0.0,
    }

    def write():
        report["seconds"] = time.perf_counter() - t_start
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "accelerator.json").write_text(json.dumps(_plain(report), indent=1) + "\n")
            (out / "accelerator.md").write_text(markdown(report))

    write()
    for name, (title, fn) in STEPS.items():
        left = budget - (time.perf_counter() - t_start)
        need = ESTIMATE[name][1 if quick else 0]
        step = {"name": name, "title": title}
        if left < need:
            step.update(status="skipped", why=f"{left:.0f} s of the budget left, the step needs up to {need} s")
        else:
            t0 = time.perf_counter()
            try:
                text, rows = fn(quick)
                step.update(status="ok", table=text, rows=rows)
            except KeyboardInterrupt:  # accelerator.sh's timeout: keep what was measured
                step.update(status="failed", error="interrupted (out of time)", traceback="")
                report["steps"].append(dict(step, seconds=time.perf_counter() - t0))
                break
            except Exception as e:
                step.update(
                    status="failed",
                    error=f"{type(e).__name__}: {' '.join(str(e).split())[:500]}",
                    traceback=traceback.format_exc()[-4000:],
                )
            step["seconds"] = time.perf_counter() - t0
            print(f"[accelerator] {name}: {step['status']} in {step['seconds']:.0f} s", file=sys.stderr)
        report["steps"].append(step)
        if name == "correctness":
            report["passed"] = step["status"] == "ok" and all(r["ok"] for r in step["rows"])
        write()
    write()
    return report


def run(quick: bool) -> tuple[str, list[dict]]:
    """The benchmark suite's section: every step on this machine's default device; fails if anything did."""
    report = run_all(quick, BUDGET_S, None, f"python -m benchmarks{' --quick' if quick else ''} --only accelerator")
    bad = [s["name"] for s in report["steps"] if s["status"] != "ok"]
    if bad or not report["passed"]:
        raise RuntimeError(
            f"accelerator run: correctness {'passed' if report['passed'] else 'FAILED'}, steps not ok: "
            f"{bad}\n{markdown(report)}"
        )
    text = markdown(report).split("\n", 2)[2]  # without its own heading: run.py gives the section's
    return text.replace("\n## ", "\n#### "), [s for s in report["steps"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds and one policy: proves the run works")
    ap.add_argument(
        "--out",
        default="accelerator-report",
        help="directory for accelerator.json and accelerator.md (default: accelerator-report)",
    )
    ap.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for all steps (default {BUDGET_S})")
    args = ap.parse_args(argv)
    command = "python -m benchmarks --accelerator" + (" --quick" if args.quick else "")
    report = run_all(args.quick, args.budget, Path(args.out), command)
    print(markdown(report))
    print(f"[accelerator] report: {Path(args.out) / 'accelerator.md'} and accelerator.json", file=sys.stderr)
    return 0 if report["passed"] and all(s["status"] == "ok" for s in report["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
