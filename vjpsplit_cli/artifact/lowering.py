"""Lowering: ``export`` lowers a function's forward (emitting residuals) and backward (consuming them) with jax.export.

Both modules take and give flat leaves, so the artifact holds no user class;
the manifest records every leaf's file key, dtype and (symbolic) shape.
``export`` runs named steps over one ``_Export`` state: names and specs, policy,
shardings, forward, backward, manifest, and the zero-bubble split. The calls into
``jax.export`` and the sharding probes are ``jaxexport``, the flat forward ``flatforward``, the
split ``weightsplit``, the manifest's leaves from structs ``leaf``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import jax
from jax.sharding import PartitionSpec

from .._version import __version__
from ..errors import VjpsplitError
from ..files import keys
from ..files.dtypes import dtype_name
from ..files.prng import data_struct, is_key
from ..files.dims import solvable
from ..files.shapes import refuse_64bit_without_x64, to_struct
from ..files.trees import encode_structure, flatten_with_keys
from ..tracing.choice import PolicyChoice, resolve_policy
from ..tracing.policies import apply_policy
from ..tracing.traced import TracedVjp
from ..tracing.signatures import fn_name, not_traceable, positional_names, wrt_positions
from ..trust import checks
from .artifact import Artifact
from .flatforward import FlatForward, dims_arg_struct
from .jaxexport import Sharded, lower, platforms_of, refuse_host_callbacks
from .leaf import Leaf, leaves_of
from .manifest import FORMAT_VERSION, Manifest, fingerprint
from .sharding import divisibility_problem, mesh_of, spec_to_json
from .weightsplit import BackwardCall, lower_weight_split

DEFAULT_PLATFORMS = ("cpu", "cuda", "tpu")


def _spec_structs(name: str, spec: Any) -> Any:
    """``spec`` with every leaf a ShapeDtypeStruct; a bad leaf is refused by its file key."""
    entries = flatten_with_keys(name, spec)
    leaves, treedef = jax.tree_util.tree_flatten(spec)
    structs = []
    for (key, _), leaf in zip(entries, leaves):
        try:
            structs.append(to_struct(leaf))
        except VjpsplitError as e:
            raise VjpsplitError(f"input '{key}': {e}") from e
    return jax.tree_util.tree_unflatten(treedef, structs)


def _dim_vars(inputs: Sequence[Leaf]) -> tuple[str, ...]:
    """Symbolic dim names, in first-seen order; each must be one the input shapes give (``files.dims.solvable``).

    A name may appear only inside expressions (``2*b1``, ``b + 4``): a call solves it
    from the arrays' sizes, as jax.export does, and the manifest lists it like any other.
    """
    return solvable([(f"input '{leaf.key}'", leaf.shape) for leaf in inputs])


def _input_specs(sh: Sharded, inputs: Sequence[Leaf], flat_structs: Sequence[Any], data_structs: Sequence[Any]) -> list:
    """Each input's PartitionSpec (replicated where the spec has none), refusing splits that do not divide."""
    specs = [st.sharding.spec if st.sharding is not None else PartitionSpec() for st in flat_structs]
    sizes = dict(sh.axes)
    for leaf, st, spec in zip(inputs, data_structs, specs):
        problem = divisibility_problem(f"input '{leaf.key}'", st.shape, spec_to_json(spec), sizes)
        if problem:
            raise VjpsplitError(problem)
    return specs


@dataclass
class _Export:
    """One export as it goes: each step reads the fields the steps before it filled, and fills its own."""

    fn: Callable
    specs: tuple
    wrt: Any
    has_aux: bool
    policy: str | None
    memory_budget: int | str | None
    at: Mapping[str, int] | Sequence[str] | None
    # _names_and_specs
    platforms: tuple[str, ...] = field(init=False)
    names: tuple[str, ...] = field(init=False)
    structs: tuple = field(init=False)
    input_keys: list[str] = field(init=False)
    inputs: tuple[Leaf, ...] = field(init=False)
    flat_structs: list = field(init=False)
    in_tree: Any = field(init=False)
    data_structs: list = field(init=False)
    dim_vars: tuple[str, ...] = field(init=False)
    # _policy
    wrt_pos: tuple[int, ...] = field(init=False)
    single: bool = field(init=False)
    choice: PolicyChoice = field(init=False)
    # _shardings (all None unsharded); the output specs are XLA's, probed with the forward
    sh: Sharded | None = field(init=False, default=None)
    in_specs: list | None = field(init=False, default=None)
    out_specs: list | None = field(init=False, default=None)
    stored_specs: list | None = field(init=False, default=None)
    aux_specs: list | None = field(init=False, default=None)
    # _lower_forward, _lower_backward, _build_manifest, _zero_bubble
    forward: FlatForward = field(init=False)
    backward: BackwardCall = field(init=False)
    manifest: Manifest = field(init=False)
    exps: dict[str, Any] = field(init=False, default_factory=dict)

    @property
    def in_impls(self) -> list[str]:
        """The PRNG impl of each input leaf ("" for plain arrays)."""
        return [leaf.prng_impl for leaf in self.inputs]


