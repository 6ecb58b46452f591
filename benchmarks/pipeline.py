"""Pipeline schedules on 2 workers: 1F1B vs ZB-H1 vs ZB-V, in-process and on Ray; B + W vs the fused backward.

Also the cost per operation on tiny stages (16 microbatches of 4 rows, width 16),
where the runner's own overhead is all there is: in-process with 2 and with 8
stages, and on Ray as a compiled graph and as one actor call per operation.

    python -m benchmarks --only pipeline            # the full run (by hand; about 2 minutes)
    python -m benchmarks.pipeline [--quick]         # the same, this section alone

The work runs in a child process whose XLA CPU runtime is single-threaded
(``XLA_FLAGS``), and so do the Ray actors: each worker then uses one core of
this 2-core machine, as one device per stage would. The model is an MLP of
``LAYERS`` dense layers: 1F1B and ZB-H1 cut it into 2 stages, ZB-V into 4 (two
per worker, in a V). Schedules are interleaved round by round and reported as
median step times; every schedule's loss is checked against
``jax.value_and_grad``. The modeled bubble replays each schedule with the
median measured op times and one device per worker.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from benchmarks.timing import SINGLE_THREAD, run_section, section_main


def _config(quick: bool) -> dict:
    tiny = {"width": 16, "rows": 4, "layers": 8, "microbatches": 16, "rounds": 3 if quick else 25, "stages": 8}
    if quick:
        # Proves the section runs (CI): each Ray runner on one schedule (both layouts), the tiny stages in-process
        # only and cut into 4 at most, so there are fewer stages to export and compile.
        return {
            "width": 256,
            "rows": 32,
            "layers": 4,
            "microbatches": 4,
            "rounds": 3,
            "ray": True,
            "ray_schedules": {"Ray": ["1f1b"], "Ray calls": ["zbv"]},
            "bw_rounds": 5,
            "tiny": {**tiny, "layers": 4, "stages": 4, "ray": False},
        }
    return {
        "width": 1024,
        "rows": 128,
        "layers": 8,
        "microbatches": 8,
        "rounds": 15,
        "ray": True,
        "bw_rounds": 40,
        "tiny": tiny,
    }


def run(quick: bool) -> tuple[str, list[dict]]:
    """Measure in a single-threaded child process; return the markdown table and the rows."""
    return run_section("benchmarks.pipeline", quick, table)


def table(data: dict) -> str:
    """The report: B + W against the fused backward, then the schedules."""
    c = data["config"]
    where = (
        "one core each (single-threaded XLA)"
        if c.get("single_threaded", True)
        else f"threads of one process sharing the `{c['platform']}` device"
    )
    lines = [
        f"MLP of {c['layers']} dense layers (width {c['width']}), {c['microbatches']} microbatches of "
        f"{c['rows']} rows, 2 workers, {where}. Medians of {c['rounds']} "
        f"interleaved steps; load average {data['load']:.1f} when done (other work shares the cores).",
        "",
        "| stage | fused backward | B | W | B then W | (B then W) / fused |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in data["bw"]:
        lines.append(
            f"| {r['stage']} | {r['fused'] * 1e3:.2f} ms | {r['B'] * 1e3:.2f} ms | {r['W'] * 1e3:.2f} ms | "
            f"{r['BW'] * 1e3:.2f} ms | {r['BW'] / r['fused']:.2f}× |"
        )
    lines += [
        "",
        "| runner | schedule | stages | step time | vs 1F1B | measured bubble | modeled bubble | "
        "unit model, F = B = W |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['runner']} | {r['label']} | {r['stages']} | {r['step'] * 1e3:.1f} ms | "
            f"{r['speedup']:.2f}× | {r['bubble']:.1%} | {r['modeled']:.1%} | {r['unit']:.1%} |"
        )
    step = {(r["runner"], r["schedule"]): r["step"] for r in data["rows"]}
    if ("Ray", "1f1b") in step:
        lines += [
            "",
            "MLP, Ray step / in-process step: "
            + ", ".join(
                f"{r} {step[(r, n)] / step[('in-process', n)]:.2f}× ({n})"
                for r in ("Ray", "Ray calls")
                for n in ("1f1b", "zbh1", "zbv")
                if (r, n) in step
            ),
        ]
    t = data.get("tiny")
    if t:
        tc = c["tiny"]
        base = t["rows"][0]
        lines += [
            "",
            f"Tiny stages: {tc['layers']} dense layers of width {tc['width']}, 1F1B, {tc['microbatches']} "
            f"microbatches of {tc['rows']} rows; medians of {tc['rounds']} interleaved steps.",
            "",
            "| runner | stages | step time | per operation | step / in-process (2 stages) |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in t["rows"]:
            lines.append(
                f"| {r['runner']} | {r['stages']} | {r['step'] * 1e3:.2f} ms | {r['per_op'] * 1e6:.0f} µs | "
                f"{r['step'] / base['step']:.2f}× |"
            )
        per = {(r["runner"], r["stages"]): r["per_op"] for r in t["rows"]}
        lines += [
            "",
            f"In-process cost per operation, {tc['stages']} stages / 2 stages: "
            f"{per[('in-process', tc['stages'])] / per[('in-process', 2)]:.2f}×",
        ]
    one = data.get("from_one")
    if one:
        lines += [
            "",
            f"The same MLP from one function (`stage_boundary` after layer {c['layers'] // 2}, `export_stages`) "
            f"against the hand-written stages, in-process 1F1B on 2 stages, medians of {c['rounds']} interleaved "
            f"steps: hand-written {one['hand'] * 1e3:.1f} ms, from one function {one['one'] * 1e3:.1f} ms "
            f"({one['one'] / one['hand']:.2f}×).",
        ]
    fails = data.get("failures", []) + (t or {}).get("failures", [])
    if fails:
        lines += ["", "Did not finish (left out above): " + "; ".join(fails)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The measurements: in the child, everything below runs with single-threaded XLA.


def measure(quick: bool, platform: str = "cpu", ray: bool = True) -> dict:
    """The measurements, in this process, with stages exported for ``platform``; Ray workers too when ``ray``.

    ``run`` calls it in a single-threaded child; the accelerator run calls it in place,
    on the device, without Ray.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import export as jexport

    import vjpsplit_cli as vs
    from benchmarks.timing import interleaved
    from vjpsplit_cli import pipeline as P
    from vjpsplit_cli.pipeline.runtime.worker import StageWorker
    from vjpsplit_cli.pipeline.schedules.catalog import LABELS
    from vjpsplit_cli.pipeline.schedules.layout import layout_kind
    from vjpsplit_cli.pipeline.schedules.timeline import bubble_ratio

    cfg = dict(
        _config(quick), ray=ray, platform=platform, single_threaded=SINGLE_THREAD in os.environ.get("XLA_FLAGS", "")
    )
    W, L, M, R = cfg["width"], cfg["layers"], cfg["microbatches"], cfg["rows"]

    def hidden(params, x):
        for p in params:
            x = jax.nn.gelu(x @ p["w"] + p["b"])
        return x

    def head(params, x, labels):
        x = hidden(params[:-1], x)
        logits = x @ params[-1]["w"] + params[-1]["b"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))

    def model(W, L, M, R):
        rng = np.random.default_rng(0)
        params = [
            {"w": (rng.normal(size=(W, W)) / np.sqrt(W)).astype(np.float32), "b": np.zeros(W, np.float32)}
            for _ in range(L)
        ]
        x = rng.normal(size=(M * R, W)).astype(np.float32)
        labels = rng.integers(0, W, M * R).astype(np.int32)
        return params, x, labels, float(head(params, x, labels))

    def cut(n, params=None):
        params = params or model_params
        W, L = params[0]["w"].shape[0], len(params)
        (b,) = jexport.symbolic_shape("b")
        s = jax.ShapeDtypeStruct
        k = L // n
        groups = [params[i * k : (i + 1) * k] for i in range(n)]
        spec = lambda p: jax.tree_util.tree_map(lambda a: s(a.shape, a.dtype), p)  # noqa: E731
        wrt = lambda i: ("params",) if i == 0 else ("params", "x")  # noqa: E731
        arts = [
            vs.export(hidden, spec(g), s((b, W), jnp.float32), wrt=wrt(i), weights="params", platforms=platform)
            for i, g in enumerate(groups[:-1])
        ]
        arts.append(
            vs.export(
                head,
                spec(groups[-1]),
                s((b, W), jnp.float32),
                s((b,), jnp.int32),
                wrt=wrt(n - 1),
                weights="params",
                platforms=platform,
            )
        )
        return arts, groups

    tiny = _tiny(cfg["tiny"], model, cut, P, cfg["ray"] and cfg["tiny"].get("ray", True))
    params, x, labels, loss = model(W, L, M, R)
    model_params = params
    cuts = {2: cut(2), 4: cut(4)}
    from_one = _from_one_function(cfg, params, x, labels, loss, hidden, head, cuts[2], P, platform)

    # B + W against the fused backward, through the pipeline's own per-op calls.
    bw = []
    arts, groups = cuts[2]
    for s, (art, g) in enumerate(zip(arts, groups)):
        st = StageWorker(art, g, s, 2)
        xs = jnp.asarray(x[:R]) if s == 0 else jnp.asarray(hidden(groups[0], x[:R]))
        side = [jnp.asarray(labels[:R])] if s == 1 else []
        _, res = st.calls.forward(st.params, xs, *side)
        ct = jnp.float32(1.0 / M) if s == 1 else jnp.ones((R, W), jnp.float32)
        c = st.calls
        _, inter = c.backward_input(res, ct)
        t = interleaved(
            {
                "fused": lambda: c.backward(res, ct),
                "B": lambda: c.backward_input(res, ct),
                "W": lambda: c.backward_weight(inter),
                "B+W": lambda: c.backward_weight(c.backward_input(res, ct)[1]),
            },
            cfg["bw_rounds"],
        )
        bw.append({"stage": s, "fused": t["fused"], "B": t["B"], "W": t["W"], "BW": t["B+W"]})

    schedules = ["1f1b", "zbh1", "zbv"]
    p = 2

    def unit_model(name):
        # Idle share with F = B = W (a fused B costs 2; a ZB-V stage half a worker's): the schedule's own bubble.
        S = 4 if name == "zbv" else 2
        scale = 0.5 if name == "zbv" else 1.0
        ev = P.simulate(
            P.schedule(name, S, M),
            S,
            lambda o: scale * (2.0 if o.kind == "B" else 1.0),  # a whole backward; I and W 1 each
        )
        return bubble_ratio(ev, p)

    samples: dict = {}

    def record(runner, name, r):
        if not np.isclose(r.loss, loss, rtol=1e-4):
            raise RuntimeError(f"{runner} {name}: loss {r.loss} != {loss}")
        samples.setdefault((runner, name), []).append(r)

    def inprocess():
        return {
            n: (lambda n=n: P.run_inprocess(*cuts[4 if n == "zbv" else 2], x, [labels], microbatches=M, schedule=n))
            for n in schedules
        }, []

    def on_ray(compiled, name):
        # One pipeline per schedule: a RayPipeline holds one compiled graph at a time.
        def setup():
            rp = P.RayPipeline(
                *cuts[4 if name == "zbv" else 2], layout=layout_kind(name), compiled=compiled, step_timeout=60
            )
            return {name: lambda: rp.run(x, [labels], microbatches=M, schedule=name)}, [rp]

        return setup

    phases = [("in-process", inprocess)]
    if cfg["ray"]:
        phases += [
            (runner, on_ray(compiled, n))
            for runner, compiled in (("Ray", True), ("Ray calls", False))
            for n in cfg.get("ray_schedules", {}).get(runner, schedules)
        ]
    failures: dict = {}
    _phases(phases, cfg["rounds"], record, cfg["ray"], failures)
    runners = dict.fromkeys(r for r, _ in phases)

    rows = []
    for runner in runners:
        base = (
            statistics.median(r.step_time for r in samples.get((runner, "1f1b"), []))
            if (runner, "1f1b") in samples
            else float("nan")
        )
        for name in schedules:
            if (runner, name) in failures or (runner, name) not in samples:
                continue
            rs = samples[(runner, name)]
            step = statistics.median(r.step_time for r in rs)
            # One device per worker, each op its median measured time.
            dur: dict = {}
            for r in rs:
                for e in r.events:
                    dur.setdefault((e.stage, e.kind, e.mb), []).append(e.end - e.start)
            med = {k: statistics.median(v) for k, v in dur.items()}
            S = rs[0].num_stages
            modeled = P.simulate(P.schedule(name, S, M), S, lambda o: med[(o.stage, o.kind, o.mb)])
            ops = {
                k: statistics.median(v for (c, kk, _), v in med.items() if kk == k)
                for k in "FBIW"
                if any(kk == k for (_, kk, _) in med)
            }
            rows.append(
                {
                    "runner": runner,
                    "schedule": name,
                    "label": LABELS[name],
                    "stages": S,
                    "step": step,
                    "speedup": base / step,
                    "bubble": statistics.median(r.bubble_ratio for r in rs),
                    "modeled": bubble_ratio(modeled, p),
                    "unit": unit_model(name),
                    "modeled_makespan": max(e.end for e in modeled) - min(e.start for e in modeled),
                    "op_medians": ops,
                }
            )
    return {
        "config": cfg,
        "bw": bw,
        "rows": rows,
        "tiny": tiny,
        "from_one": from_one,
        "load": os.getloadavg()[0],
        "failures": [f"{r} {n}: {e}" for (r, n), e in failures.items()],
    }


