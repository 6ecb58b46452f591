"""``Artifact``'s calls on flat-keyed arrays (the CLI's path), and the general path of every call.

``FlatCalls`` is a base of ``artifact.Artifact``: ``input_dims``, ``run_fwd_arrays``,
``check_residuals`` and ``run_bwd_arrays`` on ``{key: array}`` dicts, and what every call that is not
a planned one runs through: ``_forward`` and ``_backward`` on checked arguments by slot (placed,
with the carrier). Its attributes are the Artifact's. May import what ``artifact`` imports.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from ..files.trees import ArgTrees, decode_structure
from ..tracing.residuals import Residuals
from ..trust.module_io import AUX, COTANGENTS, GRADS, INPUT_BACKED, OUT, STORED
from .binding import Binding
from .callplan import CallPlan
from .manifest import Manifest
from .placement import Placement
from .runner import ModuleRunner


class FlatCalls:
    """The flat-keyed calls of ``Artifact`` (the module docstring); its attributes are the Artifact's."""

    manifest: Manifest
    _binding: Binding
    _runner: ModuleRunner
    _placement: Placement
    _runnable: Callable[[], None]

    def input_dims(self, inputs: Mapping[str, Any], source: str = "inputs") -> tuple[list, dict[str, int]]:
        """Check ``inputs`` (flat keys) against the manifest; return the arrays in order and the dims.

        Args:
            inputs: The input arrays, by flat key (``x``, ``params/w``).
            source: What to call the inputs in messages.

        Returns:
            The pair ``(arrays, dims)``: the arrays in manifest order, and the symbolic dims' values by name.

        Raises:
            VjpsplitError: If a key is missing or extra, or an array's dtype or shape does not match, naming the leaf.
        """
        return self._binding.inputs(inputs, source)

    def run_fwd_arrays(self, inputs: Mapping[str, Any], source: str = "inputs") -> tuple[dict, Residuals]:
        """Forward on flat-keyed inputs: ``({out/aux key: array}, residuals)``.

        Args:
            inputs: The input arrays, by flat key.
            source: What to call the inputs in messages.

        Returns:
            The pair ``(outputs, res)``: the output (and aux) arrays by key, and the ``Residuals``.

        Raises:
            VjpsplitError: If this host's platform is not among the artifact's, the artifact
                needs 64-bit types that are off, or the inputs do not match the manifest.
        """
        self._runnable()
        arrays, dims = self._binding.inputs(inputs, source)
        by_slot, res = self._forward(arrays, dims, (), source)
        io = self._runner.signatures["fwd"]
        return {leaf.key: v for slot in (OUT, AUX) for leaf, v in zip(io.output(slot), by_slot[slot])}, res

    def _forward(
        self, arrays: list, dims: dict[str, int], trees: ArgTrees, source: str, plan: CallPlan | None = None
    ) -> tuple[dict[str, Sequence], Residuals]:
        """Run the forward on checked input arrays (manifest order): its results by slot, and the residuals.

        ``plan``: the arguments' plan (``Binding.arguments``), noted with the residuals for ``bwd``.
        """
        m = self.manifest
        io = self._runner.signatures["fwd"]
        if m.sharded:
            arrays = self._placement.place(m.inputs, arrays)
        # Format 1 lowered the forward over one pytree per argument; 2 over the flat leaves (in that order).
        call_args = arrays if io.inputs is not None else self._args_tree(arrays)
        by_slot = io.results(self._runner.run("fwd", call_args, f"{source}: the forward refused these inputs", dims))
        return by_slot, self._binding.forward_residuals(arrays, by_slot[STORED], dims, trees, plan)

    def _args_tree(self, arrays: list) -> list:
        m = self.manifest
        it = iter(arrays)
        return [decode_structure(m.structure["args"][n], it) for n in m.arg_names]

    def check_residuals(self, res: Residuals, source: str = "residuals") -> tuple[list, list, dict]:
        """Validate residuals against this artifact; return stored, input-backed arrays and dims.

        Args:
            res: The residuals.
            source: What to call them in messages.

        Returns:
            The triple ``(stored, inputs, dims)``: the stored arrays and the input-backed
            arrays in manifest order, and the symbolic dims' values.

        Raises:
            VjpsplitError: If the residuals are not an artifact's, come from another
                artifact (fingerprint), lack an input left out of their file, or do not
                match the manifest, naming the leaf.
        """
        return self._binding.residuals(res, source)

    def run_bwd_arrays(
        self,
        res: Residuals,
        cotangents: Mapping[str, Any] | None = None,
        source: str = "residuals",
        ct_source: str = "cotangents",
    ) -> dict:
        """Backward from residuals and flat-keyed cotangents (None: 1 for a scalar output): ``{key: grad}``.

        Args:
            res: The residuals of this artifact's forward.
            cotangents: The output's cotangents by flat key; ``None`` means 1 for a
                floating-point scalar output.
            source: What to call the residuals in messages.
            ct_source: What to call the cotangents in messages.

        Returns:
            The gradients by flat key.

        Raises:
            VjpsplitError: If the host cannot run the artifact, the residuals do not
                belong to it (see ``check_residuals``), or cotangents are missing for a
                non-scalar output or do not match it.
        """
        return dict(zip(self._binding.grad_keys, self._run_bwd(res, cotangents, source, ct_source)[0]))

    def _run_bwd(
        self, res: Residuals, cotangents: Mapping[str, Any] | None, source: str, ct_source: str
    ) -> tuple[Sequence, CallPlan | None]:
        """The whole backward's gradients (manifest order), and the plan of the forward call that made ``res``."""
        self._runnable()
        out, _, plan = self._backward_from("bwd", res, cotangents, source, ct_source)
        return out[GRADS], plan

    def _backward_from(
        self, module: str, res: Residuals, cotangents: Mapping[str, Any] | None, source: str, ct_source: str
    ) -> tuple[dict[str, Sequence], dict[str, int], CallPlan | None]:
        """``module`` (``bwd`` or ``bwd_input``) on ``res`` and the cotangents, checked: its results by slot, the
        dims and the plan of the forward call that made ``res``."""
        stored, inputs, dims, plan = self._binding.residuals_planned(res, source)
        cts = self._binding.cotangents(cotangents, dims, ct_source)
        bound = {STORED: stored, INPUT_BACKED: inputs, COTANGENTS: cts}
        return self._backward(module, bound, dims, f"{source}: the backward refused these residuals"), dims, plan

    def _backward(
        self, module: str, bound: Mapping[str, Sequence], dims: Mapping[str, int], refused: str
    ) -> dict[str, Sequence]:
        """Run a backward module on checked arguments by slot: placed, with the carrier; results by slot."""
        io = self._runner.signatures[module]
        return io.results(self._runner.run(module, self._placement.call_arguments(io, bound, dims), refused, dims))
