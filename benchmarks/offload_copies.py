"""What host offload's copies cost on a CPU device, per microbatch of the mid GPT's first stage, against a memcpy.

    python -m benchmarks.offload_copies [--rounds N]    # by hand; under a minute

The arrays are the residuals one microbatch's F leaves to ``Offloader.send`` on the
first stage of ``benchmarks/offload.py``'s mid GPT (2 stages), made afresh on the
device before each timed copy (a copy of a fresh array pays what offload pays: no
cached host view). Timed on the calling thread, each copy waited for:

- memcpy: ``np.copyto`` of each array's bytes into a fresh NumPy array (the bytes' own cost);
- pinned_host out / back: ``jax.device_put`` of each array to the device's ``pinned_host``
  memory, and back in one ``device_put`` (what offload did on CPU devices before: commit a63a6f7);
- NumPy out / back: ``offload._to_host`` (aligned NumPy copies) and one ``device_put`` back
  (what offload does on CPU devices now; the copies come back without a copy).

A GPipe step at m = 8 makes 16 such copies each way (8 per stage; the second stage's are
about the same bytes). Medians of ``--rounds``; the load average is printed beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.timing import SINGLE_THREAD


def _residual_specs():
    """Shapes and dtypes of one microbatch's moved residuals on the mid GPT's first stage."""
    import jax
    import optax

    from benchmarks.gpt import GPT, docs_batches
    from vjpsplit_cli import pipeline as P
    from vjpsplit_cli.pipeline.runtime import offload as O

    g = GPT(width=256, blocks=4, stages=2)
    vocab, _ = docs_batches(g.seq, 16, 1)
    params = g.init(vocab)
    _, data = docs_batches(g.seq, 2 * 8, 1)
    got = []
    send = O.Offloader.send

    def spy(self, mb, res):
        out = send(self, mb, res)
        if isinstance(out, O.Away) and self.stage == 0 and not got:
            got.extend((tuple(res.stored[k].shape), res.stored[k].dtype) for k in out.moved)
        return out

    O.Offloader.send = spy
    try:
        stages = g.export(params, jax.devices()[0].platform)
        with P.Trainer(
            stages,
            params,
            optimizer=optax.adamw(1e-3),
            schedule="gpipe",
            microbatches=8,
            runner=P.InProcess(offload="host"),
        ) as tr:
            tr.step(data[0])
    finally:
        O.Offloader.send = send
    return got


def measure(rounds: int) -> dict:
    """Median milliseconds per microbatch of each copy, and what the arrays are."""
    import jax
    import numpy as np

    from vjpsplit_cli.pipeline.runtime import offload as O

    specs = _residual_specs()
    dev = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)
    pinned = sharding.with_memory_kind("pinned_host")
    seed = [jax.device_put(np.ones(s, d), sharding) for s, d in specs]
    fresh = jax.jit(lambda xs: [x if x.dtype == bool else x * 1.0 + 0.0 for x in xs])

    def pinned_out(xs):
        return jax.block_until_ready([jax.device_put(a, pinned) for a in xs])

    def numpy_out(xs):
        return O._to_host(xs)

    def back(host):
        return jax.block_until_ready(jax.device_put(host, [sharding] * len(host)))

    def memcpy(xs):
        return [np.copyto(np.empty(a.shape, a.dtype), np.asarray(a)) for a in xs]

    cases = {
        "memcpy": (memcpy, None),
        "pinned_host out": (pinned_out, None),
        "pinned_host back": (back, pinned_out),
        "NumPy out": (numpy_out, None),
        "NumPy back": (back, numpy_out),
    }
    ms: dict[str, list[float]] = {k: [] for k in cases}
    zero_copy = 0
    for _ in range(rounds + 1):  # the first warms every path up
        for name, (fn, before) in cases.items():
            xs = jax.block_until_ready(fresh(seed))
            arg = xs if before is None else before(xs)
            del xs
            t0 = time.perf_counter()
            out = fn(arg)
            ms[name].append((time.perf_counter() - t0) * 1e3)
            if name == "NumPy back":
                zero_copy = sum(o.unsafe_buffer_pointer() == h.ctypes.data for o, h in zip(out, arg))
            del out, arg
    nbytes = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in specs)
    return {
        "arrays": len(specs),
        "mib": nbytes / 2**20,
        "ms": {k: statistics.median(v[1:]) for k, v in ms.items()},
        "zero_copy_back": zero_copy,
        "load": os.getloadavg()[0],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=2 {SINGLE_THREAD}"  # before JAX starts
    r = measure(args.rounds)
    print(f"{r['arrays']} arrays, {r['mib']:.2f} MiB per microbatch; load {r['load']:.1f}")
    print("| copy | ms per microbatch | ms per GPipe m=8 step (16 each way) |")
    print("| --- | --- | --- |")
    for k, v in r["ms"].items():
        print(f"| {k} | {v:.2f} | {16 * v:.1f} |")
    print(f"NumPy back without a copy: {r['zero_copy_back']} of {r['arrays']} arrays")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
