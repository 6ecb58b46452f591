"""Binding: what a caller hands a module, checked against the manifest and bound to its symbolic dims.

``Binding`` owns the checks of inputs, residuals, cotangents and intermediates (keys,
dtypes, shapes, the dims they bind, and whose forward made them), and returns each
module's arguments by slot of its signature (``trust.module_io``). It remembers the
residuals its own artifact's forward made, so a backward on them unchanged skips the
per-leaf checks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from ..errors import VjpsplitError
from ..files import keys
from ..files.dtypes import dtype_from_name
from ..files.prng import from_data
from ..tracing.residuals import Intermediates, Residuals, SplitResiduals
from ..trust.module_io import INPUT_BACKED, INTERMEDIATES, STORED, input_backed_leaves, module_io
from .arguments import check_array, check_keys, recorded_dims
from .manifest import Manifest

_MADE_KEPT = 256  # residuals ids remembered (ids and signatures only, never arrays: bounded, keeps no memory alive)


def wrap_keys(leaves: Sequence[Any], values: Sequence) -> list:
    """Typed PRNG keys back from their key data, where the manifest's ``leaves`` say so."""
    return [from_data(jnp.asarray(v), leaf.prng_impl) if leaf.prng_impl else v for leaf, v in zip(leaves, values)]


def _as_input(leaf: Any) -> Any:
    """An input-backed residual's leaf named by its input key (``in/x`` -> ``x``), as messages name it."""
    return dataclasses.replace(leaf, key=keys.input_of(leaf.key))


