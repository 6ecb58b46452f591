"""What ``inspect`` and ``plan`` show: an artifact's manifest as JSON and as a table, policy costs."""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from ..files.sizes import byte_terms, evaluate_terms, format_bytes_terms, human_bytes, total_bytes
from ..terminal import printable
from ..tracing.policies import PolicyCost
from .artifact import Artifact
from .leaf import Leaf
from .manifest import Manifest
from .sharding import format_spec


def weight_part_bytes(m: Manifest) -> dict[str, dict[str, int]]:
    """What a stage holds per microbatch between B and W, as byte terms of the symbolic dims.

    ``intermediates``: what bwd_input hands over (for a scan, its per-iteration stacks);
    ``residuals``: the stored residuals and inputs bwd_weight reads; ``total``: both.
    """
    reads = [r for r in m.stored_residuals if r.key in m.weight_residuals]
    reads += [leaf for leaf in m.inputs if leaf.key in m.weight_inputs]
    inter, res = total_bytes(m.intermediates), total_bytes(reads)
    return {
        "intermediates": inter,
        "residuals": res,
        "total": {k: inter.get(k, 0) + res.get(k, 0) for k in {**inter, **res}},
    }


def describe(art: Artifact, at: Mapping[str, int] | None = None) -> dict:
    """The ``inspect --json`` object (docs/contract.md's keys, plus a few more); ``at`` sizes symbolic dims."""
    m = art.manifest
    stored = total_bytes(m.stored_residuals)
    extra = {"at": dict(at), "stored_residual_bytes_at": evaluate_terms(stored, at)} if at else {}

    def leaves(items: Sequence[Leaf], residual: bool = False) -> list[dict]:
        # A sharded artifact's leaves say their sharding (a PartitionSpec as a list, null where
        # unspecified); an unsharded one's keep the plain {key, dtype, shape} entries.
        if not m.sharded:
            return [leaf.to_json(residual=residual) for leaf in items]
        return [{**leaf.to_json(residual=residual), "sharding": leaf.to_json().get("sharding")} for leaf in items]

    return {
        "function": m.function,
        "arg_names": list(m.arg_names),
        "wrt": list(m.wrt),
        "has_aux": m.has_aux,
        "dim_vars": list(m.dim_vars),
        "inputs": leaves(m.inputs),
        "outputs": leaves(m.outputs),
        "residuals": leaves(m.residuals, residual=True),
        "grads": leaves(m.grads),
        "platforms": list(m.platforms),
        "nr_devices": m.nr_devices,
        "mesh": {name: size for name, size in m.mesh} or None,
        "policy": m.policy,
        "fingerprint": m.fingerprint,
        "signer": art.signer,  # the signing key's id (checked against the file), or None: unsigned
        "versions": {
            "format": m.format_version,
            "vjpsplit": m.vjpsplit_version,
            "jax": m.jax_version,
            "calling_convention": m.calling_convention_version,
        },
        "stored_residual_bytes": format_bytes_terms(stored),
        "weights": list(m.weights),
        "intermediates": leaves(m.intermediates),
        **(
            {"weight_part_bytes": {k: format_bytes_terms(v) for k, v in weight_part_bytes(m).items()}}
            if m.splits_backward
            else {}
        ),
        **extra,
    }


def _rows(title: str, leaves: Sequence[Leaf], residual: bool = False, sharded: bool = False) -> list[str]:
    if not leaves:
        return [f"{title}: (none)"]
    spec_width = max(len(format_spec(leaf.sharding)) for leaf in leaves) if sharded else 0
    width = max(len(leaf.key) for leaf in leaves)
    shape_width = max(24, *(len(leaf.describe()) for leaf in leaves))
    lines = [f"{title}:"]
    for leaf in leaves:
        size = format_bytes_terms(byte_terms(leaf))
        note = ""
        if residual:
            note = "  input-backed (not stored)" if leaf.input_backed else "  stored"
        spec = f"  {format_spec(leaf.sharding):<{spec_width}}" if sharded else ""
        lines.append(f"  {leaf.key:<{width}}  {leaf.describe():<{shape_width}}{spec} {size:>14}{note}")
    return lines