def _from_one_function(cfg: dict, params, x, labels, loss, hidden, head, hand, P, platform) -> dict:
    """Step time of the MLP cut by ``export_stages`` at one mark against the hand-written cut, interleaved."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import export as jexport

    import vjpsplit_cli as vs
    from benchmarks.timing import interleaved

    half = len(params) // 2

    def marked(params, x, labels):
        x = vs.stage_boundary(hidden(params[:half], x))
        return head(params[half:], x, labels)

    (b,) = jexport.symbolic_shape("b")
    spec = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    batch = (jax.ShapeDtypeStruct((b, x.shape[1]), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.int32))
    stages = vs.export_stages(marked, spec, *batch, wrt="params", platforms=platform)
    M = cfg["microbatches"]
    for r in (
        P.run_inprocess(stages, params, (x, labels), microbatches=M, schedule="1f1b"),
        P.run_inprocess(*hand, x, [labels], microbatches=M, schedule="1f1b"),
    ):
        if not np.isclose(r.loss, loss, rtol=1e-4):
            raise RuntimeError(f"from one function: loss {r.loss} != {loss}")
    t = interleaved(
        {
            "hand": lambda: P.run_inprocess(*hand, x, [labels], microbatches=M, schedule="1f1b").loss,
            "one": lambda: P.run_inprocess(stages, params, (x, labels), microbatches=M, schedule="1f1b").loss,
        },
        cfg["rounds"],
    )
    return {"hand": t["hand"], "one": t["one"]}


def _phases(phases: list, rounds: int, record, ray_too: bool, failures: dict) -> None:
    """Each ``(runner, setup)`` in a phase of its own: set up, warm up, ``rounds`` interleaved steps, close.

    Phases, not rounds across runners: an idle compiled Ray graph polls its
    channels (about a third of a core per actor here), which would slow whatever
    else is measured beside it.
    """
    from vjpsplit_cli import VjpsplitError

    if ray_too:  # only then: an accelerator's machine may have no Ray
        import ray

        # No XLA_FLAGS in the job's runtime_env: the runner gives each actor this process's flags with its own
        # device count, where a job-level XLA_FLAGS would stand as given (each actor seeing this child's 2
        # devices, driving 1: +20% CPU per actor on the GPT, benchmarks/results/2026-history-ray-training-steps.md).
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        for runner, setup in phases:
            print(f"phase {runner}", file=sys.stderr, flush=True)
            fns, pipes = setup()
            try:
                for fn in fns.values():  # warm-up: traces and compiles each stage's calls (and the graph)
                    fn()
                    fn()
                for _ in range(rounds):
                    for name, fn in fns.items():
                        record(runner, name, fn())
                        time.sleep(0.01)
            except VjpsplitError as e:  # a step past its step_timeout: reported, not hung on
                for name in fns:
                    failures[(runner, name)] = str(e)
            finally:
                for rp in pipes:
                    rp.close()
    finally:
        if ray_too:
            import ray

            ray.shutdown()


def _tiny(tc: dict, model, cut, P, ray_too: bool) -> dict:
    """Step time and time per operation on tiny stages: the runners' own overhead."""
    M = tc["microbatches"]
    params, x, labels, loss = model(tc["width"], tc["layers"], M, tc["rows"])
    many = tc["stages"]
    cuts = {n: cut(n, params) for n in (2, many)}
    steps: dict = {}

    def record(runner, name, r):
        if not abs(r.loss - loss) <= 1e-4 * abs(loss):
            raise RuntimeError(f"tiny {runner} {name}: loss {r.loss} != {loss}")
        steps.setdefault((runner, name), []).append(r.step_time)

    def on_ray(compiled):
        def setup():
            rp = P.RayPipeline(*cuts[2], compiled=compiled, step_timeout=60)
            return {2: lambda: rp.run(x, [labels], microbatches=M, schedule="1f1b")}, [rp]

        return setup

    phases = [
        (
            "in-process",
            lambda: (
                {
                    n: (lambda n=n: P.run_inprocess(*cuts[n], x, [labels], microbatches=M, schedule="1f1b"))
                    for n in (2, many)
                },
                [],
            ),
        )
    ]
    if ray_too:
        phases += [("Ray", on_ray(True)), ("Ray calls", on_ray(False))]
    failures: dict = {}
    _phases(phases, tc["rounds"], record, ray_too, failures)
    rows = []
    for (runner, n), ts in steps.items():
        if (runner, n) in failures:
            continue
        ops = sum(len(p) for p in P.schedule("1f1b", n, M))
        step = statistics.median(ts)
        rows.append({"runner": runner, "stages": n, "step": step, "per_op": step / ops})
    return {"rows": rows, "failures": [f"{r} ({n} stages): {e}" for (r, n), e in failures.items()]}


def _print_ops(rows: list[dict]) -> None:
    for r in rows:
        ops = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in r["op_medians"].items())
        print(
            f"{r['runner']:>10} {r['label']:>5}: median ops {ops}; modeled makespan {r['modeled_makespan'] * 1e3:.1f} ms"
        )


def main(argv=None) -> int:
    """``--child``: measure and print JSON (run by ``run``); otherwise run the section, print its table and each
    row's median operation times."""
    return section_main(__doc__, measure, run, argv, report=_print_ops)


if __name__ == "__main__":
    sys.exit(main())