def export(
    fn: Callable,
    *specs: Any,
    wrt: int | str | Sequence[int | str] | None = None,
    has_aux: bool = False,
    platforms: Sequence[str] | str = DEFAULT_PLATFORMS,
    policy: str | None = None,
    arg_names: Sequence[str] | None = None,
    name: str | None = None,
    memory_budget: int | str | None = None,
    at: Mapping[str, int] | Sequence[str] | None = None,
    weights: Sequence[str] | str | None = None,
) -> "Artifact":
    """Export ``fn``'s forward (emitting residuals) and backward (consuming them).

    Args:
        fn: The function to export, as ``split`` takes it.
        *specs: One pytree of ``jax.ShapeDtypeStruct`` (or arrays) per positional argument (symbolic, sharded).
        wrt: The argument positions or names to differentiate; ``None`` means all.
        has_aux: Whether ``fn`` returns ``(out, aux)``.
        platforms: The platforms to lower for (a list or a comma-separated string); by default ``DEFAULT_PLATFORMS``.
        policy: A name in ``POLICIES``, or ``"auto"`` (the fastest measured here); ``None`` keeps every residual.
        arg_names: The arguments' names in the artifact; ``None`` takes ``fn``'s parameter names.
        name: The function's name in the manifest; ``None`` takes ``fn``'s.
        memory_budget: Bytes (or ``"64MiB"``) for the stored residuals: the policy that recomputes least and fits.
        at: Sizes of the symbolic dims for the budget or ``auto`` (``{"b": 256}`` or ``["b=256"]``).
        weights: Argument names whose gradients ``bwd_weight`` computes (the zero-bubble split); ``None``: no split.

    Returns:
        The ``Artifact``, in memory (``save`` writes it; ``art.policy_choice`` says why its policy).

    Raises:
        VjpsplitError: If ``fn`` cannot be traced, or an input, argument, platform, policy, budget or size is refused.
    """
    st = _Export(fn, specs, wrt, has_aux, policy, memory_budget, at)
    _names_and_specs(st, platforms, arg_names)
    _policy(st)
    _shardings(st)
    _lower_forward(st)
    _lower_backward(st)
    _build_manifest(st, name)
    if weights:
        _zero_bubble(st, weights)
    _check_signatures(st)
    modules = {k: bytes(e.serialize()) for k, e in st.exps.items()}
    art = Artifact(dataclasses.replace(st.manifest, fingerprint=fingerprint(st.manifest, modules)), modules, st.exps)
    art.policy_choice = st.choice
    return art


def _names_and_specs(st: _Export, platforms: Sequence[str] | str, arg_names: Sequence[str] | None) -> None:
    """The argument names, the specs as structs, and the manifest's input leaves; refuses what cannot be exported."""
    problem = not_traceable(st.fn)
    if problem:
        raise VjpsplitError(
            f"cannot export {fn_name(st.fn)}: it is {problem}; export needs a Python function that JAX can trace"
        )
    st.platforms = platforms_of(platforms)
    names = tuple(arg_names) if arg_names is not None else tuple(positional_names(st.fn, len(st.specs)))
    if len(names) != len(st.specs):
        raise VjpsplitError(f"{len(st.specs)} specs given for {len(names)} argument names")
    st.names = names
    st.structs = tuple(_spec_structs(n, s) for n, s in zip(names, st.specs))
    input_entries = [kv for n, s in zip(names, st.structs) for kv in flatten_with_keys(n, s)]
    refuse_64bit_without_x64(input_entries)
    st.input_keys = [k for k, _ in input_entries]
    st.inputs = leaves_of(input_entries, "input")
    st.flat_structs, st.in_tree = jax.tree_util.tree_flatten(st.structs)
    st.data_structs = [data_struct(s) if is_key(s) else s for s in st.flat_structs]
    st.dim_vars = _dim_vars(st.inputs)


