"""``WeightPartBinding``: the split backward's checks against one artifact's manifest.

What the weight part (``bwd_weight``) reads: the residuals it takes (all of them before format 3, a
subset after), the intermediates the input part (``bwd_input``) wrote, and the residuals those carry
from format 3 on; each checked as ``binding.Binding`` checks a backward's arguments, with the same
``checked_calls`` memory of signatures that passed.
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import VjpsplitError
from ..files import keys
from ..tracing.residuals import Intermediates, Residuals
from ..trust.module_io import INPUT_BACKED, INTERMEDIATES, STORED, module_io
from .arguments import as_input, check_array, check_keys, recorded_dims
from .manifest import Manifest
from .checked_calls import CheckedCalls, residuals_signature


class WeightPartBinding:
    """The weight part's arguments checked (``source`` names the artifact; ``residuals(res, source)``: the
    backward's residual checks, which the residuals passed alongside intermediates go through)."""

    def __init__(
        self,
        manifest: Manifest,
        source: str,
        checked: CheckedCalls,
        residuals: Callable[[Residuals, str], tuple[list, list, dict[str, int]]],
    ) -> None:
        self.manifest = manifest
        self.source = source
        self._checked = checked
        self._residuals = residuals
        self._weight_leaves: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None

    def require_split(self) -> None:
        """Refuse an artifact without a split backward (no ``bwd_input``/``bwd_weight``)."""
        if not self.manifest.splits_backward:
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
            res_stored, res_inputs, dims = self._residuals(res, source)
            if inter.dims != dims or (
                inter.residuals_id and res.residuals_id and inter.residuals_id != res.residuals_id
            ):
                raise VjpsplitError(
                    f"{inter_source}: the intermediates were made from other residuals than {source} "
                    "(another forward run or microbatch); pass the pair from one microbatch"
                )
            from_res = res_stored, res_inputs
        values, carried, dims = self._intermediates(inter, inter_source)
        if carried is None:  # formats <= 2: W reads every residual, checked above
            assert from_res is not None  # refused above when missing
            carried = from_res
        return {STORED: carried[0], INPUT_BACKED: carried[1], INTERMEDIATES: values}, dims

    def _intermediates(
        self, inter: Intermediates, inter_source: str
    ) -> tuple[list, tuple[list, list] | None, dict[str, int]]:
        """The intermediates checked, the residuals they carry (format >= 3; else None), and the dims."""
        m = self.manifest
        sig = residuals_signature(inter.stored, inter.inputs, inter.dims, inter.arrays)
        key = None if sig is None else ("intermediates", sig)
        if self._checked.get(key) is not None:
            carried = None
            if m.weight_reads_subset:
                stored_leaves, backed_leaves = self._weight_part_leaves()
                carried = (
                    [inter.stored[leaf.key] for leaf in stored_leaves],
                    [inter.inputs[keys.input_of(leaf.key)] for leaf in backed_leaves],
                )
            values = [inter.arrays[leaf.key] for leaf in m.intermediates]
            return values, carried, {n: inter.dims[n] for n in m.dim_vars}
        dims = recorded_dims(m, inter.dims, inter_source, "intermediates", "rerun run-bwd --part input")
        check_keys(inter_source, "intermediate", [leaf.key for leaf in m.intermediates], inter.arrays)
        values = [
            check_array(inter_source, "intermediate", leaf, inter.arrays[leaf.key], dict(dims))
            for leaf in m.intermediates
        ]
        carried = self._carried_residuals(inter, inter_source, dims) if m.weight_reads_subset else None
        unchanged = all(a is inter.arrays[leaf.key] for a, leaf in zip(values, m.intermediates))
        if carried is not None:
            stored_leaves, backed_leaves = self._weight_part_leaves()
            unchanged = (
                unchanged
                and all(a is inter.stored[leaf.key] for a, leaf in zip(carried[0], stored_leaves))
                and all(a is inter.inputs[keys.input_of(leaf.key)] for a, leaf in zip(carried[1], backed_leaves))
            )
        if key is not None and unchanged:
            self._checked.add(key, True)
        return values, carried, dims

    def _weight_part_leaves(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The stored and input-backed residual leaves ``bwd_weight`` takes, in order."""
        if self._weight_leaves is None:
            io = module_io(self.manifest, "bwd_weight")
            assert io is not None
            self._weight_leaves = io.input(STORED), io.input(INPUT_BACKED)
        return self._weight_leaves

    def _carried_residuals(self, inter: Intermediates, inter_source: str, dims: dict[str, int]) -> tuple[list, list]:
        """The residuals the weight part reads, from the intermediates that carry them (format >= 3)."""
        stored_leaves, backed_leaves = self._weight_part_leaves()
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
            w_inputs.append(check_array(inter_source, "input", as_input(leaf), inter.inputs[k], dict(dims)))
        return w_stored, w_inputs
