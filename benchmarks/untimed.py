"""What running an untimed Trainer step in its helper thread costs, against dispatching it from the caller's;
and the host's own time per operation of that step, against ``jit`` calls of the same programs.

    python -m benchmarks.untimed [--quick] [--rounds N]
    python -m benchmarks.untimed --per-op [--quick] [--rounds N] [--devices 1|2] [--profile]

The train benchmark's tiny stages (``benchmarks/gpt.py``'s ``tiny_stages``: 8 gelu
layers of width 16 cut in two, 16 microbatches of 4 rows, 1F1B, SGD: 64 operations a
step, each of negligible work, so the runner's own costs are all there is), on 2 host
CPU devices. Two candidates on the same Trainer (``step_timeout=60``), alternately in
blocks of 4 steps, interleaved round by round, which goes first alternating (medians of
the blocks): the untimed step as shipped (its dispatch, updates and loss fetch in the
backend's kept thread, each operation noted in ``inprocess.Dispatched``, the caller
waiting with ``step_timeout``), and the same step as it was before, from the caller's
thread with nothing noted and no watchdog (``dispatch``, ``_finish``, ``fetch_losses``).

``--per-op`` (``per_op``, which ``benchmarks/accelerator.py``'s train step reports too): the
host's time to dispatch the untimed step's operations (``untimed.dispatch`` in the step's
thread: resetting the workers, placing the batch, every F, B, I and W handed out, nothing
waited for), per operation of the plans, against dispatching the same programs on the
same inputs as plain ``jit`` calls, in the same order (the calls one step made, captured
once), alternately round by round. The issue's target: at most ``PER_OP_LIMIT`` times.
``--profile`` prints a cProfile of the step's dispatch.
"""

from __future__ import annotations

import cProfile
import json
import os
import statistics
import sys
import time
from typing import Callable

from benchmarks.timing import in_child_with_devices

PER_OP_LIMIT = 1.5  # issue 68: the host's time per operation against a jit call of the same program


def measure(rounds: int, block: int = 4) -> dict:
    """Median seconds per untimed step in the helper thread and in the caller's, and their ratio."""
    import optax

    from benchmarks.gpt import tiny_stages
    from vjpsplit_cli import pipeline as P
    from vjpsplit_cli.pipeline.runtime.untimed import dispatch
    from vjpsplit_cli.pipeline.training.local_backend import InProcessBackend

    M = 16
    stages, params, batch, _ = tiny_stages(microbatches=M)
    shipped = InProcessBackend._untimed

    def here(self, mbs, schedule, microbatches, clip):  # the step before the hand-off: all from this thread
        workers = [t.worker for t in self.trainers]
        order, finishing = self._orders(schedule.plans)
        dispatch(workers, schedule.plans, mbs, microbatches, order)
        sums = self._finish(finishing, clip, self._value(microbatches), lambda: None)
        return sums, workers[-1].fetch_losses()

    tr = P.Trainer(stages, params, optimizer=optax.sgd(1e-3), microbatches=M, observe=P.Observe(step_timeout=60))
    for _ in range(5):  # compile, warm
        tr.step(batch)
    samples: dict[str, list[float]] = {"helper thread": [], "caller's thread": []}
    candidates = [("helper thread", shipped), ("caller's thread", here)]
    for i in range(rounds):
        for name, method in candidates if i % 2 == 0 else candidates[::-1]:  # each goes first every other round
            InProcessBackend._untimed = method  # type: ignore[method-assign]
            t0 = time.perf_counter()
            for _ in range(block):
                tr.step(batch)
            samples[name].append((time.perf_counter() - t0) / block)
    InProcessBackend._untimed = shipped  # type: ignore[method-assign]
    tr.close()
    handoff, noting = own_costs()
    med = {k: statistics.median(v) for k, v in samples.items()}
    # Each round's two blocks ran back to back: their ratio cancels the machine's slower drifts.
    paired = sorted(a / b for a, b in zip(samples["helper thread"], samples["caller's thread"]))
    q1, _, q3 = statistics.quantiles(paired, n=4)
    return {
        "helper": med["helper thread"],
        "caller": med["caller's thread"],
        "ratio": med["helper thread"] / med["caller's thread"],
        "paired": statistics.median(paired),
        "paired_iqr": [q1, q3],
        "handoff": handoff,
        "noting": noting,
        "own": (handoff + 4 * M * noting) / med["caller's thread"],
        "ops": 4 * M,
        "rounds": rounds,
        "block": block,
        "load": os.getloadavg()[0],
    }