class Binding:
    """Checks of a module's arguments against one artifact's manifest (``source`` names the artifact)."""

    def __init__(self, manifest: Manifest, source: str):
        self.manifest = manifest
        self.source = source
        self._made: dict[str, tuple] = {}  # residuals_id -> signature, of residuals this artifact's fwd made

    # -- inputs and residuals ------------------------------------------------------------
    def inputs(self, inputs: Mapping[str, Any], source: str = "inputs") -> tuple[list, dict[str, int]]:
        """Check ``inputs`` (flat keys) against the manifest; return the arrays in order and the dims."""
        m = self.manifest
        check_keys(source, "input", [leaf.key for leaf in m.inputs], inputs)
        dims: dict[str, int] = {}
        arrays = [check_array(source, "input", leaf, inputs[leaf.key], dims) for leaf in m.inputs]
        return arrays, dims

    def remember(self, res: Residuals) -> None:
        """Note residuals this artifact's forward just made: a backward on them unchanged skips the checks."""
        signature = res.signature()
        if signature is None:
            return
        if len(self._made) >= _MADE_KEPT:
            self._made.pop(next(iter(self._made)))
        self._made[res.residuals_id] = signature  # residuals are immutable: this stays true

    def _check_origin(self, res: Any, source: str) -> None:
        m = self.manifest
        if not isinstance(res, Residuals) or isinstance(res, SplitResiduals):
            what = (
                "residuals of split(), whose backward lives in this process"
                if isinstance(res, Residuals)
                else type(res).__name__
            )
            raise VjpsplitError(f"{source}: expected residuals from an artifact's fwd, got {what}")
        if res.fingerprint != m.fingerprint:
            raise VjpsplitError(
                f"{source}: these residuals were written by another artifact (fingerprint {res.fingerprint[:12]}, "
                f"this artifact is {m.fingerprint[:12]}); run the forward of this artifact to make matching residuals"
            )

    def residuals(self, res: Residuals, source: str = "residuals") -> tuple[list, list, dict[str, int]]:
        """Validate residuals against this artifact; return stored, input-backed arrays and dims."""
        m = self.manifest
        self._check_origin(res, source)
        made = self._made.get(res.residuals_id)
        if made is not None and made == res.signature():
            # Exactly what this artifact's fwd returned (keys, shapes, dtypes, dims): already checked.
            return (
                list(res.stored.values()),
                [res.inputs[k] for k in m.input_backed_keys],
                {n: res.dims[n] for n in m.dim_vars},
            )
        dims = recorded_dims(m, res.dims, source, "residuals", "rerun the forward")
        check_keys(source, "residual", [r.key for r in m.stored_residuals], res.stored)
        stored = [
            check_array(source, "residual", leaf, res.stored[leaf.key], dict(dims)) for leaf in m.stored_residuals
        ]
        inputs = []
        for leaf in input_backed_leaves(m):
            key = keys.input_of(leaf.key)
            if key not in res.inputs:
                raise VjpsplitError(
                    f"{source}: the residuals need input '{key}', which was left out of the file to avoid a copy; "
                    "pass the forward's inputs (--inputs FILE, or load_residuals(path, inputs=args))"
                )
            inputs.append(
                check_array(res.inputs_source or source, "input", _as_input(leaf), res.inputs[key], dict(dims))
            )
        return stored, inputs, dims

    def cotangents(self, cotangents: Mapping[str, Any] | None, dims: Mapping[str, int], ct_source: str) -> list:
        """The cotangents of ``out``'s floating leaves, checked; None: 1 for a floating scalar output."""
        m = self.manifest
        ct_leaves = m.cotangent_leaves
        if cotangents is None:
            if len(m.out_keys) != 1 or len(ct_leaves) != 1 or ct_leaves[0].shape != ():
                raise VjpsplitError(
                    f"{self.source}: the output is not a single floating-point scalar, so cotangents are required; "
                    f"pass --cotangents FILE with keys {', '.join(m.out_keys)}"
                )
            return [np.ones((), dtype_from_name(ct_leaves[0].dtype))]
        check_keys(ct_source, "cotangent", list(m.out_keys), cotangents)
        return [check_array(ct_source, "cotangent", leaf, cotangents[leaf.key], dict(dims)) for leaf in ct_leaves]

    # -- the split backward's weight part ------------------------------------------------------
    def require_split(self) -> None:
        """Refuse an artifact without a split backward (no ``bwd_input``/``bwd_weight``)."""
        if not self.manifest.weights:
            raise VjpsplitError(
                f"{self.source}: the artifact has no split backward; export it with --weights NAMES "
                "(weights=...) to get bwd_input and bwd_weight"
            )

    def weight_part_residuals(self, res: Residuals) -> tuple[dict, dict]:
        """The stored residuals and inputs of ``res`` the weight part reads (every one for formats <= 2)."""
        m = self.manifest
        if m.weight_reads_subset:
            return {k: res.stored[k] for k in m.weight_residuals}, {k: res.inputs[k] for k in m.weight_inputs}
        return dict(res.stored), dict(res.inputs)

    def weight_part(
        self, res: Residuals | None, inter: Intermediates, source: str, inter_source: str
    ) -> tuple[dict[str, list], dict[str, int]]:
        """The weight part's residuals and intermediates by slot, checked, and the dims they bind."""
        m = self.manifest
        if not isinstance(inter, Intermediates) or inter.fingerprint != m.fingerprint:
            raise VjpsplitError(
                f"{inter_source}: these intermediates were not written by this artifact's input part; "
                "run run-bwd --part input of this artifact first"
            )
        if res is None and not m.weight_reads_subset:
            raise VjpsplitError(
                f"{self.source}: this artifact (format {m.format_version}) needs the residuals for "
                "its weight part too; pass --residuals (or res)"
            )
        from_res: tuple[list, list] | None = None
        if res is not None:
            res_stored, res_inputs, dims = self.residuals(res, source)
            if inter.dims != dims or (
                inter.residuals_id and res.residuals_id and inter.residuals_id != res.residuals_id
            ):
                raise VjpsplitError(
                    f"{inter_source}: the intermediates were made from other residuals than {source} "
                    "(another forward run or microbatch); pass the pair from one microbatch"
                )
            from_res = res_stored, res_inputs
        dims = recorded_dims(m, inter.dims, inter_source, "intermediates", "rerun run-bwd --part input")
        check_keys(inter_source, "intermediate", [leaf.key for leaf in m.intermediates], inter.arrays)
        values = [
            check_array(inter_source, "intermediate", leaf, inter.arrays[leaf.key], dict(dims))
            for leaf in m.intermediates
        ]
        if m.weight_reads_subset:
            w_stored, w_inputs = self._carried_residuals(inter, inter_source, dims)
        else:  # formats <= 2: W reads every residual, checked above
            assert from_res is not None  # refused above when missing
            w_stored, w_inputs = from_res
        return {STORED: w_stored, INPUT_BACKED: w_inputs, INTERMEDIATES: values}, dims

    def _carried_residuals(self, inter: Intermediates, inter_source: str, dims: dict[str, int]) -> tuple[list, list]:
        """The residuals the weight part reads, from the intermediates that carry them (format >= 3)."""
        io = module_io(self.manifest, "bwd_weight")
        assert io is not None
        stored_leaves, backed_leaves = io.input(STORED), io.input(INPUT_BACKED)
        check_keys(inter_source, "residual", [leaf.key for leaf in stored_leaves], inter.stored)
        w_stored = [
            check_array(inter_source, "residual", leaf, inter.stored[leaf.key], dict(dims)) for leaf in stored_leaves
        ]
        w_inputs = []
        for leaf in backed_leaves:
            k = keys.input_of(leaf.key)
            if k not in inter.inputs:
                raise VjpsplitError(
                    f"{inter_source}: the weight part needs input '{k}', which was left out of "
                    "the file to avoid a copy; pass the forward's inputs (--inputs FILE)"
                )
            w_inputs.append(check_array(inter_source, "input", _as_input(leaf), inter.inputs[k], dict(dims)))
        return w_stored, w_inputs
