"""Each stage's evaluation program: its forward alone, exported without residuals, and its file beside the artifact.

``export_stages`` exports, beside each stage's artifact, a plain ``jax.export`` of
the same stage function over the artifact forward's flat input leaves (the
stage's parameters, what it receives, the batch leaves it reads), returning only
what the stage sends on (the loss, for the last): no residual comes out, so
nothing is kept for a backward; the last stage of a function with aux returns
the loss, then the aux leaves. ``Stages.save`` writes it as ``stage<k>.eval``
(``jax.export``'s serialization) and records its file and SHA-256 in
``stages.json`` (index version 2), so a signed index vouches for it; loading
checks the digest, parses the module in the checker's child process like an
artifact's modules (host callbacks refused, kernels held to the same rules) and
holds its inputs and outputs to the artifact's forward before anything compiles.
A sharded stage gets no evaluation program (``evaluate`` refuses it).
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import jax
from jax import export as jexport

from ...errors import CorruptModule, VjpsplitError
from ...files.dtypes import dtype_name
from ...files.prng import data_struct, from_data, impl_name, is_key, to_data
from ...files.shapes import dim_str
from ...safeio.reading import read_bytes
from ...trust import probes
from ...treetypes import Leaf
from ...trust.custom_calls import check_calls
from .costmodel import Shaped
from .cut import StageOut

if TYPE_CHECKING:
    from ...artifact.artifact import Artifact

SUFFIX = ".eval"
REEXPORT = "export the stages again with this vjpsplit (export_stages(...).save(DIR), or `vjpsplit export ... --stages -o DIR`)"


def eval_file(stage: int) -> str:
    """The file name of stage ``stage``'s evaluation program in a stages directory."""
    return f"stage{stage}{SUFFIX}"


def _aval_text(a: Shaped) -> str:
    return f"{dtype_name(a.dtype)}[{','.join(str(dim_str(d)) for d in a.shape)}]"


class EvalProgram:
    """One stage's forward without residuals: ``run(*leaves)`` takes the artifact forward's flat input leaves and
    returns the leaves the stage sends on (the loss, for the last stage)."""

    def __init__(self, exported: jexport.Exported, data: bytes | None = None):
        self.exported = exported
        self.data = bytes(exported.serialize()) if data is None else data
        self.sha256 = hashlib.sha256(self.data).hexdigest()
        self._jitted: Callable[..., Sequence[jax.Array]] | None = None

    @property
    def num_outputs(self) -> int:
        """How many arrays the program returns (what the stage sends on; no residual among them)."""
        return len(self.exported.out_avals)

    def run(self, *leaves: Leaf) -> tuple[jax.Array, ...]:
        """The stage's outputs for ``leaves`` (one jitted call; it runs where its committed inputs are); a typed
        PRNG key among them goes in as its key data, as the artifact's forward takes it."""
        if self._jitted is None:
            self._jitted = jax.jit(self.exported.call)
        return tuple(self._jitted(*(to_data(x) for x in leaves)))

    @classmethod
    def from_bytes(cls, data: bytes, source: str) -> EvalProgram:
        """A program from ``jax.export``'s serialization (``data``); bytes that are not one are one error."""
        try:
            exp = jexport.deserialize(bytearray(data))
        except Exception as e:  # noqa: BLE001 - any parse failure of a damaged file is the same refusal
            raise VjpsplitError(f"{source}: not a vjpsplit evaluation program ({type(e).__name__}); {REEXPORT}") from e
        return cls(exp, bytes(data))


def forward_outputs(art: Artifact) -> list[Shaped]:
    """The avals of what ``art``'s forward returns as its outputs (its first results, before any residual), then
    its aux (its last results, an artifact exported with ``has_aux``)."""
    m = art.manifest
    n = sum(1 for o in m.outputs if o.key in m.out_keys)
    avals = list(art.exported["fwd"].out_avals)
    n_aux = len(m.outputs) - n
    return avals[:n] + (avals[len(avals) - n_aux :] if n_aux else [])