def _policy(st: _Export) -> None:
    """The differentiated arguments and the concrete policy (auto's measured pick, the budget's, or as given)."""
    st.wrt_pos, st.single = wrt_positions(st.names, st.wrt, getattr(st.fn, "__qualname__", ""))
    # The manifest records the concrete policy; the artifact keeps why.
    st.choice = resolve_policy(
        st.fn,
        *st.structs,
        policy=st.policy,
        memory_budget=st.memory_budget,
        wrt=st.wrt_pos,
        has_aux=st.has_aux,
        at=st.at,
    )
    refuse_host_callbacks(st.fn, st.structs)


def _shardings(st: _Export) -> None:
    """A sharded export's mesh and input specs (the inputs' leaves record them); nothing for unsharded specs."""
    mesh = mesh_of([getattr(s, "sharding", None) for s in st.flat_structs])
    if mesh is None:
        return
    st.sh = Sharded(mesh, st.dim_vars, st.at)
    in_specs = _input_specs(st.sh, st.inputs, st.flat_structs, st.data_structs)
    st.in_specs = in_specs
    st.inputs = tuple(dataclasses.replace(leaf, sharding=spec_to_json(sp)) for leaf, sp in zip(st.inputs, in_specs))


def _lower_forward(st: _Export) -> None:
    """Lower the forward under the chosen policy; sharded, at the output shardings XLA picks (probed first)."""
    policied = apply_policy(st.fn, st.choice.policy)
    fwd = st.forward = FlatForward(TracedVjp(policied, st.wrt_pos, st.single, st.has_aux), st.in_tree, st.in_impls)
    fwd_sh = None
    if st.sh is not None:
        chosen = st.sh.probe("forward", fwd, st.data_structs, st.in_specs, None)
        n_out, n_st = len(fwd.plan.out_avals), fwd.plan.n_stored
        st.out_specs, st.stored_specs, st.aux_specs = (
            chosen[:n_out],
            chosen[n_out : n_out + n_st],
            chosen[n_out + n_st :],
        )
        out_sh = (tuple(st.out_specs), tuple(st.stored_specs), tuple(st.aux_specs))
        fwd_sh = (st.sh.shardings(st.in_specs), st.sh.shardings(out_sh))
    st.exps["fwd"] = lower("forward", fwd, st.platforms, st.data_structs, fwd_sh)
    fell_back = getattr(policied, "fell_back", "")
    if fell_back:  # JAX could not apply the policy: the artifact keeps everything
        st.choice = PolicyChoice(
            "everything",
            f"policy {st.choice.policy} cannot be applied to this function (JAX's checkpoint fails on it: "
            f"{fell_back[:160]}); exported with policy everything instead",
        )


def _lower_backward(st: _Export) -> None:
    """Lower the backward of the forward's trace: ``(stored, input-backed, cotangents, dims_arg) -> gradients``."""
    plan, fwd_exp = st.forward.plan, st.exps["fwd"]
    n_out, n_stored = len(plan.out_avals), plan.n_stored
    stored_avals = list(fwd_exp.out_avals[n_out : n_out + n_stored])
    input_backed = [st.data_structs[k] for k in plan.input_backed]
    ct_avals = [jax.ShapeDtypeStruct(plan.out_avals[i].shape, plan.out_avals[i].dtype) for i in plan.out_diff]
    dims_arg = dims_arg_struct(st.dim_vars, st.flat_structs)
    in_impls = st.in_impls
    fn = st.forward.backward([in_impls[k] for k in plan.input_backed])
    in_specs = grad_specs = shardings = None
    if st.sh is not None:
        specs, outs = st.in_specs or [], st.out_specs or []
        in_specs = (
            list(st.stored_specs or []),
            [specs[k] for k in plan.input_backed],
            [outs[i] for i in plan.out_diff],
            PartitionSpec() if dims_arg is not None else None,
        )
        grad_specs = [specs[k] for k in plan.diff_leaves]  # gradients sharded like their arguments
        shardings = (st.sh.shardings(in_specs), st.sh.shardings(tuple(grad_specs)))
    st.backward = BackwardCall(fn, stored_avals, input_backed, ct_avals, dims_arg, in_specs, grad_specs)
    st.exps["bwd"] = lower("backward", fn, st.platforms, st.backward.args, shardings)