def _wrt(m: Manifest) -> str:
    """The differentiated arguments; integer and bool ones get no gradient, so they are listed apart."""

    def has_grad(name: str) -> bool:
        return any(g.key == name or g.key.startswith(name + "/") for g in m.grads)

    with_grads = [n for n in m.wrt if has_grad(n)]
    without = [n for n in m.wrt if not has_grad(n)]
    text = ", ".join(with_grads) or "none"
    if without:
        text += f"; no gradient for {', '.join(without)}: integer or bool"
    return text


def format_table(art: Artifact, at: Mapping[str, int] | None = None) -> str:
    """A readable summary of an artifact, for humans; ``at`` sizes symbolic dims in the totals."""
    m = art.manifest
    stored = total_bytes(m.stored_residuals)
    at_note = ""
    if at:
        value = evaluate_terms(stored, at)
        sizes = ", ".join(f"{k}={v}" for k, v in at.items())
        at_note = f" = {human_bytes(value)} at {sizes}" if value is not None else f" (--at {sizes} leaves dims unbound)"
    lines = [
        f"function     {m.function}",
        f"arguments    {', '.join(m.arg_names)}   (wrt: {_wrt(m)})",
        f"symbolic     {', '.join(m.dim_vars) or '(none)'}",
        f"platforms    {', '.join(m.platforms)}",
        *(
            [
                f"devices      {m.nr_devices} (mesh {', '.join(f'{n}={k}' for n, k in m.mesh)}; "
                "sizes are global, shardings are PartitionSpecs)"
            ]
            if m.sharded
            else []
        ),
        f"policy       {m.policy}",
        f"has_aux      {m.has_aux}",
        f"fingerprint  {m.fingerprint}",
        f"signed by    {art.signer or '(unsigned)'}",
        f"versions     format {m.format_version}, vjpsplit {m.vjpsplit_version}, jax {m.jax_version}, "
        f"calling convention {m.calling_convention_version}",
        "",
        *_rows("inputs", m.inputs, sharded=m.sharded),
        *_rows("outputs", m.outputs, sharded=m.sharded),
        *_rows("residuals", m.residuals, residual=True, sharded=m.sharded),
        f"  stored total: {format_bytes_terms(stored)}{at_note}"
        f"  (input-backed, not stored: {format_bytes_terms(total_bytes([r for r in m.residuals if r.input_backed]))})",
        *_rows("grads", m.grads, sharded=m.sharded),
        *(
            [
                f"split backward: weights {', '.join(m.weights)} (bwd_input -> intermediates -> bwd_weight)",
                *_rows("intermediates", m.intermediates, sharded=m.sharded),
                _held_line(m),
            ]
            if m.splits_backward
            else []
        ),
    ]
    # Keys and names come from the file: a newline or escape code in one must not reach the terminal raw.
    return "\n".join(printable(line) for line in lines)


def _held_line(m: Manifest) -> str:
    held = {k: format_bytes_terms(v) for k, v in weight_part_bytes(m).items()}
    return (
        f"  held between B and W per microbatch: {held['total']} "
        f"(intermediates {held['intermediates']} + residuals W reads {held['residuals']})"
    )


__all__ = ["describe", "format_table", "format_plan", "weight_part_bytes"]


def format_plan(costs: Iterable[PolicyCost], at: Mapping[str, int] | None = None) -> str:
    """The ``plan`` table: per policy, stored residual bytes and the backward's recompute."""
    head = f"{'policy':<12} {'stored arrays':>13} {'stored bytes':>22} {'bwd ops':>8} {'bwd dots':>8} {'bwd GFLOP':>10}"
    lines = [head, "-" * len(head)]
    for c in costs:
        size = human_bytes(c.stored_bytes) if c.stored_bytes is not None else format_bytes_terms(c.stored_terms)
        flops = f"{c.backward_flops / 1e9:.3f}" if c.backward_flops is not None else "-"
        lines.append(
            f"{c.policy:<12} {c.stored_arrays:>13} {size:>22} {c.backward_ops:>8} {c.backward_dots:>8} {flops:>10}"
        )
    if at:
        lines.append("sizes: " + ", ".join(f"{k}={v}" for k, v in at.items()))
    else:
        lines.append(
            "(bytes as formulas of the symbolic dims; pass --at b=256 for numbers and FLOPs)"
            if any(c.stored_bytes is None for c in costs)
            else ""
        )
    return "\n".join(printable(line) for line in lines if line)