def check_program(program: EvalProgram, art: Artifact, source: str) -> None:
    """Refuse ``program`` unless it takes exactly the inputs of ``art``'s forward and returns exactly its outputs."""
    exp, fwd = program.exported, art.exported["fwd"]
    keys = [leaf.key for leaf in art.manifest.inputs]
    got_in, want_in = list(exp.in_avals), list(fwd.in_avals)
    if len(got_in) != len(want_in):
        raise VjpsplitError(f"{source}: takes {len(got_in)} inputs, the stage's forward {len(want_in)}; {REEXPORT}")
    for i, (g, w) in enumerate(zip(got_in, want_in)):
        if _aval_text(g) != _aval_text(w):
            name = keys[i] if i < len(keys) else f"#{i}"
            raise VjpsplitError(
                f"{source}: input '{name}': expected {_aval_text(w)}, the program takes {_aval_text(g)}; {REEXPORT}"
            )
    got_out, want_out = list(exp.out_avals), forward_outputs(art)
    if [_aval_text(a) for a in got_out] != [_aval_text(a) for a in want_out]:
        raise VjpsplitError(
            f"{source}: returns {', '.join(map(_aval_text, got_out)) or 'nothing'}, the stage's forward outputs are "
            f"{', '.join(map(_aval_text, want_out))}; {REEXPORT}"
        )
    if tuple(exp.platforms) != tuple(fwd.platforms):
        raise VjpsplitError(
            f"{source}: exported for {', '.join(exp.platforms)}, the stage for {', '.join(fwd.platforms)}; {REEXPORT}"
        )


def export_eval(
    stage_fn: Callable[..., StageOut], arg_specs: Sequence[Sequence[jax.ShapeDtypeStruct]], art: Artifact, source: str
) -> EvalProgram | None:
    """Stage ``stage_fn``'s evaluation program over the flat leaves of ``arg_specs`` (its arguments' specs, with
    the stage's symbolic dims) for ``art``'s platforms, checked against ``art`` (the stage's artifact; ``source``
    names the stage in an error); None for a sharded stage."""
    if art.manifest.sharded:
        return None
    tree = jax.tree_util.tree_structure(tuple(arg_specs))
    specs = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in jax.tree_util.tree_leaves(tuple(arg_specs))]
    impls = [impl_name(s) if is_key(s) else None for s in specs]  # typed keys go in as key data (the artifact's)
    flat = [data_struct(s) if impl else s for s, impl in zip(specs, impls)]

    def forward_only(*leaves: jax.Array) -> tuple[jax.Array, ...]:
        typed = [from_data(x, impl) for x, impl in zip(leaves, impls)]
        out = stage_fn(*jax.tree_util.tree_unflatten(tree, typed))
        return tuple(to_data(x) for x in jax.tree_util.tree_leaves(out))  # a key sent on: its data, as it came

    program = EvalProgram(jexport.export(jax.jit(forward_only), platforms=tuple(art.manifest.platforms))(*flat))
    check_program(program, art, f"{source}'s evaluation program")
    return program


def read_eval(directory: str, name: str, sha256: str) -> EvalProgram:
    """The evaluation program in ``directory/name``, refused unless its bytes have the SHA-256 ``stages.json``
    records (its module is not parsed yet: ``check_loaded``)."""
    if os.path.basename(name) != name or not name:
        raise VjpsplitError(f"{directory}: an evaluation program names no file in this directory; {REEXPORT}")
    path = os.path.join(directory, name)
    data = read_bytes(path, "evaluation program")
    if hashlib.sha256(data).hexdigest() != sha256:
        raise VjpsplitError(
            f"{path}: not the evaluation program stages.json was saved with (SHA-256 differs); {REEXPORT}"
        )
    return EvalProgram.from_bytes(data, path)


def check_loaded(
    programs: Mapping[str, tuple[EvalProgram, Artifact]], *, trusted_signer: bool, allow_kernels: bool
) -> None:
    """Refuse any of ``programs`` (source -> (program, its stage's artifact)) whose module fails the artifact's
    module checks (parsed in the checker's child process, all in one) or that does not fit its stage's forward."""
    if not programs:
        return
    modules = {src: p.exported.mlir_module_serialized for src, (p, _) in programs.items()}
    first = next(iter(programs))  # the directory, in the probe's own errors
    try:
        probed = probes.probe_modules(modules, os.path.dirname(first), in_process=trusted_signer)
    except CorruptModule as e:
        raise VjpsplitError(f"{e.module}: the evaluation program's StableHLO is corrupt; {REEXPORT}") from e
    for src, (program, art) in programs.items():
        calls = (probed.get(src) or {}).get("calls", ())
        if check_calls(src, "eval", calls, trusted_signer=trusted_signer, allow_kernels=allow_kernels):
            raise VjpsplitError(
                f"{src}: the evaluation program calls a kernel at symbolic shapes this vjpsplit cannot vouch for; "
                "sign the stages and pass trust=, or pass allow_kernels=True"
            )
        check_program(program, art, src)


def missing(source: str, stages: Sequence[int]) -> str:
    """The one line ``evaluate`` refuses a ``Stages`` with that lacks the evaluation programs of ``stages``."""
    which = ", ".join(map(str, stages))
    return (
        f"{source}: no evaluation program for stage{'s' if len(stages) > 1 else ''} {which} (exported before "
        f"vjpsplit wrote them, or sharded); to evaluate, {REEXPORT}"
    )
