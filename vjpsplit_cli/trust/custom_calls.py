"""The custom-call policy: which custom calls a module may make before it compiles.

Host callbacks are always refused (vjpsplit never exports them); compiler annotations
(sharding, shape assertions, ops XLA itself implements) are always allowed; kernels
(LAPACK & co.) are allowed when the signer is trusted, when ``allow_kernels`` says the user
trusts the file, or, for the LAPACK kernels JAX emits, when their operand and result shapes
are the ones JAX's lowering gives (``lapack_shapes_ok``). A LAPACK call with a symbolic dim
is deferred to the call's concrete shapes (``kernelcheck``).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Sequence

from ..errors import VjpsplitError
from ..terminal import printable

# Compiler-internal annotations and ops XLA itself implements (StableHLO ops spelled as
# custom calls under shape polymorphism, TopK): no kernel of their own, shapes checked by XLA.
_ANNOTATIONS = frozenset(
    {
        "Sharding",
        "SPMDFullToShardShape",
        "SPMDShardToFullShape",
        "shape_assertion",
        "annotate_device_placement",
        "MoveToHost",
        "MoveToDevice",
        "PartitionId",
        "X64Combine",
        "X64SplitLow",
        "X64SplitHigh",
        "TopK",
        "ApproxTopK",
        "PartialReduce",
        "AllocateBuffer",
        # Linear algebra on TPU: expanded by XLA itself, which checks their shapes.
        "Eigh",
        "Qr",
        "ProductOfElementaryHouseholderReflectors",
        "LuDecomposition",
    }
)
_ANNOTATION_PREFIXES = ("xla.sdy.", "local_xla.sdy.", "sdy.", "stablehlo.", "mhlo.")
# Host callbacks run Python (or whatever a forged index points at): vjpsplit never exports them.
_CALLBACK = re.compile(r"callback|python|host_callback|xla_ffi_partial", re.IGNORECASE)


def classify(target: str) -> str:
    """``"callback"`` (always refused), ``"annotation"`` (always allowed) or ``"kernel"``."""
    if _CALLBACK.search(target):
        return "callback"
    if target in _ANNOTATIONS or target.startswith(_ANNOTATION_PREFIXES):
        return "annotation"
    return "kernel"


# Every LAPACK kernel jax.export may serialize (its ``_CPU_FFI_KERNELS``, the same in
# jax 0.6.2 and 0.10.2), and cuSOLVER's kernels of the same names.
_LAPACK = re.compile(
    r"(?:lapack_([sdcz])|cusolver_|hipsolver_)"
    r"(getrf|potrf|geqrf|orgqr|ungqr|syevd|heevd|gesdd|gesvdj|gesvd|trsm|geev|gees|gehrd|sytrd|hetrd|gtsv)_ffi\Z"
)
_PIVOTS = re.compile(r"(?:cu|hip)_lu_pivots_to_permutation\Z")
_REAL = {"f32": "f32", "f64": "f64", "complex<f32>": "f32", "complex<f64>": "f64"}
_LETTER = {"s": "f32", "d": "f64", "c": "complex<f32>", "z": "complex<f64>"}
# Kernels vouched for as LAPACK's alone: cuSOLVER's geev returns other buffers (and jax.export
# serializes no cuSOLVER geev, gees, gehrd or gtsv); its sytrd is lowered like LAPACK's.
_LAPACK_ONLY = frozenset({"geev", "gees", "gehrd", "hetrd", "gtsv"})
_COMPLEX = {
    "f32": "complex<f32>",
    "f64": "complex<f64>",
    "complex<f32>": "complex<f32>",
    "complex<f64>": "complex<f64>",
}


_Type = tuple[str, tuple[int, ...]]  # (MLIR element type, static dims) of one operand or result
# One operand or result as the probe describes it: [MLIR element type, dims (None where dynamic) or None].
_Described = Sequence[Any]


def _static(t: _Described) -> _Type | None:
    elt, dims = t
    if dims is None or any(d is None or d < 0 for d in dims):
        return None
    return elt, tuple(dims)


def _all_static(types: Iterable[_Described]) -> list[_Type] | None:
    out = [_static(t) for t in types]
    return None if any(t is None for t in out) else [t for t in out if t is not None]


def _pivots_ok(ops: list[_Type], res: list[_Type]) -> bool:
    """pivots [B..., k] -> permutation [B..., m], m >= k: sized by its result."""
    ((p_elt, piv),) = ops if len(ops) == 1 else [("", ())]
    return (
        p_elt == "i32"
        and len(res) == 1
        and res[0][0] == "i32"
        and len(res[0][1]) == len(piv) >= 1
        and res[0][1][:-1] == piv[:-1]
        and res[0][1][-1] >= piv[-1]
    )


def _svd_ok(letter: str | None, a: _Type, res: list[_Type], mode: str) -> bool:
    """gesdd/gesvdj/gesvd: [A, S, U, Vt, info], U and Vt as large as the mode says the kernel writes."""
    elt, shape = a
    *batch_, m, n = shape
    batch, k, real = tuple(batch_), min(m, n), _REAL[elt]
    if len(res) != 5 or res[0] != a or res[1] != (real, (*batch, k)) or res[4] != ("i32", batch):
        return False
    (u_elt, u), (v_elt, vt) = res[2], res[3]
    if u_elt != elt or v_elt != elt or u[:-2] != batch or vt[:-2] != batch:
        return False
    full = u[-2:] == (m, m) and vt[-2:] == (n, n)
    if letter:  # LAPACK's mode says what it writes: 'A' full, 'S' reduced, 'N' no vectors
        if "mode = 78" in mode:
            return True
        if "mode = 65" in mode:
            return full
        if "mode = 83" in mode:
            return u[-2:] == (m, k) and vt[-2:] == (k, n)
        return False
    # cuSOLVER: full matrices, when asked for or where every mode writes the same sizes.
    return full and (m == n or "full_matrices = true" in mode)


def lapack_shapes_ok(call: Mapping[str, Any]) -> bool:
    """Whether a LAPACK (or cuSOLVER) custom call's operands and results have the shapes JAX's lowering gives them.

    The kernels size their writes from the first operand ``[B..., m, n]``; a
    result declared smaller than that is a buffer overflow. Dynamic dims cannot be
    checked here: such a call needs a trusted signer or ``allow_kernels``.
    """
    target = call.get("target", "")
    ops = _all_static(call.get("operands", ()))
    res = _all_static(call.get("results", ()))
    if not ops or res is None:
        return False
    if _PIVOTS.match(target):
        return _pivots_ok(ops, res)
    m_ = _LAPACK.match(target)
    if not m_:
        return False
    letter, kind = m_.groups()
    if (letter and ops[0][0] != _LETTER[letter]) or (not letter and kind in _LAPACK_ONLY):
        return False
    if kind == "gtsv":
        return _gtsv_ok(ops, res)
    elt, a = ops[0]
    if elt not in _REAL or (letter and elt != _LETTER[letter]) or len(a) < 2:
        return False
    *batch_, m, n = a
    batch, k = tuple(batch_), min(m, n)
    real, i32 = _REAL[elt], "i32"

    def want(*shapes: _Type) -> bool:
        return len(res) == len(shapes) and all(r == s for r, s in zip(res, shapes))

    if kind == "getrf":
        return len(ops) == 1 and want((elt, a), (i32, (*batch, k)), (i32, batch))
    if kind == "potrf":
        return len(ops) == 1 and m == n and want((elt, a), (i32, batch))
    if kind == "geqrf":
        return len(ops) == 1 and want((elt, a), (elt, (*batch, k)))
    if kind in ("orgqr", "ungqr"):
        return (
            len(ops) == 2
            and ops[1][0] == elt
            and len(ops[1][1]) == len(a) - 1
            and ops[1][1][:-1] == batch
            and ops[1][1][-1] <= k
            and want((elt, a))
        )
    if kind in ("syevd", "heevd"):
        return len(ops) == 1 and m == n and want((elt, a), (real, (*batch, n)), (i32, batch))
    if kind == "trsm":
        if len(ops) != 2:
            return False
        b_elt, b = ops[1]
        return b_elt == elt and m == n and len(b) == len(a) and b[:-2] == batch and n in b[-2:] and want((elt, b))
    if kind in ("gesdd", "gesvdj", "gesvd"):
        return _svd_ok(letter, (elt, a), res, _config(call))
    if len(ops) != 1 or m != n:  # the rest take one square [B..., n, n] matrix
        return False
    if kind == "geev":  # [(wr, wi) or w, vl, vr, info]: both vector buffers full, computed or not
        vecs = (_COMPLEX[elt], a)
        w = [(elt, (*batch, n)), (elt, (*batch, n))] if elt == real else [(elt, (*batch, n))]
        return want(*w, vecs, vecs, (i32, batch))
    if kind == "gees":  # [T, Z, (wr, wi) or w, sdim, info]; LAPACK's sort needs a select function JAX never passes
        w = [(elt, (*batch, n)), (elt, (*batch, n))] if elt == real else [(elt, (*batch, n))]
        return _attr(_config(call), "sort") == "78 : ui8" and want((elt, a), (elt, a), *w, (i32, batch), (i32, batch))
    if kind == "gehrd":  # [A, taus, info], reducing rows and columns low..high = 1..n, as JAX asks
        config = _config(call)
        return (
            n >= 1
            and _attr(config, "low") == "1 : i32"
            and _attr(config, "high") == f"{n} : i32"
            and want((elt, a), (elt, (*batch, n - 1)), (i32, batch))
        )
    if kind in ("sytrd", "hetrd"):  # [A, d, e, taus, info]
        return n >= 1 and want(
            (elt, a), (real, (*batch, n)), (real, (*batch, n - 1)), (elt, (*batch, n - 1)), (i32, batch)
        )
    return False


def _config(call: Mapping[str, Any]) -> str:
    """The kernel's attributes as the probe printed them (``{high = 5 : i32, low = 1 : i32}``)."""
    return str(call.get("attrs", {}).get("mhlo.backend_config", ""))


