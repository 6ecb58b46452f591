"""Describe serialized StableHLO modules: their main signature and custom calls, as JSON-able data.

``trust`` runs this in a child process (``python -m vjpsplit_cli.trust.mlirprobe``,
bytecode in, JSON out) for modules whose author it cannot vouch for, because a
corrupt bytecode can crash the MLIR parser or corrupt its heap. It imports only
jaxlib's MLIR bindings, not jax (a third of the start-up time).
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # at run time jaxlib's MLIR is imported inside the functions, after the child starts
    from jaxlib.mlir import ir


def _type(t: ir.Type) -> list[Any]:
    from jaxlib.mlir import ir

    try:
        r = ir.RankedTensorType(t)
    except (ValueError, TypeError):
        return [str(t), None]
    return [str(r.element_type), [None if r.is_dynamic_dim(i) else r.get_dim_size(i) for i in range(r.rank)]]


def _context() -> ir.Context:
    """An MLIR context with the dialects jax's modules use (as ``jax``'s ``make_ir_context`` registers them)."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import chlo, mhlo, sdy, stablehlo

    ctx = ir.Context()
    try:
        from jaxlib.mlir._mlir_libs import _jax_mlir_ext as upstream
    except ImportError:  # jaxlib < 0.7
        # jaxlib < 0.7's name for it; the installed jaxlib's stubs lack it.
        from jaxlib.mlir._mlir_libs import register_jax_dialects as upstream  # type: ignore[attr-defined,no-redef]
    registry = ir.DialectRegistry()
    upstream.register_dialects(registry)  # func and the other upstream dialects
    ctx.append_dialect_registry(registry)
    ctx.load_all_available_dialects()
    stablehlo.register_dialect(ctx)
    chlo.register_dialect(ctx)
    sdy.register_dialect(ctx)
    mhlo.register_mhlo_dialect(ctx)
    return ctx


def probe(bytecode: bytes) -> dict[str, Any]:
    """``{"main": {"inputs", "results"}, "calls": [{"target", "operands", "results", "attrs"}]}`` of one module.

    ``bytecode`` is the portable StableHLO of a ``jax.export`` module (``mlir_module_serialized``).
    """
    import jaxlib._jax as _jax
    from jaxlib.mlir import ir

    with _context():
        module = _jax.mlir.deserialize_portable_artifact(bytes(bytecode))
        if isinstance(module, str):  # jaxlib < 0.7 returns the module's text, as jax then parsed it
            module = ir.Module.parse(module)
        return describe(module)


def probe_refined(bytecode: bytes, *, shardy: bool = True) -> dict[str, Any]:
    """``probe``'s description of a module with static inputs after shape refinement, as XLA compiles it.

    ``bytecode`` is a lowered (not portable) module whose main takes static shapes, such as
    ``jax.jit(exported.call).lower(...)``'s: refinement gives every symbolic dim inside it the
    call's size, as ``jax`` does before it compiles, so custom calls carry concrete shapes.
    """
    import jaxlib._jax as _jax
    from jaxlib.mlir import ir

    refine = _jax.mlir.refine_polymorphic_shapes
    try:
        text = refine(bytes(bytecode), enable_shape_assertions=True, validate_static_shapes=True, enable_shardy=shardy)
    except TypeError:  # jaxlib without the enable_shardy keyword
        text = refine(bytes(bytecode), enable_shape_assertions=True, validate_static_shapes=True)
    with _context():
        return describe(ir.Module.parse(text))


def describe(module: ir.Module) -> dict[str, Any]:
    """The main signature and every custom call (with operand and result types) of a parsed ``ir.Module``."""
    from jaxlib.mlir import ir

    out: dict[str, Any] = {"calls": [], "main": None}
    stack: list[ir.Operation | ir.OpView] = [module.operation]
    while stack:  # iterative: a forged module may nest regions deeper than Python's recursion limit
        op = stack.pop().operation  # the generic Operation: an OpView may rename .name
        if op.name == "stablehlo.custom_call":
            attrs = op.attributes
            extra = {
                k: str(attrs[k])[:200]
                for k in ("mhlo.backend_config", "backend_config", "mhlo.frontend_attributes")
                if k in attrs
            }
            out["calls"].append(
                {
                    "target": ir.StringAttr(attrs["call_target_name"]).value,
                    "operands": [_type(v.type) for v in op.operands],
                    "results": [_type(v.type) for v in op.results],
                    "attrs": extra,
                }
            )
        elif op.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
            ft = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
            out["main"] = {"inputs": [_type(t) for t in ft.inputs], "results": [_type(t) for t in ft.results]}
        for region in op.regions:
            for block in region.blocks:
                stack.extend(block.operations)
    return out


def _probe_or_error(data: bytes) -> dict[str, Any]:
    try:
        return probe(data)
    except Exception as e:  # the parser refused it: report, do not crash
        lines = str(e).strip().splitlines()
        return {"error": f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]}


def main() -> None:
    """Read ``{name: hex bytes}`` as JSON on stdin; write ``{name: probe or {"error": ...}}`` as JSON on stdout."""
    request = json.loads(sys.stdin.read())
    sys.stdout.write(json.dumps({k: _probe_or_error(bytes.fromhex(v)) for k, v in request.items()}))


if __name__ == "__main__":
    main()
