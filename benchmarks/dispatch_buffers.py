"""The host's cost of a ``jit`` call by its number of input and output buffers, and of deleting them.

    python -m benchmarks.dispatch_buffers

113 outputs (a GPT stage's stored residuals, about) against one concatenated
buffer, 113 inputs against one, and ``del`` of 113 arrays ready and pending. Its
TPU figures are in ``benchmarks/results/2026-12-06-tpu-step.md``.
"""

import statistics
import time

import jax
import jax.numpy as jnp


def host_us(fn, n=30):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
        del out
    return statistics.median(ts) * 1e6


def main():
    N, shape = 113, (512, 1024)
    x = jnp.ones(shape, jnp.float32)
    many = jax.jit(lambda x: [x * (i + 1) for i in range(N)])
    packed = jax.jit(lambda x: jnp.concatenate([(x * (i + 1)).ravel() for i in range(N)]))
    one = jax.jit(lambda x: x * 2)
    take_many = jax.jit(lambda rs: sum(r[0, 0] for r in rs))
    take_packed = jax.jit(lambda p: sum(p[i * shape[0] * shape[1]] for i in range(N)))
    outs, p = many(x), packed(x)
    jax.block_until_ready((outs, p, one(x), take_many(outs), take_packed(p)))
    print("dispatch one-in one-out     us", host_us(lambda: one(x)))
    print(f"dispatch 1 in, {N} out      us", host_us(lambda: many(x)))
    print("dispatch 1 in, 1 packed out us", host_us(lambda: packed(x)))
    print(f"dispatch {N} in, 1 out      us", host_us(lambda: take_many(outs)))
    print("dispatch 1 packed in, 1 out us", host_us(lambda: take_packed(p)))
    # deleting N ready arrays, and N arrays whose producer is still running
    ts = []
    for _ in range(20):
        o = many(x)
        jax.block_until_ready(o)
        t0 = time.perf_counter()
        del o
        ts.append(time.perf_counter() - t0)
    print(f"delete {N} ready arrays    us", statistics.median(ts) * 1e6)
    ts = []
    for _ in range(20):
        big = jax.block_until_ready(jnp.ones((4096, 4096)))
        slow = big @ big @ big
        o = many(x)
        t0 = time.perf_counter()
        del o
        ts.append(time.perf_counter() - t0)
        jax.block_until_ready(slow)
    print(f"delete {N} pending arrays  us", statistics.median(ts) * 1e6)
    # device time of each, waited
    for name, f in (("many", lambda: many(x)), ("packed", lambda: packed(x))):
        jax.block_until_ready(f())
        t0 = time.perf_counter()
        for _ in range(20):
            o = f()
        jax.block_until_ready(o)
        print(f"wall per call {name:7s} us", (time.perf_counter() - t0) / 20 * 1e6)


if __name__ == "__main__":
    main()