def _attr(config: str, name: str) -> str | None:
    """The value of one attribute in ``_config``'s text (``"5 : i32"``); None when it is not there whole."""
    m = re.search(rf"(?:^|[{{,]) ?{name} = ([^,}}]*)(?=[,}}])", config)
    return m.group(1).strip() if m else None


def _gtsv_ok(ops: list[_Type], res: list[_Type]) -> bool:
    """gtsv: dl, d, du [B..., m] and b [B..., m, r] -> the same four, and info [B...]: sized by b, as the kernel is."""
    if len(ops) != 4:
        return False
    elt, b = ops[3]
    if elt not in _REAL or len(b) < 2:
        return False
    diag = (elt, b[:-1])
    return ops[:3] == [diag, diag, diag] and res == [*ops, ("i32", b[:-2])]


def symbolic_lapack(call: Mapping[str, Any]) -> bool:
    """Whether ``call`` is a LAPACK (or cuSOLVER) kernel JAX emits with some dim only known at call time.

    Its shapes are checked once the module is refined to the call's shapes (module
    ``kernelcheck``), before it compiles.
    """
    target = str(call.get("target", ""))
    if not (_LAPACK.match(target) or _PIVOTS.match(target)):
        return False
    types = [*call.get("operands", ()), *call.get("results", ())]
    return any(t[1] is None or any(d is None for d in t[1]) for t in types)