def own_costs(n: int = 2000) -> tuple[float, float]:
    """The shipped step's own work, alone (steadier than the end-to-end difference on a shared machine):
    seconds of one hand-off to the kept thread and back (``run_untimed`` of an empty body), and seconds
    ``Dispatched`` spends noting one operation (``begin`` and ``end`` of an operation handing on one array)."""
    import jax.numpy as jnp

    from vjpsplit_cli.pipeline.runtime.stepwatch import Watch
    from vjpsplit_cli.pipeline.runtime.untimed import Dispatched, run_untimed
    from vjpsplit_cli.pipeline.runtime.workerthreads import WorkerThreads
    from vjpsplit_cli.pipeline.schedules.ops import Op

    pool = WorkerThreads(1, "vjpsplit-bench")
    empty = Dispatched([[]], 0)
    for _ in range(50):
        run_untimed(pool, lambda: None, empty, [], Watch(60.0))
    t0 = time.perf_counter()
    for _ in range(n):
        run_untimed(pool, lambda: None, empty, [], Watch(60.0))
    handoff = (time.perf_counter() - t0) / n
    pool.close()
    ops = [Op("F", m, 0) for m in range(n)]
    out = jnp.ones(4)
    out.block_until_ready()
    rec = Dispatched([ops], 1)
    t0 = time.perf_counter()
    for op in ops:
        rec.begin(0, op)
        rec.end(0, op, out, None)  # type: ignore[arg-type]  # an array is handed on: the stage is not read
    return handoff, (time.perf_counter() - t0) / n


def table(r: dict) -> str:
    """The measurement as the docs quote it."""
    return "\n".join(
        [
            "| untimed Trainer step (tiny stages, 64 operations) | median |",
            "|---|---:|",
            f"| in the helper thread (shipped) | {r['helper'] * 1e3:.3f} ms |",
            f"| from the caller's thread, nothing noted | {r['caller'] * 1e3:.3f} ms |",
            f"| ratio of the medians | {r['ratio']:.4f} |",
            f"| median of the rounds' ratios (quartiles) | {r['paired']:.4f} ({r['paired_iqr'][0]:.3f}-"
            f"{r['paired_iqr'][1]:.3f}) |",
            f"| own work: one hand-off to the kept thread and back | {r['handoff'] * 1e6:.1f} µs |",
            f"| own work: noting one operation | {r['noting'] * 1e6:.2f} µs |",
            f"| own work per step (hand-off + {r['ops']} operations), of the step | {r['own'] * 100:.2f}% |",
            "",
            f"{r['rounds']} rounds of {r['block']} steps each, interleaved; load average {r['load']:.1f}.",
        ]
    )


