"""What ``vjpsplit inspect DIR`` shows for a stages directory: one row per stage (``StageRow``), and the imbalance."""

from __future__ import annotations

import math
from typing import Mapping, Sequence, TypedDict

from ...files.sizes import human_bytes
from .costmodel import AnyDim, Shaped, nbytes
from .directory import Stages


class StageRow(TypedDict):
    """One stage's row: its parameters, batch inputs, bytes per microbatch and estimated cost."""

    stage: int
    params: list[str]
    param_count: int
    param_bytes: int
    batch: list[str]
    receives: int
    sent_bytes: int
    residual_bytes: int
    cost: float
    cost_source: str
    cut_after: str | None


def _bytes(entries: Sequence[Shaped], dims: Mapping[str, int]) -> int:
    return sum(nbytes(e, dims) for e in entries)


def stage_rows(stages: Stages, at: Mapping[str, int] | None = None) -> list[StageRow]:
    """Per stage: parameter count and bytes, batch inputs read, bytes sent on and residual bytes per microbatch, cost."""
    dims = AnyDim(at or {})  # the sizes given, every other symbolic dim at the cost size
    params, batch = stages.index.params, stages.index.batch
    rows: list[StageRow] = []
    for i, (st, art) in enumerate(zip(stages.index.per_stage, stages.artifacts)):
        held = [params[j] for j in st.params]
        rows.append(
            {
                "stage": i,
                "params": [p.key for p in held],
                "param_count": sum(math.prod(int(d) for d in p.shape) for p in held),
                "param_bytes": _bytes(held, dims),
                "batch": [batch[j].key for j in st.batch],
                "receives": len(st.receives),
                "sent_bytes": _bytes(st.sends, dims),
                "residual_bytes": _bytes(art.manifest.stored_residuals, dims),
                "cost": st.cost,
                "cost_source": st.cost_source,
                "cut_after": st.cut_after,
            }
        )
    return rows


def format_stages(stages: Stages, at: Mapping[str, int] | None = None) -> str:
    """The stages table, with the cost imbalance (largest stage over the mean) under it."""
    rows = stage_rows(stages, at)
    idx = stages.index
    sized = ", ".join(f"{k}={v}" for k, v in (at or {}).items()) or f"symbolic dims at {idx.cost_dim}"
    head = f"{idx.function}: {len(rows)} stages ({idx.cut}); bytes per microbatch with {sized}"
    cols = ["stage", "params", "param bytes", "batch inputs", "sends", "residuals", "est. cost", "cut after"]
    table = [
        [
            str(r["stage"]),
            f"{r['param_count']:,} ({len(r['params'])} {'leaf' if len(r['params']) == 1 else 'leaves'})",
            human_bytes(r["param_bytes"]),
            ", ".join(r["batch"]) or "-",
            human_bytes(r["sent_bytes"]) if r["stage"] < len(rows) - 1 else "loss",
            human_bytes(r["residual_bytes"]),
            f"{r['cost']:.3g} FLOPs ({r['cost_source']})",
            r["cut_after"] or "-",
        ]
        for r in rows
    ]
    widths = [max(len(c), *(len(t[j]) for t in table)) for j, c in enumerate(cols)]
    lines = [head, "  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(t, widths)) for t in table]
    costs = [r["cost"] for r in rows]
    lines.append(f"imbalance (largest stage cost / mean): {max(costs) / (sum(costs) / len(costs)):.2f}")
    return "\n".join(lines)
