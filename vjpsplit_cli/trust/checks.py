"""Module checks: an artifact's modules are what its manifest promises, before anything compiles.

An artifact is code: StableHLO that XLA compiles and runs, and ``jax.export``
trusts its input. Every module of every artifact, signed or not, passes these checks:
its StableHLO was parsed safely first (``probes``, with the verdict cache in
``verdicts``); its signature must be the avals the manifest promises (``check_avals``,
against the table in ``module_io``); its custom calls must pass the policy in
``custom_calls``. After a run, its outputs must be what it declared (``check_outputs``).
Signatures (who made a file) live in ``signing``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, NoReturn, Protocol, Sequence

import numpy as np

from ..errors import VjpsplitError
from ..files.dtypes import dtype_from_name
from .custom_calls import check_calls as check_calls
from .custom_calls import lapack_shapes_ok as lapack_shapes_ok
from .module_io import module_io

if TYPE_CHECKING:  # jax is imported by what calls these checks, not by this module
    from jax import export as jexport

# Read here by ``pipeline.optimizer`` and the benchmarks; their home is ``probes`` and ``verdicts``.

# ------------------------------------------------------------------------------ avals

_MLIR_ELT = {
    "bool": "i1",
    "int8": "i8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "uint8": "ui8",
    "uint16": "ui16",
    "uint32": "ui32",
    "uint64": "ui64",
    "float16": "f16",
    "bfloat16": "bf16",
    "float32": "f32",
    "float64": "f64",
    "complex64": "complex<f32>",
    "complex128": "complex<f64>",
}


Aval = tuple[str, tuple[int | str, ...]]  # (numpy dtype name, shape with dim names) of one manifest leaf
_MlirType = Sequence[Any]  # the probe's [MLIR element type, dims or None] (JSON: a list)


class _LeafSpec(Protocol):
    """What the checks read of a manifest leaf (``artifact.leaf.Leaf``)."""

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int | str, ...]: ...


class _Array(Protocol):
    """What ``check_outputs`` reads of a returned array."""

    @property
    def dtype(self) -> Any: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


def _dims_match(want: Sequence[object], got: Sequence[object]) -> bool:
    return len(want) == len(got) and all(str(w) == str(g) for w, g in zip(want, got))


def avals_mismatch(exp: jexport.Exported, want_in: Sequence[Aval] | None, want_out: Sequence[Aval] | None) -> str:
    """Which of ``exp``'s avals ("inputs" or "outputs") differ from the manifest's (as ``expected_leaves``); "" if none."""

    def avals(xs: Iterable[Any]) -> list[tuple[str, tuple[Any, ...]]]:
        return [(np.dtype(a.dtype).name if not _is_extended(a.dtype) else str(a.dtype), tuple(a.shape)) for a in xs]

    for want, got, what in ((want_in, exp.in_avals, "inputs"), (want_out, exp.out_avals, "outputs")):
        if want is None:
            continue
        have = avals(got)
        if len(want) != len(have) or any(w[0] != g[0] or not _dims_match(w[1], g[1]) for w, g in zip(want, have)):
            return what
    return ""


def check_avals(
    source: str,
    module: str,
    exp: jexport.Exported,
    want_in: Sequence[Aval] | None,
    want_out: Sequence[Aval] | None,
    main: Mapping[str, Any] | None,
) -> None:
    """The module's avals are what the manifest promises, and its StableHLO main says the same.

    ``want_in``/``want_out``: (numpy dtype name, shape with dim names) per leaf, or None
    where the manifest does not fix them (older layouts).
    """

    def bad(what: str) -> NoReturn:
        raise VjpsplitError(
            f"{source}: the {module} module's {what} do not match the manifest; the artifact was "
            "forged or damaged: export it again"
        )

    wrong = avals_mismatch(exp, want_in, want_out)
    if wrong:
        bad(wrong)
    if main is None:
        bad("StableHLO signature")
    kept = [exp.in_avals[i] for i in exp.module_kept_var_idx]
    ins = list(main["inputs"])
    if len(exp.platforms) > 1 and ins and ins[0] == ["i32", []]:
        ins = ins[1:]  # the platform index jax.export adds for multi-platform modules

    def same(mlir_t: _MlirType, aval: Any) -> bool:
        elt, dims = mlir_t
        name = np.dtype(aval.dtype).name if not _is_extended(aval.dtype) else ""
        if name in _MLIR_ELT and _MLIR_ELT[name] != elt:
            return False
        if dims is None or len(dims) != len(aval.shape):
            return False
        return all((d is None) if not isinstance(s, int) else d == s for d, s in zip(dims, aval.shape))

    if len(ins) != len(kept) or not all(same(t, a) for t, a in zip(ins, kept)):
        bad("StableHLO inputs")
    outs = list(main["results"])
    if len(outs) != len(exp.out_avals) or not all(same(t, a) for t, a in zip(outs, exp.out_avals)):
        bad("StableHLO outputs")


def _is_extended(dtype: Any) -> bool:
    try:
        np.dtype(dtype)
        return False
    except TypeError:
        return True


def expected_leaves(leaves: Iterable[_LeafSpec]) -> list[Aval]:
    """(numpy dtype name, shape) of manifest leaves, for ``check_avals``."""
    return [(np.dtype(dtype_from_name(leaf.dtype)).name, tuple(leaf.shape)) for leaf in leaves]


def check_outputs(
    source: str, module: str, values: Sequence[_Array], exp: jexport.Exported, dims: Mapping[str, int]
) -> None:
    """After a run: every output has the dtype and (concrete) shape the module declared."""
    from ..files.shapes import concrete_shape

    if len(values) != len(exp.out_avals):
        raise VjpsplitError(
            f"{source}: the {module} module returned {len(values)} arrays, not "
            f"{len(exp.out_avals)}; the artifact is forged or damaged"
        )
    for v, a in zip(values, exp.out_avals):
        shape = concrete_shape(tuple(d if isinstance(d, int) else str(d) for d in a.shape), dims)
        if np.dtype(v.dtype) != np.dtype(a.dtype) if not _is_extended(a.dtype) else False:
            raise VjpsplitError(
                f"{source}: the {module} module returned {v.dtype}, declared {a.dtype}; "
                "the artifact is forged or damaged"
            )
        if shape is not None and tuple(v.shape) != tuple(shape):
            raise VjpsplitError(
                f"{source}: the {module} module returned shape {tuple(v.shape)}, declared "
                f"{tuple(shape)}; the artifact is forged or damaged"
            )


def manifest_avals(m: Any, module: str) -> tuple[list[Aval] | None, list[Aval] | None]:
    """(inputs, outputs) that ``module`` must have, as ``expected_leaves``, from manifest ``m``; None: not fixed."""
    io = module_io(m, module)
    if io is None:
        return None, None
    ins = io.input_leaves
    return (None if ins is None else expected_leaves(ins)), expected_leaves(io.output_leaves)


def check_modules(
    source: str,
    manifest: Any,
    exps: Mapping[str, jexport.Exported],
    probes: Mapping[str, Mapping[str, Any]],
    *,
    trusted_signer: bool,
    allow_kernels: bool,
) -> frozenset[str]:
    """Every check before compiling: each module's avals against the manifest, then its custom calls.

    Returns the modules whose kernels are checked again at each call's shapes (``check_calls``).
    """
    deferred: set[str] = set()
    for module, exp in exps.items():
        info = probes.get(module) or {}
        want_in, want_out = manifest_avals(manifest, module)
        check_avals(source, module, exp, want_in, want_out, info.get("main"))
        calls = info.get("calls", ())
        if check_calls(source, module, calls, trusted_signer=trusted_signer, allow_kernels=allow_kernels):
            deferred.add(module)
    return frozenset(deferred)


def prepare_kernels(probes: Mapping[str, Mapping[str, Any]]) -> None:
    """Initialise the LAPACK kernels the checked modules call (jaxlib < 0.7 fills their function table only
    when jax lowers a linear-algebra op itself: a deserialized module would call null pointers)."""
    if not any(str(c.get("target", "")).startswith("lapack_") for p in probes.values() for c in p.get("calls", ())):
        return
    try:
        from jaxlib.cpu import _lapack
    except ImportError:
        return
    init = getattr(_lapack, "initialize", None)
    if init is not None:
        init()
