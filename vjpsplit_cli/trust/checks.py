"""Trust: who made an artifact (Ed25519 signatures), and what its modules may do before they compile.

An artifact is code: StableHLO that XLA compiles and runs, and ``jax.export``
trusts its input. This module stands between the file and XLA:

* **Signatures** live in module ``signing``: with trust keys,
  an unsigned file or another signer is refused before any module is read.
* **Module checks** (every artifact, signed or not): each module's StableHLO is
  parsed in a child process first, because a corrupt bytecode can crash (or corrupt
  the heap of) the parser; only a module that parsed cleanly there is parsed here.
  Its custom calls are walked: host callbacks are always refused, compiler
  annotations (sharding, shape assertions) always allowed, and kernels (LAPACK & co.)
  allowed when the signer is trusted, when ``allow_kernels`` says the user trusts
  the file, or, for the LAPACK kernels JAX emits, when their operand and result
  shapes are the ones JAX's lowering gives. The module's signature must be the
  avals the manifest promises. A clean verdict is kept in a private cache directory
  (keyed by the module's SHA-256 and jaxlib's version), so a repeated load skips
  the child process.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import subprocess
import sys
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .. import config
from ..errors import CorruptModule, VjpsplitError, cannot_deserialize
from ..files.dtypes import dtype_from_name
from ..safeio.outputs import atomic_write
from ..terminal import printable

# ------------------------------------------------------------------------------ module probes

_MALLOC_DEBUG = "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"


def _probe_here(modules: Mapping[str, bytes], source: str) -> dict:
    """Probe in this process (only for modules whose author is trusted: jax would parse them here anyway).

    The MLIR parser prints its diagnostics on file descriptor 2: they are kept off
    the terminal, and a failure is one ``VjpsplitError``.
    """
    from .mlirprobe import probe

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        return {k: probe(v) for k, v in modules.items()}
    except Exception as e:
        raise VjpsplitError(
            f"{source}: a module's StableHLO is corrupt ({type(e).__name__}); the signed artifact "
            "is damaged: ask its author to export it again"
        ) from e
    finally:
        os.dup2(saved, 2)
        os.close(saved)


PROBE_TIMEOUT_S = 60  # parsing a real module's StableHLO takes seconds, even for large models


def _probe_child(modules: Mapping[str, bytes], source: str) -> dict:
    """Probe in a child process: a module that crashes the parser crashes the child, not us."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this vjpsplit, not another one
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu", MALLOC_CHECK_="3", MALLOC_PERTURB_="165")
    if os.path.exists(_MALLOC_DEBUG) and "libc_malloc_debug" not in env.get("LD_PRELOAD", ""):
        # glibc >= 2.34 honours MALLOC_CHECK_ only with its debug malloc loaded.
        env["LD_PRELOAD"] = ":".join(p for p in (env.get("LD_PRELOAD", ""), _MALLOC_DEBUG) if p)
    request = json.dumps({k: bytes(v).hex() for k, v in modules.items()})
    try:
        done = subprocess.run(
            [sys.executable, "-m", "vjpsplit_cli.trust.mlirprobe"],
            input=request.encode(),
            capture_output=True,
            env=env,
            timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        # A real module parses in seconds; a forged one can keep the bytecode reader spinning.
        raise VjpsplitError(
            f"{source}: parsing the artifact's modules took over {PROBE_TIMEOUT_S} s; the artifact is damaged "
            "or forged: copy or export it again"
        ) from e
    except OSError as e:
        raise VjpsplitError(
            f"{source}: could not check the artifact's modules ({type(e).__name__}: {e}); "
            "retry, or export the artifact again"
        ) from e
    if done.returncode < 0:  # the parser crashed (or glibc caught it corrupting the heap)
        raise VjpsplitError(
            f"{source}: a module's StableHLO is corrupt (the parser died of signal "
            f"{-done.returncode}); the artifact is damaged or forged: copy or export it again"
        )
    try:
        result = json.loads(done.stdout) if done.returncode == 0 else None
    except ValueError:
        result = None
    if not isinstance(result, dict):
        last = (done.stderr.decode(errors="replace").strip().splitlines() or [""])[-1][:200]
        raise VjpsplitError(
            f"{source}: could not check the artifact's modules (checker exit {done.returncode}: "
            f"{last}); check that jax imports in this Python, then retry"
        )
    for k, v in result.items():
        if isinstance(v, dict) and "error" in v:
            raise CorruptModule(
                f"{source}: the {k} module's StableHLO is corrupt ({str(v['error'])[:160]}); "
                "the artifact is damaged or forged: copy or export it again",
                k,
                unreadable=cannot_deserialize(v["error"]),
            )
    return result


def _verdict_dir(cache_dir: str | None) -> str | None:
    """``<cache_dir>/checked`` when it is private to this user (a planted verdict would skip the child)."""
    if not cache_dir:
        return None
    path = os.path.join(cache_dir, "checked")
    return path if config.ensure_private_dir(cache_dir)[0] and config.ensure_private_dir(path)[0] else None


def _verdict_name(data: bytes) -> str:
    import jaxlib

    return hashlib.sha256(getattr(jaxlib, "__version__", "?").encode() + b"\0" + bytes(data)).hexdigest() + ".json"


def _read_verdict(directory: str, name: str) -> dict | None:
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022 or st.st_size > 1 << 24:
            return None
        try:
            value = json.loads(f.read())
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


DEFAULT = "default"  # ``cache_dir`` sentinel: the default cache location (``default_cache_dir``)
_SEEN: dict[str, dict] = {}  # verdict name -> probe, for modules this process has probed already


def known_verdict(name: str, cache_dir: str | None = DEFAULT) -> bool:
    """Whether a clean verdict named ``name`` is kept, in this process or in ``cache_dir``'s private directory."""
    if name in _SEEN:
        return True
    directory = _verdict_dir(default_cache_dir() if cache_dir == DEFAULT else cache_dir)
    value = _read_verdict(directory, name) if directory else None
    if value is not None:
        _SEEN[name] = value
    return value is not None


def keep_verdict(name: str, value: dict, cache_dir: str | None = DEFAULT) -> None:
    """Keep a clean verdict, in this process and (best effort) in ``cache_dir``'s private directory."""
    _SEEN[name] = value
    directory = _verdict_dir(default_cache_dir() if cache_dir == DEFAULT else cache_dir)
    if directory:
        try:
            text = json.dumps(value).encode()
            atomic_write(os.path.join(directory, name), lambda f: f.write(text))
        except (OSError, VjpsplitError):
            pass  # a cache: the next call checks again


def forget_verdicts() -> None:
    """Forget the module verdicts this process keeps in memory (the next load reads the cache directory or probes)."""
    _SEEN.clear()


def default_cache_dir() -> str | None:
    """vjpsplit's cache directory (:func:`vjpsplit_cli.config.cache_dir`)."""
    return config.cache_dir()


def probe_modules(
    modules: Mapping[str, bytes], source: str, *, in_process: bool = False, cache_dir: str | None = DEFAULT
) -> dict:
    """Each module's main signature and custom calls (``{"main": ..., "calls": [...]}``), parsed safely.

    ``cache_dir``: where verdicts persist between processes (``DEFAULT``: the default
    location; None: nowhere). Only a directory private to this user is used.
    """
    directory = _verdict_dir(default_cache_dir() if cache_dir == DEFAULT else cache_dir)
    found, todo = {}, {}
    for k, data in modules.items():
        name = _verdict_name(data)
        v = _SEEN.get(name) or (_read_verdict(directory, name) if directory else None)
        if v is not None:
            found[k] = _SEEN[name] = v
        else:
            todo[k] = data
    if todo:
        fresh = _probe_here(todo, source) if in_process else _probe_child(todo, source)
        for k in todo:
            if not isinstance(fresh.get(k), dict):
                raise VjpsplitError(f"{source}: could not check the {k} module (bad probe reply); retry")
            found[k] = _SEEN[_verdict_name(todo[k])] = fresh[k]
            if directory:
                try:
                    text = json.dumps(fresh[k]).encode()
                    atomic_write(os.path.join(directory, _verdict_name(todo[k])), lambda f, t=text: f.write(t))
                except (OSError, VjpsplitError):
                    pass  # a cache: the next load probes again
    return found


# ------------------------------------------------------------------------------ custom-call policy

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


_LAPACK = re.compile(
    r"(?:lapack_([sdcz])|cusolver_|hipsolver_)"
    r"(getrf|potrf|geqrf|orgqr|ungqr|syevd|heevd|gesdd|gesvdj|gesvd|trsm)_ffi\Z"
)
_PIVOTS = re.compile(r"(?:cu|hip)_lu_pivots_to_permutation\Z")
_REAL = {"f32": "f32", "f64": "f64", "complex<f32>": "f32", "complex<f64>": "f64"}
_LETTER = {"s": "f32", "d": "f64", "c": "complex<f32>", "z": "complex<f64>"}


def _static(t) -> tuple[str, tuple[int, ...]] | None:
    elt, dims = t
    if dims is None or any(d is None or d < 0 for d in dims):
        return None
    return elt, tuple(dims)


def lapack_shapes_ok(call: Mapping) -> bool:
    """Whether a LAPACK (or cuSOLVER) custom call's operands and results have the shapes JAX's lowering gives them.

    The kernels size their writes from the first operand ``[B..., m, n]``; a
    result declared smaller than that is a buffer overflow. Dynamic dims cannot be
    checked here: such a call needs a trusted signer or ``allow_kernels``.
    """
    target = call.get("target", "")
    ops = [_static(t) for t in call.get("operands", ())]
    res = [_static(t) for t in call.get("results", ())]
    if not ops or any(t is None for t in ops + res):
        return False
    if _PIVOTS.match(target):  # pivots [B..., k] -> permutation [B..., m], m >= k: sized by its result
        ((p_elt, piv),) = ops if len(ops) == 1 else [("", ())]
        return (
            p_elt == "i32"
            and len(res) == 1
            and res[0][0] == "i32"
            and len(res[0][1]) == len(piv) >= 1
            and res[0][1][:-1] == piv[:-1]
            and res[0][1][-1] >= piv[-1]
        )
    m_ = _LAPACK.match(target)
    if not m_:
        return False
    letter, kind = m_.groups()
    elt, a = ops[0]
    if elt not in _REAL or (letter and elt != _LETTER[letter]) or len(a) < 2:
        return False
    *batch, m, n = a
    batch, k = tuple(batch), min(m, n)
    real, i32 = _REAL[elt], "i32"

    def want(*shapes):
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
        if len(res) != 5 or res[0] != (elt, a) or res[1] != (real, (*batch, k)) or res[4] != (i32, batch):
            return False
        (u_elt, u), (v_elt, vt) = res[2], res[3]
        if u_elt != elt or v_elt != elt or u[:-2] != batch or vt[:-2] != batch:
            return False
        full = u[-2:] == (m, m) and vt[-2:] == (n, n)
        mode = call.get("attrs", {}).get("mhlo.backend_config", "")
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
    return False


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


def _dims_match(want: Sequence, got: Sequence) -> bool:
    return len(want) == len(got) and all(str(w) == str(g) for w, g in zip(want, got))


def check_avals(
    source: str,
    module: str,
    exp,
    want_in: Sequence[tuple[str, tuple]] | None,
    want_out: Sequence[tuple[str, tuple]] | None,
    main: Mapping | None,
) -> None:
    """The module's avals are what the manifest promises, and its StableHLO main says the same.

    ``want_in``/``want_out``: (numpy dtype name, shape with dim names) per leaf, or None
    where the manifest does not fix them (older layouts).
    """

    def bad(what):
        raise VjpsplitError(
            f"{source}: the {module} module's {what} do not match the manifest; the artifact was "
            "forged or damaged: export it again"
        )

    def avals(xs):
        return [(np.dtype(a.dtype).name if not _is_extended(a.dtype) else str(a.dtype), tuple(a.shape)) for a in xs]

    for want, got, what in ((want_in, exp.in_avals, "inputs"), (want_out, exp.out_avals, "outputs")):
        if want is None:
            continue
        got = avals(got)
        if len(want) != len(got) or any(w[0] != g[0] or not _dims_match(w[1], g[1]) for w, g in zip(want, got)):
            bad(what)
    if main is None:
        bad("StableHLO signature")
    kept = [exp.in_avals[i] for i in exp.module_kept_var_idx]
    ins = list(main["inputs"])
    if len(exp.platforms) > 1 and ins and ins[0] == ["i32", []]:
        ins = ins[1:]  # the platform index jax.export adds for multi-platform modules

    def same(mlir_t, aval) -> bool:
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


def _is_extended(dtype) -> bool:
    try:
        np.dtype(dtype)
        return False
    except TypeError:
        return True


def symbolic_lapack(call: Mapping) -> bool:
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
    calls: Iterable[Mapping],
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


def expected_leaves(leaves) -> list[tuple[str, tuple]]:
    """(numpy dtype name, shape) of manifest leaves, for ``check_avals``."""
    return [(np.dtype(dtype_from_name(leaf.dtype)).name, tuple(leaf.shape)) for leaf in leaves]


def check_outputs(source: str, module: str, values: Sequence, exp, dims: Mapping[str, int]) -> None:
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


def manifest_avals(m, module: str) -> tuple[list | None, list | None]:
    """(inputs, outputs) that ``module`` must have, as ``expected_leaves``, from manifest ``m``; None: not fixed."""
    carrier = [("bool", (0, *m.dim_vars))] if m.dim_vars else []
    stored = expected_leaves(m.stored_residuals)
    backed = expected_leaves([r for r in m.residuals if r.input_backed])
    outs = [o for o in m.outputs if o.key == "out" or o.key.startswith("out/")]
    aux = [o for o in m.outputs if o not in outs]
    if module == "fwd":
        ins = expected_leaves(m.inputs) if m.format_version >= 2 else None
        return ins, expected_leaves(outs) + stored + expected_leaves(aux)
    if module in ("bwd", "bwd_input"):
        ins = stored + backed + expected_leaves(m.cotangent_leaves) + carrier
        if module == "bwd":
            return ins, expected_leaves(m.grads)
        return ins, expected_leaves(m.grads_of(m.non_weight_wrt)) + expected_leaves(m.intermediates)
    if module == "bwd_weight":
        if m.weight_reads_subset:
            by_key = {r.key: r for r in m.residuals}
            ins = expected_leaves([by_key[k] for k in m.weight_residuals]) + expected_leaves(
                [by_key[f"in/{k}"] for k in m.weight_inputs]
            )
        else:
            ins = stored + backed
        return ins + expected_leaves(m.intermediates) + carrier, expected_leaves(m.grads_of(m.weights))
    return None, None


def check_modules(
    source: str,
    manifest,
    exps: Mapping[str, Any],
    probes: Mapping[str, Mapping],
    *,
    trusted_signer: bool,
    allow_kernels: bool,
) -> frozenset[str]:
    """Every check before compiling: each module's avals against the manifest, then its custom calls.

    Returns the modules whose kernels are checked again at each call's shapes (``check_calls``).
    """
    deferred = set()
    for module, exp in exps.items():
        info = probes.get(module) or {}
        want_in, want_out = manifest_avals(manifest, module)
        check_avals(source, module, exp, want_in, want_out, info.get("main"))
        calls = info.get("calls", ())
        if check_calls(source, module, calls, trusted_signer=trusted_signer, allow_kernels=allow_kernels):
            deferred.add(module)
    return frozenset(deferred)


def prepare_kernels(probes: Mapping[str, Mapping]) -> None:
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