def check_calls(
    source: str,
    module: str,
    calls: Iterable[Mapping[str, Any]],
    *,
    trusted_signer: bool,
    allow_kernels: bool,
    refined: bool = False,
) -> bool:
    """Refuse host callbacks always; kernels unless signed by a trusted key, allowed, or shape-checked.

    Returns whether the module must be checked again at the call's shapes: a LAPACK
    kernel with a symbolic dim (``symbolic_lapack``) is vouched for only then.
    ``refined``: the calls are those of a module refined to concrete shapes.
    """
    deferred = False
    for call in calls:
        target = str(call.get("target", ""))
        kind = classify(target)
        if kind == "callback":
            raise VjpsplitError(
                f"{source}: the {module} module calls a host callback ({printable(target)!r}), which vjpsplit "
                "never exports and never runs; the artifact was forged: do not run it"
            )
        if kind == "kernel" and not (trusted_signer or allow_kernels or lapack_shapes_ok(call)):
            if not refined and symbolic_lapack(call):
                deferred = True
                continue
            at = " at the call's shapes" if refined else ""
            raise VjpsplitError(
                f"{source}: the {module} module calls the kernel {printable(target)!r} with operand/result shapes "
                f"this vjpsplit cannot vouch for{at}; if you trust the file, sign it and pass --trust-key, or pass "
                "--allow-kernels (allow_kernels=True)"
            )
    return deferred
