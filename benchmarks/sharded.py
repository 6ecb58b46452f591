"""Sharded stages on 8 CPU devices: per-device residual bytes, and artifact fwd+bwd vs fused, same shardings.

Workloads: the TP x DP MLP block and the pre-LN attention block of
``samples/sharded/block.py``, widened (d=256, hidden 1024, 8 heads), on a 2 x 4
mesh (batch over ``data``, units and heads over ``model``). XLA fixes the device
count when JAX starts, so the measurement runs in a child process started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``. The 8 "devices" share
this machine's cores: times compare programs, not hardware.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from benchmarks.timing import run_child

ROOT = Path(__file__).resolve().parents[1]


def _child(quick: bool) -> dict:
    sys.path.insert(0, str(ROOT / "samples" / "sharded"))
    import block
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import export as jexport
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import vjpsplit_cli as vs
    from benchmarks.timing import interleaved

    block.D, block.H, block.HEADS = 256, 1024, 8
    (b,) = jexport.symbolic_shape("b", constraints=("mod(b, 2) == 0",))
    mesh = block.mesh()
    batch = jax.ShapeDtypeStruct((b, 32, block.D), jnp.float32, sharding=NamedSharding(mesh, P("data", None, None)))
    rows = {}
    for name, fn, make in (
        ("mlp", block.mlp, block.mlp_params),
        ("attention", block.attention, block.attention_params),
    ):
        specs = (make(), batch)
        with tempfile.TemporaryDirectory() as tmp:
            vs.export(fn, *specs, platforms="cpu").save(Path(tmp) / "a.vjps")
            art = vs.load(Path(tmp) / "a.vjps")
        host = (block.init(specs[0], 1), block.init(specs[1], 2, b=16))
        shardings = tuple(jax.tree_util.tree_map(lambda s: s.sharding, sp) for sp in specs)
        args = jax.tree_util.tree_map(jax.device_put, host, shardings)
        fused = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)), in_shardings=shardings)

        def artifact_step():
            out, res = art.fwd(*args)
            return out, art.bwd(res)

        fwd, bwd = vs.split(fn, wrt=(0, 1))
        jfwd, jbwd = jax.jit(fwd), jax.jit(bwd)

        def split_step():
            out, res = jfwd(*args)
            return out, jbwd(res, jnp.float32(1))

        _, res = art.fwd(*args)
        stored = list(res.stored.values())
        per_device: dict = {}
        for a in stored:
            for shard in a.addressable_shards:
                per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
        bwd = jexport.deserialize(bytearray(art.modules["bwd"]))
        dims_arg = jax.device_put(np.zeros((0, 16), bool), NamedSharding(art.mesh, P()))
        hlo = (
            jax.jit(bwd.call)
            .lower(stored, list(res.inputs.values()), [jnp.ones((), jnp.float32)], dims_arg)
            .compile()
            .as_text()
        )
        times = interleaved(
            {"fused": lambda: fused(*args), "split": split_step, "artifact": artifact_step}, rounds=5 if quick else 30
        )
        rows[name] = {
            "fused_ms": times["fused"] * 1e3,
            "artifact_ms": times["artifact"] * 1e3,
            "split_ms": times["split"] * 1e3,
            "ratio": times["artifact"] / times["fused"],
            "split_ratio": times["split"] / times["fused"],
            "residual_total": sum(a.nbytes for a in stored),
            "residual_per_device_max": max(per_device.values()),
            "residual_per_device_min": min(per_device.values()),
            "bwd_all_gathers": hlo.count(" all-gather("),
        }
    return rows


def run(quick: bool = False) -> tuple[str, dict]:
    """The markdown table and the raw figures, measured in a child process with 8 CPU devices."""
    rows = run_child("benchmarks.sharded", quick, devices=8, single_thread=False)
    lines = [
        "| block (batch 16 x 32 tokens, d=256) | fused jit(value_and_grad) | split fwd+bwd (jit) | "
        "artifact fwd+bwd | residuals, all devices | residuals, per device (max / min) | "
        "all-gathers in the backward |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, v in rows.items():
        lines.append(
            f"| {name} | {v['fused_ms']:.2f} ms | {v['split_ms']:.2f} ms ({v['split_ratio']:.2f}x) | "
            f"{v['artifact_ms']:.2f} ms ({v['ratio']:.2f}x) | "
            f"{v['residual_total'] / 2**20:.2f} MiB | {v['residual_per_device_max'] / 2**20:.2f} / "
            f"{v['residual_per_device_min'] / 2**20:.2f} MiB | {v['bwd_all_gathers']} |"
        )
    return "\n".join(lines), rows


if __name__ == "__main__":
    if "--child" in sys.argv:
        print(json.dumps({k: v for k, v in _child("--quick" in sys.argv).items()}))
    else:
        print(run("--quick" in sys.argv)[0])
