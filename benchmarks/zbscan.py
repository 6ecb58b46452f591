"""Zero bubble inside scan: B then W against the fused backward, for scanned layers and a GRU.

    python -m benchmarks --only zbscan              # the full run (by hand; about 3 minutes)
    python -m benchmarks.zbscan [--quick]           # the same, this section alone

Stages: an MLP of ``LAYERS`` dense layers under one ``lax.scan`` (stacked weights),
the same layers unrolled (the unscanned reference), and a GRU over time (shared
weights). Each is exported with ``weights="params"`` and timed through the
pipeline's own per-stage calls (one jitted call per op) in a child process pinned
to one CPU with single-threaded XLA, as one device per stage would run it; the candidates are
interleaved round by round and reported as medians. FLOPs are XLA's cost
analysis of the same compiled calls.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from benchmarks.timing import run_section


def _config(quick: bool) -> dict:
    if quick:
        # Proves the section runs (CI): fewer layers and GRU steps to unroll and compile, fewer rounds.
        return {"width": 128, "rows": 32, "layers": 4, "hidden": 64, "steps": 4, "batch": 16, "rounds": 3}
    return {"width": 512, "rows": 128, "layers": 8, "hidden": 256, "steps": 32, "batch": 64, "rounds": 40}


def table(data: dict) -> str:
    """Times and FLOPs of fused, B, W and B then W per stage."""
    c = data["config"]
    lines = [
        f"MLP: {c['layers']} layers of width {c['width']}, {c['rows']} rows. GRU: hidden {c['hidden']}, "
        f"{c['steps']} steps, batch {c['batch']}. One core (the process pinned to one CPU, single-threaded "
        f"XLA); medians of {c['rounds']} "
        "interleaved rounds (wall time; CPU time in as many more rounds); "
        f"load average {data['load']:.1f} when done (other work shares the cores). "
        "FLOPs: XLA's cost analysis with the scans unrolled (it counts a loop body once).",
        "",
        "| stage | fused backward | B | W | B then W | (B then W) / fused | best of each, ratio | CPU time, ratio "
        "| MFLOP fused | MFLOP B + W | FLOPs (B + W) / fused | dot_generals in W (of B's + W's) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['stage']} | {r['fused'] * 1e3:.2f} ms | {r['B'] * 1e3:.2f} ms | {r['W'] * 1e3:.2f} ms | "
            f"{r['BW'] * 1e3:.2f} ms | {r['BW'] / r['fused']:.2f}× | {r['best_ratio']:.2f}× | "
            f"{r['cpu_ratio']:.2f}× | {r['flops_fused'] / 1e6:.2f} | "
            f"{(r['flops_B'] + r['flops_W']) / 1e6:.2f} | "
            f"{(r['flops_B'] + r['flops_W']) / r['flops_fused']:.4f} | {r['dots']} |"
        )
    return "\n".join(lines)


def run(quick: bool) -> tuple[str, list[dict]]:
    """Measure in a single-threaded child process; return the markdown table and the rows."""
    return run_section("benchmarks.zbscan", quick, table)


# ---------------------------------------------------------------------------------------------
# The child: everything below runs with single-threaded XLA.


def _flops(jitted, *args) -> float:
    analysis = jitted.lower(*args).compile().cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older jax: one dict per computation
        analysis = analysis[0] if analysis else {}
    return float((analysis or {}).get("flops", 0.0))


def _child(quick: bool) -> dict:
    # One CPU, before JAX starts its threads: XLA:CPU runs independent operations of one
    # program concurrently even with single-threaded Eigen, which lets the fused backward
    # overlap its weight-gradient matmuls with the input-gradient chain on the second core
    # (a stage on one device does not get that core). Pinned, wall time is one core's work.
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import functools
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import export as jexport

    import vjpsplit_cli as vs
    from benchmarks.timing import interleaved_samples
    from vjpsplit_cli.pipeline.runtime.worker import StageWorker

    cfg = _config(quick)
    W, R, L, H, T, B = (cfg[k] for k in ("width", "rows", "layers", "hidden", "steps", "batch"))
    rng = np.random.default_rng(0)
    (b,) = jexport.symbolic_shape("b")
    s = jax.ShapeDtypeStruct

    def scanned(params, x, unroll=1):
        def layer(h, p):
            return jax.nn.gelu(h @ p["w"] + p["b"]), None

        return jax.lax.scan(layer, x, params, unroll=unroll)[0]

    def unrolled(params, x, unroll=1):
        for i in range(L):
            x = jax.nn.gelu(x @ params["w"][i] + params["b"][i])
        return x

    def gru(params, x, unroll=1):
        def cell(h, xt):
            z = jax.nn.sigmoid(xt @ params["wz"] + h @ params["uz"] + params["bz"])
            r = jax.nn.sigmoid(xt @ params["wr"] + h @ params["ur"])
            c = jnp.tanh(xt @ params["wh"] + (r * h) @ params["uh"])
            return (1 - z) * h + z * c, (1 - z) * h + z * c

        _, hs = jax.lax.scan(cell, jnp.zeros((x.shape[0], H), x.dtype), jnp.swapaxes(x, 0, 1), unroll=unroll)
        return jnp.swapaxes(hs, 0, 1)

    mlp_params = {"w": (rng.normal(size=(L, W, W)) / np.sqrt(W)).astype(np.float32), "b": np.zeros((L, W), np.float32)}
    gru_params = {
        k: (rng.normal(size=(H, H)) / np.sqrt(H)).astype(np.float32) for k in ("wz", "uz", "wr", "ur", "wh", "uh")
    } | {"bz": np.zeros(H, np.float32)}
    cases = [
        (
            f"scanned MLP ({L} layers, stacked weights)",
            scanned,
            mlp_params,
            s((b, W), jnp.float32),
            rng.normal(size=(R, W)).astype(np.float32),
        ),
        (
            "unscanned MLP (same layers, reference)",
            unrolled,
            mlp_params,
            s((b, W), jnp.float32),
            rng.normal(size=(R, W)).astype(np.float32),
        ),
        (
            f"GRU ({T} steps, shared weights)",
            gru,
            gru_params,
            s((b, T, H), jnp.float32),
            rng.normal(size=(B, T, H)).astype(np.float32),
        ),
    ]
    rows = []
    for name, fn, params, x_spec, x in cases:
        spec = jax.tree_util.tree_map(lambda a: s(a.shape, a.dtype), params)
        art = vs.export(fn, spec, x_spec, weights="params", platforms="cpu")
        st = StageWorker(art, params, 1, 3)  # a middle stage: it feeds its input gradient back
        c = st.calls
        xs = jnp.asarray(x)
        _, res = c.forward(st.params, xs)
        ct = jnp.ones(np.shape(fn(params, x)), jnp.float32)
        _, inter = c.backward_input(res, ct)
        calls = {
            "fused": lambda: c.backward(res, ct),
            "B": lambda: c.backward_input(res, ct),
            "W": lambda: c.backward_weight(inter),
            "B+W": lambda: c.backward_weight(c.backward_input(res, ct)[1]),
        }
        samples = interleaved_samples(calls, cfg["rounds"])
        t = {k: statistics.median(v) for k, v in samples.items()}
        cpu = {
            k: statistics.median(v)
            for k, v in interleaved_samples(calls, cfg["rounds"], clock=time.process_time).items()
        }
        dot = r"stablehlo\.dot_general.*?->\s*tensor<([^>]*)>"
        b_dots = re.findall(dot, art._exps["bwd_input"].mlir_module())
        w_dots = re.findall(dot, art._exps["bwd_weight"].mlir_module())
        # XLA's cost analysis counts a loop body once: count FLOPs on the same stage with its scan
        # unrolled (the cut keeps the unroll), where every iteration is in the module.
        flat = vs.export(
            functools.partial(fn, unroll=True),
            spec,
            x_spec,
            weights="params",
            platforms="cpu",
            arg_names=("params", "x"),
        )
        cu = StageWorker(flat, params, 1, 3).calls
        _, res_u = cu.forward(st.params, xs)
        _, inter_u = cu.backward_input(res_u, ct)
        rows.append(
            {
                "stage": name,
                "fused": t["fused"],
                "B": t["B"],
                "W": t["W"],
                "BW": t["B+W"],
                "best_ratio": min(samples["B+W"]) / min(samples["fused"]),
                "cpu_ratio": cpu["B+W"] / cpu["fused"],
                "flops_fused": _flops(cu.backward, res_u, ct),
                "flops_B": _flops(cu.backward_input_jitted, res_u, ct),
                "flops_W": _flops(cu.backward_weight, inter_u),
                "dots": f"{len(w_dots)} of {len(w_dots) + len(b_dots)}",
            }
        )
        print(f"{name}: {rows[-1]}", file=sys.stderr)
    return {"config": cfg, "rows": rows, "load": os.getloadavg()[0]}


def main(argv=None) -> int:
    """``--child``: measure and print JSON (run by ``run``); otherwise run the section and print its table."""
    quick, child = "--quick" in (argv or sys.argv[1:]), "--child" in (argv or sys.argv[1:])
    print(json.dumps(_child(quick)) if child else run(quick)[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