def per_op(
    stages,
    params,
    batch,
    devices: list,
    microbatches: int,
    rounds: int,
    schedule: str = "1f1b",
    profile: bool = False,
) -> list[dict]:
    """The host's time per operation of an untimed Trainer step, against ``jit`` calls of the same programs.

    Alternately, round by round: one untimed step (its ``untimed.dispatch`` timed in the step's thread,
    wall and that thread's CPU time), and the same programs dispatched as plain ``jit`` calls on the
    same inputs, in the step's order (each F as ``jax.jit`` of the artifact's ``fwd``; B, I, W and the
    last stage's fused F+B as the worker's own jitted calls; where the step runs as one program, on one device
    that runs one program at a time, that program's compiled call), captured from one step. Nothing waits
    inside either; each is waited for after its clock stops.

    Args:
        stages: The stages (``export_stages``' result).
        params: Their parameters (the whole function's).
        batch: One batch for a step.
        devices: The device of each stage (``InProcess(devices=[[d] for d in devices])``).
        microbatches: The step's microbatches.
        rounds: Interleaved rounds (medians over them).
        schedule: The Trainer's schedule.
        profile: Also print a cProfile of the step's dispatch (its own thread).

    Returns:
        Two rows: ``key`` "step" and "jit" with ``us_per_op`` (wall), ``cpu_us_per_op`` (the dispatching
        thread's CPU time), ``ops`` (the plans' operations), ``calls`` (jitted calls in the step); and on the
        step's row ``ratio`` (its wall time per operation over the jit calls') and ``limit``.
    """
    import jax
    import optax

    from vjpsplit_cli import pipeline as P
    from vjpsplit_cli.pipeline.runtime import program as PG
    from vjpsplit_cli.pipeline.runtime import worker as W
    from vjpsplit_cli.pipeline.runtime.stagecalls import Forward
    from vjpsplit_cli.pipeline.training import local_backend as LB

    runner = P.InProcess(devices=[[d] for d in devices])
    tr = P.Trainer(
        stages, params, optimizer=optax.sgd(1e-3), microbatches=microbatches, schedule=schedule, runner=runner
    )
    calls: list[tuple[Callable, tuple]] = []  # one step's calls: the plain jit of each program, its arguments
    jitted: dict[int, Callable] = {}
    orig_run, orig_dispatch = W.StageWorker._run, LB.dispatch

    def capture(self, worker, kind, mb, args, call, warmup):
        if id(call) not in jitted:
            if isinstance(call, Forward):
                art = call.art
                jitted[id(call)] = jax.jit(lambda *a: art.fwd(*a))
            else:  # the split backward's input part is a wrapper around its jitted call
                inner = self.calls.backward_input_jitted
                jitted[id(call)] = inner if call is self.calls.backward_input else call
        calls.append((jitted[id(call)], tuple(args)))
        return orig_run(self, worker, kind, mb, args, call, warmup)

    orig_program = PG.StepProgram.run

    def capture_program(self, *a, **k):  # a step on one serial device: its one program's call
        call = self._call

        def noted(*args):
            calls.append((call, args))
            return call(*args)

        self._call = noted
        try:
            return orig_program(self, *a, **k)
        finally:
            self._call = call

    wall: list[float] = []
    cpu: list[float] = []
    prof = cProfile.Profile() if profile else None

    def timed_dispatch(*a, **k):
        t0, c0 = time.perf_counter(), time.thread_time()
        if prof is not None:
            prof.enable()
        try:
            return orig_dispatch(*a, **k)
        finally:
            if prof is not None:
                prof.disable()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)

    try:
        for _ in range(3):  # compile, warm
            tr.step(batch)
        W.StageWorker._run = capture  # type: ignore[method-assign]
        PG.StepProgram.run = capture_program  # type: ignore[method-assign]
        try:
            tr.step(batch)
        finally:
            W.StageWorker._run = orig_run  # type: ignore[method-assign]
            PG.StepProgram.run = orig_program  # type: ignore[method-assign]
        ops = sum(len(p) for p in tr.plan.plans)
        for _ in range(2):  # the plain calls compile
            jax.block_until_ready([fn(*a) for fn, a in calls])
        ref_wall: list[float] = []
        ref_cpu: list[float] = []

        def step() -> None:
            LB.dispatch = timed_dispatch
            try:
                tr.step(batch)
            finally:
                LB.dispatch = orig_dispatch

        def plain() -> None:
            t0, c0 = time.perf_counter(), time.thread_time()
            outs = [fn(*a) for fn, a in calls]
            ref_wall.append(time.perf_counter() - t0)
            ref_cpu.append(time.thread_time() - c0)
            jax.block_until_ready(outs)

        for i in range(rounds):
            for fn in (step, plain) if i % 2 == 0 else (plain, step):  # each goes first every other round
                fn()
    finally:
        tr.close()
    if prof is not None:
        from benchmarks.step_probe import print_profile

        print_profile(prof, 25, 35)
    step_op, ref_op = statistics.median(wall) / ops, statistics.median(ref_wall) / ops
    common = {"ops": ops, "calls": len(calls), "rounds": rounds, "schedule": schedule, "load": os.getloadavg()[0]}
    return [
        {
            "key": "step",
            "candidate": "untimed Trainer step, its dispatch",
            "us_per_op": step_op * 1e6,
            "cpu_us_per_op": statistics.median(cpu) / ops * 1e6,
            "ratio": step_op / ref_op,
            "cpu_ratio": statistics.median(cpu) / statistics.median(ref_cpu),
            "limit": PER_OP_LIMIT,
            **common,
        },
        {
            "key": "jit",
            "candidate": "the same programs as plain jit calls",
            "us_per_op": ref_op * 1e6,
            "cpu_us_per_op": statistics.median(ref_cpu) / ops * 1e6,
            **common,
        },
    ]


