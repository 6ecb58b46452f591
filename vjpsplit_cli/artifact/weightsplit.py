"""The zero-bubble split of an exported backward: ``bwd_input`` and ``bwd_weight``, lowered.

``bwd_input`` computes the gradients of the other arguments (on a pipeline's
critical path) and the intermediates the weight part needs; ``bwd_weight`` takes
only the residuals it reads plus those intermediates, so a stage frees the rest as
soon as the input part has run. The cut itself is ``tracing.zerobubble``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
from jax.extend import core as jcore

from ..tracing.zerobubble import keep_inputs, partition
from .jaxexport import Sharded, lower


@dataclass(frozen=True)
class BackwardCall:
    """A backward over flat leaves, ``fn(stored, input_backed, cts, dims_arg) -> grads``, and what it is lowered at.

    ``in_specs`` (the four arguments' PartitionSpecs) and ``grad_specs`` (one per
    gradient) are set for sharded artifacts only.
    """

    fn: Callable
    stored: list
    input_backed: list
    cts: list
    dims_arg: Any
    in_specs: tuple | None = None
    grad_specs: list | None = None

    @property
    def args(self) -> tuple:
        """The four arguments, as ``fn`` takes them."""
        return (self.stored, self.input_backed, self.cts, self.dims_arg)


@dataclass(frozen=True)
class WeightSplit:
    """The two lowered halves, the intermediates between them, and what of the residuals ``bwd_weight`` reads."""

    bwd_input: Any  # jax.export.Exported
    bwd_weight: Any
    intermediate_avals: list
    intermediate_specs: list | None  # sharded only
    weight_stored: list[int]  # positions among the stored residuals
    weight_inputs: list[int]  # positions among the input-backed residuals


def lower_weight_split(
    bwd: BackwardCall, weight_outs: Sequence[int], platforms: tuple[str, ...], sh: Sharded | None
) -> WeightSplit:
    """Cut ``bwd`` so that the gradients at ``weight_outs`` come from a separate weight part, and lower both."""
    closed = jax.make_jaxpr(lambda st, ib, ct: bwd.fn(st, ib, ct, None))(bwd.stored, bwd.input_backed, bwd.cts)
    n_st, n_ib = len(bwd.stored), len(bwd.input_backed)
    ct_pos = list(range(n_st + n_ib, n_st + n_ib + len(bwd.cts)))
    part = partition(closed, list(weight_outs), ct_pos, merge=sh is None)  # sharded: no merged axes (see fission)
    n_in_grads = len(closed.out_avals) - len(weight_outs)
    reads = set(part.weight_reads)
    w_st = [i for i in range(n_st) if i in reads]
    w_ib = [j for j in range(n_ib) if n_st + j in reads]
    n_kept = n_st + n_ib
    keep = w_st + [n_st + j for j in w_ib] + list(range(n_kept, n_kept + part.n_boundary))
    input_fn = jcore.jaxpr_as_fun(part.input_part)
    weight_fn = jcore.jaxpr_as_fun(keep_inputs(part.weight_part, keep))

    def bwd_input(stored: Sequence, inputs_: Sequence, cts: Sequence, dims_arg: Any) -> tuple[tuple, tuple]:
        outs = input_fn(*stored, *inputs_, *cts)
        return tuple(outs[:n_in_grads]), tuple(outs[n_in_grads:])

    def bwd_weight(w_stored: Sequence, w_inputs: Sequence, inter: Sequence, dims_arg: Any) -> tuple:
        return tuple(weight_fn(*w_stored, *w_inputs, *inter))

    in_sh = w_sh = inter_specs = None
    if sh is not None:
        in_sh, w_sh, inter_specs = _split_shardings(sh, bwd, bwd_input, weight_outs, n_in_grads, w_st, w_ib)
    in_exp = lower("input part of the backward", bwd_input, platforms, bwd.args, in_sh)
    inter_avals = list(in_exp.out_avals[n_in_grads:])
    w_args = ([bwd.stored[i] for i in w_st], [bwd.input_backed[j] for j in w_ib], inter_avals, bwd.dims_arg)
    w_exp = lower("weight part of the backward", bwd_weight, platforms, w_args, w_sh)
    return WeightSplit(in_exp, w_exp, inter_avals, inter_specs, w_st, w_ib)


def _split_shardings(
    sh: Sharded,
    bwd: BackwardCall,
    bwd_input: Callable,
    weight_outs: Sequence[int],
    n_in_grads: int,
    w_st: Sequence[int],
    w_ib: Sequence[int],
) -> tuple[tuple[Any, Any], tuple[Any, Any], list]:
    """Both halves' ``(in, out)`` shardings and the intermediates' specs, which XLA picks (probed)."""
    grad_specs, in_specs = bwd.grad_specs or [], bwd.in_specs or ()
    weight_set = set(weight_outs)
    in_grad_specs = [sp for i, sp in enumerate(grad_specs) if i not in weight_set]
    chosen = sh.probe("input part of the backward", bwd_input, bwd.args, in_specs, (tuple(in_grad_specs), None))
    inter_specs = chosen[n_in_grads:]
    in_sh = (sh.shardings(in_specs), sh.shardings((tuple(in_grad_specs), tuple(inter_specs))))
    st_specs, ib_specs, _, dims_arg_spec = in_specs
    w_sh = (
        sh.shardings(([st_specs[i] for i in w_st], [ib_specs[j] for j in w_ib], list(inter_specs), dims_arg_spec)),
        sh.shardings(tuple(grad_specs[i] for i in weight_outs)),
    )
    return in_sh, w_sh, inter_specs