def _build_manifest(st: _Export, name: str | None) -> None:
    """The manifest of the two modules: every input, output, residual and gradient leaf, and the structures."""
    plan, fwd, fwd_exp, fn = st.forward.plan, st.forward, st.exps["fwd"], st.fn
    n_out, n_stored = len(plan.out_avals), plan.n_stored
    out_keys = [k for k, _ in flatten_with_keys("out", fwd.out)]
    aux_keys = [k for k, _ in flatten_with_keys("aux", fwd.aux)]
    out_structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in fwd_exp.out_avals[:n_out]]
    aux_avals = list(fwd_exp.out_avals[n_out + n_stored :])
    stored = [(keys.stored(i), a) for i, a in enumerate(st.backward.stored)]
    inputs = st.inputs
    st.manifest = Manifest(
        format_version=FORMAT_VERSION,
        vjpsplit_version=__version__,
        jax_version=jax.__version__,
        calling_convention_version=fwd_exp.calling_convention_version,
        function=name or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}",
        arg_names=st.names,
        wrt=tuple(st.names[p] for p in st.wrt_pos),
        single_grad=st.single,
        has_aux=st.has_aux,
        policy=st.choice.policy,
        platforms=st.platforms,
        x64=bool(jax.config.jax_enable_x64),  # type: ignore[attr-defined]  # jax.config is dynamic
        dim_vars=st.dim_vars,
        inputs=inputs,
        outputs=leaves_of(
            list(zip(out_keys, out_structs)) + list(zip(aux_keys, aux_avals)),
            "output",
            fwd.out_impls + fwd.aux_impls,
            None if st.sh is None else (st.out_specs or []) + (st.aux_specs or []),
        ),
        residuals=leaves_of(stored, "residual", fwd.stored_impls, st.stored_specs)
        + tuple(
            dataclasses.replace(inputs[k], key=keys.input_backed(st.input_keys[k]), input_backed=True)
            for k in plan.input_backed
        ),
        # Dtypes as the backward returns them: a custom_vjp may give another dtype than its input's (jax.vjp does).
        grads=tuple(
            dataclasses.replace(inputs[i], dtype=dtype_name(g.dtype)) if not inputs[i].prng_impl else inputs[i]
            for i, g in zip(plan.diff_leaves, st.exps["bwd"].out_avals)
        ),
        structure={
            "args": {n: encode_structure(s, n) for n, s in zip(st.names, st.structs)},
            "out": encode_structure(fwd.out, "out"),
            "aux": encode_structure(fwd.aux, "aux"),
        },
        nr_devices=1 if st.sh is None else st.sh.nr_devices,
        mesh=() if st.sh is None else st.sh.axes,
    )


def _zero_bubble(st: _Export, weights: Sequence[str] | str) -> None:
    """Add the zero-bubble split of the backward (``bwd_input``, ``bwd_weight``) and what the manifest says of it."""
    weight_names = (weights,) if isinstance(weights, str) else tuple(weights)
    bad = [w for w in weight_names if w not in st.manifest.wrt]
    if bad:
        raise VjpsplitError(f"weights {', '.join(bad)} are not differentiated arguments ({', '.join(st.manifest.wrt)})")
    weight_outs = [i for i, g in enumerate(st.manifest.grads) if keys.arg_of(g.key) in weight_names]
    split = lower_weight_split(st.backward, weight_outs, st.platforms, st.sh)
    st.exps["bwd_input"], st.exps["bwd_weight"] = split.bwd_input, split.bwd_weight
    inter = [(keys.intermediate(i), a) for i, a in enumerate(split.intermediate_avals)]
    backed = st.manifest.input_backed_keys
    st.manifest = dataclasses.replace(
        st.manifest,
        weights=weight_names,
        intermediates=leaves_of(inter, specs=split.intermediate_specs),
        weight_residuals=tuple(keys.stored(i) for i in split.weight_stored),
        weight_inputs=tuple(backed[j] for j in split.weight_inputs),
    )


def _check_signatures(st: _Export) -> None:
    """Every lowered module against the table of module signatures that loading and running read.

    ``trust.module_io`` is the one place the order of each module's inputs and outputs is
    written; holding the modules to it here means an artifact export writes is one its
    loader accepts, and a change to either side that breaks that fails at export.
    """
    for module, exp in st.exps.items():
        wrong = checks.avals_mismatch(exp, *checks.manifest_avals(st.manifest, module))
        if wrong:
            raise AssertionError(f"vjpsplit bug, please report: the {module} module's {wrong} differ from its manifest")