def tiny_per_op(rounds: int, platform: str = "cpu", profile: bool = False, devices: int = 2) -> list[dict]:
    """``per_op`` on the tiny stages (16 microbatches, 1F1B): each on its own device where there are ``devices``
    (2) of them, else both on the first (as on an accelerator's single chip)."""
    import jax

    from benchmarks.gpt import tiny_stages

    M = 16
    stages, params, batch, _ = tiny_stages(microbatches=M, platform=platform)
    have = jax.local_devices()
    return per_op(stages, params, batch, [have[0], have[1 % min(devices, len(have))]], M, rounds, profile=profile)


def per_op_targets(rows: list[dict]) -> list[dict]:
    """Issue 68's target on ``per_op``'s rows, as ``train_accel.targets`` gives each."""
    step = rows[0]
    return [
        {
            "target": "the host's time per operation of an untimed step (tiny stages) at most "
            f"{PER_OP_LIMIT}× a jit call of the same program",
            "width": None,
            "value": step["ratio"],
            "limit": PER_OP_LIMIT,
            "met": bool(step["ratio"] <= PER_OP_LIMIT),
        }
    ]


def per_op_table(rows: list[dict]) -> str:
    """``per_op``'s rows as the docs quote them."""
    step, ref = rows
    return "\n".join(
        [
            f"| host time per operation ({step['ops']} operations, {step['calls']} jitted calls, "
            f"{step['schedule']}) | wall | thread CPU |",
            "|---|---:|---:|",
            f"| {step['candidate']} | {step['us_per_op']:.1f} µs | {step['cpu_us_per_op']:.1f} µs |",
            f"| {ref['candidate']} | {ref['us_per_op']:.1f} µs | {ref['cpu_us_per_op']:.1f} µs |",
            f"| ratio (target ≤ {step['limit']}×) | {step['ratio']:.2f}× | {step['cpu_ratio']:.2f}× |",
            "",
            f"Medians of {step['rounds']} alternating rounds; load average {step['load']:.1f}.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Measure (``--quick``: fewer rounds) and print the table and the JSON row (``--per-op``: ``per_op``'s)."""
    argv = sys.argv[1:] if argv is None else argv
    code = in_child_with_devices("benchmarks.untimed", argv, devices=2)  # JAX must see 2 host devices
    if code is not None:
        return code
    if "--per-op" in argv:
        import jax

        rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 200
        devices = int(argv[argv.index("--devices") + 1]) if "--devices" in argv else 2
        platform = jax.devices()[0].platform  # the stages exported for the devices it runs on (a TPU's too)
        rows = tiny_per_op(10 if "--quick" in argv else rounds, platform, profile="--profile" in argv, devices=devices)
        print(per_op_table(rows))
        print(json.dumps(rows))
        return 0
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 60
    r = measure(10 if "--quick" in argv else rounds)
    print(table(r))
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
