"""What binding residuals to their inputs costs: CRC-32 of every input vs the forward.

``save_residuals`` records a CRC-32 of every input the forward ran on, and
``load_residuals(..., inputs=)`` (``run-bwd --inputs``) recomputes it. Both are
measured here next to the artifact's forward on the same workload.
"""

from __future__ import annotations

import jax

from . import workloads
from .timing import interleaved, ms


def run(quick: bool):
    """``(markdown table, raw numbers)``."""
    import vjpsplit_cli as vs
    from vjpsplit_cli.artifact.residual_files import input_crc32

    rows, raw = [], {}
    for wl in (workloads.mlp(), workloads.transformer()):
        specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), wl.args)
        art = vs.export(wl.fn, *specs, platforms="cpu")
        _, res = art.fwd(*wl.args)
        bound = dict(res.bound_inputs)
        nbytes = sum(v.nbytes for v in jax.tree_util.tree_leaves(bound))
        t = interleaved(
            {
                "forward": lambda: art.fwd(*wl.args)[0],
                "crc32": lambda: [input_crc32(v) for v in bound.values()],
            },
            rounds=5 if quick else 30,
        )
        raw[wl.name] = t
        rows.append(
            f"| {wl.name} | {len(bound)} arrays, {nbytes / 2**20:.1f} MiB | {ms(t['forward'])} | "
            f"{ms(t['crc32'])} | {t['crc32'] / t['forward']:.2f}x |"
        )
    head = ["| workload | inputs | artifact forward | CRC-32 of them | ratio |", "|---|---|---:|---:|---:|"]
    return "\n".join(head + rows), raw
