"""``Artifact``'s zero-bubble split backward: the input part (a plan's I) and the weight part (W).

``SplitBackward`` is a base of ``artifact.Artifact``: ``bwd_input`` and ``bwd_weight`` on pytrees, their
``*_arrays`` forms on flat ``{key: array}`` dicts; ``_backward``, which runs any backward module
on checked arguments by slot, is ``flat_calls.FlatCalls``'s. Its attributes are the Artifact's. May
import what ``artifact`` imports.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..files.trees import flatten_with_keys
from ..tracing.residuals import Intermediates, Residuals
from ..trust.module_io import GRADS, INTERMEDIATES
from .arguments import grads_per_arg
from .flat_calls import FlatCalls


class SplitBackward(FlatCalls):
    """The split backward of ``Artifact`` (the module docstring); its attributes are the Artifact's."""

    def run_bwd_input_arrays(
        self,
        res: Residuals,
        cotangents: Mapping[str, Any] | None = None,
        source: str = "residuals",
        ct_source: str = "cotangents",
    ) -> tuple[dict, "Intermediates"]:
        """Input part (a plan's I): gradients of the non-weight arguments, and what the weight part needs.

        Args:
            res: The residuals of this artifact's forward.
            cotangents: The output's cotangents by flat key; ``None`` means 1 for a
                floating-point scalar output.
            source: What to call the residuals in messages.
            ct_source: What to call the cotangents in messages.

        Returns:
            The pair ``(grads, inter)``: the non-weight gradients by flat key, and the
            ``Intermediates`` the weight part reads.

        Raises:
            VjpsplitError: If the artifact has no split backward (exported without
                ``weights``), or as ``run_bwd_arrays`` raises.
        """
        self._runnable()
        self._binding.weights.require_split()
        m = self.manifest
        out, dims, _ = self._backward_from("bwd_input", res, cotangents, source, ct_source)
        io = self._runner.signatures["bwd_input"]
        grads = {g.key: v for g, v in zip(io.output(GRADS), out[GRADS])}
        computed = {leaf.key: v for leaf, v in zip(io.output(INTERMEDIATES), out[INTERMEDIATES])}
        # W's own residuals ride with the intermediates; the caller may drop res now.
        w_stored, w_inputs = self._binding.weights.weight_part_residuals(res)
        inter = Intermediates(
            computed, dims, m.fingerprint, res.residuals_id, w_stored, w_inputs, arg_trees=res.arg_trees
        )
        return grads, inter

    def weight_part_residuals(self, res: Residuals) -> tuple[dict, dict]:
        """The stored residuals and inputs of ``res`` the weight part reads (every one for formats <= 2).

        The arrays themselves, not copies: what :class:`Intermediates` carries from B to W.

        Args:
            res: The residuals of this artifact's forward.

        Returns:
            The pair ``(stored, inputs)``: the stored arrays by ``r/i`` key and the input-backed ones by input key.
        """
        return self._binding.weights.weight_part_residuals(res)

    def run_bwd_weight_arrays(
        self,
        res: Residuals | None,
        inter: "Intermediates",
        source: str = "residuals",
        inter_source: str = "intermediates",
    ) -> dict:
        """Weight part (W): the weight gradients, from the input part's intermediates.

        The intermediates carry the residuals W reads, so ``res`` may be None; when
        given, it must be the residuals the input part ran on. Artifacts of format
        2 and older read every residual: ``res`` is required for them.

        Args:
            res: The residuals the input part ran on, or ``None``.
            inter: The input part's intermediates.
            source: What to call the residuals in messages.
            inter_source: What to call the intermediates in messages.

        Returns:
            The weight gradients by flat key.

        Raises:
            VjpsplitError: If the artifact has no split backward, the intermediates are
                not this artifact's input part's, ``res`` is missing where the format
                needs it, or ``res`` is not the residuals the input part ran on.
        """
        self._runnable()
        self._binding.weights.require_split()
        bound, dims = self._binding.weights.weight_part(res, inter, source, inter_source)
        refused = f"{inter_source}: the weight backward refused these intermediates"
        out = self._backward("bwd_weight", bound, dims, refused)
        io = self._runner.signatures["bwd_weight"]
        return {g.key: v for g, v in zip(io.output(GRADS), out[GRADS])}

    def bwd_input(self, res: Residuals, ct: Any = None) -> tuple[dict, "Intermediates"]:
        """Input part of the backward: ``({arg name: grad} for non-weight args, intermediates)``.

        The intermediates hold what the weight part reads (including its share of
        the residuals), so ``res`` can be dropped once this returns.

        Args:
            res: The residuals of this artifact's ``fwd``.
            ct: The output's cotangent, a pytree shaped like the output; ``None`` means
                1 for a floating-point scalar output.

        Returns:
            The pair ``(grads, inter)``: the non-weight arguments' gradients by argument
            name, and the ``Intermediates``.

        Raises:
            VjpsplitError: As ``run_bwd_input_arrays`` raises.
        """
        cts = None if ct is None else dict(flatten_with_keys("out", ct))
        grads, inter = self.run_bwd_input_arrays(
            res, cts, source=getattr(res, "source", None) or "residuals", ct_source="cotangent"
        )
        return grads_per_arg(self.manifest, grads, self.manifest.non_weight_wrt, res.dims, res.arg_trees), inter

    def bwd_weight(self, inter: "Intermediates", res: Residuals | None = None) -> dict:
        """Weight part of the backward: ``{weight arg name: grad}``, from ``bwd_input``'s intermediates.

        ``res`` is optional (it is checked against the intermediates when given);
        the older order ``bwd_weight(res, inter)`` is accepted too.

        Args:
            inter: The intermediates ``bwd_input`` returned.
            res: The residuals the input part ran on, or ``None``.

        Returns:
            The weight arguments' gradients, by argument name.

        Raises:
            VjpsplitError: As ``run_bwd_weight_arrays`` raises.
        """
        if isinstance(inter, Residuals) and isinstance(res, Intermediates):
            inter, res = res, inter
        grads = self.run_bwd_weight_arrays(res, inter)
        return grads_per_arg(self.manifest, grads, self.manifest.weights, inter.dims, getattr(inter, "arg_trees", ()))
