"""Lowering: ``export`` lowers a function's forward (emitting residuals) and backward (consuming them) with jax.export.

Both modules take and give flat leaves, so the artifact holds no user class;
the manifest records every leaf's file key, dtype and (symbolic) shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import export as jexport
from jax.extend import core as jcore
from jax.sharding import NamedSharding, PartitionSpec

from .._version import __version__
from ..errors import VjpsplitError, first_line, jax_message
from ..files.dtypes import dtype_name
from ..files.prng import data_struct, from_data, impl_name, is_key, to_data
from ..files.shapes import DIM_FUNCS, IDENTIFIER, concrete_shape, dim_str, to_struct
from ..files.trees import encode_structure, flatten_with_keys
from ..tracing.choice import PolicyChoice, resolve_policy
from ..tracing.jaxprs import iter_eqns
from ..tracing.policies import apply_policy, parse_at
from ..tracing.vjp import fn_name, not_traceable, positional_names, run_backward, trace_vjp, wrt_positions
from ..tracing.zerobubble import keep_inputs, partition
from .artifact import Artifact
from .manifest import FORMAT_VERSION, Leaf, Manifest, fingerprint
from .sharding import divisibility_problem, mesh_axes, mesh_of, spec_to_json

DEFAULT_PLATFORMS = ("cpu", "cuda", "tpu")
_KNOWN_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def _leaves_json_safe(
    entries, what: str = "leaf", impls: Sequence[str] | None = None, specs: Sequence | None = None
) -> tuple[Leaf, ...]:
    """Manifest leaves for ``(key, struct)`` pairs; typed keys become their key data.

    ``impls`` gives the PRNG impl of each entry whose struct is already key data;
    ``specs`` the sharding of each (sharded artifacts).
    """
    out = []
    for i, (k, s) in enumerate(entries):
        impl = impls[i] if impls else ""
        if is_key(s):
            impl, s = impl_name(s), data_struct(s)
        try:
            dtype = dtype_name(s.dtype)
        except (VjpsplitError, TypeError) as e:
            raise VjpsplitError(f"{what} '{k}': {e}; pass arrays of a numeric, bool or PRNG key dtype") from e
        out.append(
            Leaf(
                k,
                dtype,
                tuple(dim_str(d) for d in s.shape),
                prng_impl=impl,
                sharding=spec_to_json(specs[i]) if specs and specs[i] is not None else None,
            )
        )
    return tuple(out)


def _spec_structs(name: str, spec) -> Any:
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
    """Symbolic dim names, in first-seen order; each must appear alone as some input dim."""
    plain, used = [], []
    for leaf in inputs:
        for d in leaf.shape:
            if isinstance(d, str):
                if IDENTIFIER.fullmatch(d):
                    if d not in plain:
                        plain.append(d)
                else:
                    used += [n for n in IDENTIFIER.findall(d) if n not in DIM_FUNCS]
    for n in used:
        if n not in plain:
            raise VjpsplitError(
                f"symbolic dim {n!r} appears only inside expressions in the input shapes; "
                f"give some input a plain dim {n!r} so its size can be read from the inputs"
            )
    return tuple(plain)


_CALLBACK_PRIMITIVES = ("debug_callback", "debug_print", "pure_callback", "io_callback", "callback")


def _host_callbacks(jaxpr) -> list[str]:
    """Names of host-callback primitives anywhere in ``jaxpr`` (sub-jaxprs included)."""
    return [e.primitive.name for e in iter_eqns(jaxpr) if e.primitive.name in _CALLBACK_PRIMITIVES]


def _refuse_host_callbacks(fn: Callable, structs) -> None:
    """jax.export cannot serialize host callbacks: say so before lowering fails obscurely."""
    try:
        jaxpr = jax.make_jaxpr(fn)(*structs)
    except Exception:
        return  # tracing errors surface, with context, from the export itself
    found = _host_callbacks(jaxpr)
    if found:
        raise VjpsplitError(
            f"cannot export {getattr(fn, '__name__', 'the function')}: it uses {sorted(set(found))[0]} "
            "(jax.debug.print, jax.debug.callback or another host callback), which jax.export cannot "
            "serialize; remove them before exporting"
        )


def _lower(what: str, fn: Callable, platforms: tuple[str, ...], args: Sequence, shardings=None):
    """``jax.export`` with errors that say what went wrong and, if one platform failed, which.

    ``shardings`` is ``(in_shardings, out_shardings)`` for a sharded artifact.
    """
    jit_kw = {} if shardings is None else {"in_shardings": shardings[0], "out_shardings": shardings[1]}
    try:
        return jexport.export(jax.jit(fn, **jit_kw), platforms=platforms)(*args)
    except NotImplementedError as e:  # host callbacks were refused before tracing (_refuse_host_callbacks)
        raise VjpsplitError(f"cannot export the {what}: {first_line(e)}") from e
    except VjpsplitError:
        raise
    except Exception as e:
        failing = []
        if len(platforms) > 1:
            for p in platforms:
                try:
                    jexport.export(jax.jit(fn, **jit_kw), platforms=(p,))(*args)
                except Exception:
                    failing.append(p)
        where = f" for platform(s) {', '.join(failing)}" if failing and len(failing) < len(platforms) else ""
        hint = f"; drop them with --platforms {','.join(p for p in platforms if p not in failing)}" if where else ""
        raise VjpsplitError(f"cannot export the {what}{where}: {jax_message(e)}{hint}") from e


class _Sharded:
    """One export's shardings: the mesh, and probes of the shardings XLA chooses for outputs.

    XLA picks the layout of values that no spec fixes (residuals, intermediates)
    when it compiles. A probe lowers the module for this host's platform with
    those outputs unspecified, compiles it at concrete sizes (symbolic dims from
    ``at``, else a multiple of the device count, which every mesh axis divides)
    and reads what XLA chose; the real export then fixes exactly that, so the
    backward takes residuals as the forward leaves them.
    """

    def __init__(self, mesh, dim_vars: Sequence[str], at):
        self.mesh = mesh
        self.axes = mesh_axes(mesh)
        self.nr_devices = int(mesh.devices.size)
        given = parse_at(at)
        self.probe_dims = {n: given.get(n, 4 * self.nr_devices) for n in dim_vars}
        d = jax.devices()[0]
        self.platform = "cuda" if d.platform == "gpu" else d.platform

    def shardings(self, specs):
        """NamedShardings for a pytree of PartitionSpecs (``None``, unspecified, stays None)."""
        return jax.tree_util.tree_map(
            lambda sp: None if sp is None else NamedSharding(self.mesh, sp), specs, is_leaf=_is_spec
        )

    def probe(self, what: str, fn: Callable, args, in_specs, out_specs) -> list:
        """The spec of every output of ``fn``: ``out_specs``'s where given, XLA's choice where None."""
        exp = _lower(what, fn, (self.platform,), args, (self.shardings(in_specs), self.shardings(out_specs)))
        flat_args = jax.tree_util.tree_leaves(args)
        flat_specs = jax.tree_util.tree_leaves(in_specs, is_leaf=_is_spec)
        concrete = []
        for a, sp in zip(flat_args, flat_specs):
            shape = concrete_shape(tuple(dim_str(d) for d in a.shape), self.probe_dims)
            if shape is None:
                raise VjpsplitError(
                    f"cannot size {format_struct(a)} to find the shardings XLA picks for the {what}; "
                    f"pass at= (--at NAME=SIZE) for {', '.join(self.probe_dims) or 'its dims'}"
                )
            concrete.append(jax.ShapeDtypeStruct(shape, a.dtype, sharding=NamedSharding(self.mesh, sp)))
        tree = jax.tree_util.tree_structure(args)
        compiled = jax.jit(exp.call).lower(*jax.tree_util.tree_unflatten(tree, concrete)).compile()
        return [
            o.spec if isinstance(o, NamedSharding) else None
            for o in jax.tree_util.tree_leaves(compiled.output_shardings)
        ]


def _is_spec(x) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def format_struct(a) -> str:
    return f"{a.dtype}[{','.join(str(d) for d in a.shape)}]"


def _platforms(platforms: Sequence[str] | str) -> tuple[str, ...]:
    """``"cpu,cuda"`` or a sequence of names, checked: at least one, each one jax.export knows."""
    if isinstance(platforms, str):
        platforms = tuple(p.strip() for p in platforms.split(",") if p.strip())
    try:
        platforms = tuple(platforms)
    except TypeError:
        raise VjpsplitError(
            f"platforms={platforms!r} is not a list of platform names; pass e.g. 'cpu,cuda,tpu' or ['cpu']"
        ) from None
    for p in platforms:
        if p not in _KNOWN_PLATFORMS:
            raise VjpsplitError(f"unknown platform {p!r}; use some of {', '.join(_KNOWN_PLATFORMS)}")
    if not platforms:
        raise VjpsplitError("no platforms given; use e.g. cpu,cuda,tpu")
    return platforms


def _impls(leaves) -> list[str]:
    return [impl_name(x) if is_key(x) else "" for x in leaves]


class _Forward:
    """The forward over flat leaves (typed keys as key data), and what its last trace learned.

    The user's classes live only in this closure, never in the serialized
    artifact; jax.export traces it, and the backward and the manifest read
    ``plan``, ``out``, ``aux`` and the PRNG impls of its outputs from here.
    """

    def __init__(self, fn, in_tree, in_impls, wrt_pos, single, has_aux):
        self.fn, self.in_tree, self.in_impls = fn, in_tree, in_impls
        self.wrt_pos, self.single, self.has_aux = wrt_pos, single, has_aux
        self.plan = self.out = self.aux = None
        self.out_impls = self.aux_impls = self.stored_impls = []

    def __call__(self, *leaves):
        args = jax.tree_util.tree_unflatten(self.in_tree, [from_data(x, i) for x, i in zip(leaves, self.in_impls)])
        out, stored, aux, self.plan = trace_vjp(self.fn, tuple(args), self.wrt_pos, self.single, self.has_aux)
        out_leaves, aux_leaves = jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(aux)
        self.out, self.aux = out, aux
        self.out_impls, self.aux_impls, self.stored_impls = _impls(out_leaves), _impls(aux_leaves), _impls(stored)
        return (
            tuple(to_data(x) for x in out_leaves),
            tuple(to_data(x) for x in stored),
            tuple(to_data(x) for x in aux_leaves),
        )

    def backward(self, input_backed_impls):
        """The backward of the last trace over flat leaves: ``(stored, input-backed, cts, carrier) -> grads``."""
        plan, stored_impls = self.plan, self.stored_impls

        def bwd_flat(stored, inputs_, cts, carrier_):
            # carrier_ is a zero-size array whose dims are the symbolic dims: it makes
            # them solvable even when no other backward input mentions them.
            del carrier_
            stored = [from_data(x, i) for x, i in zip(stored, stored_impls)]
            inputs_ = [from_data(x, i) for x, i in zip(inputs_, input_backed_impls)]
            return run_backward(plan, stored, inputs_, cts)

        return bwd_flat


def _carrier(dim_vars: Sequence[str], flat_structs) -> jax.ShapeDtypeStruct | None:
    """A zero-size bool array whose dims are the symbolic dims (None without any)."""
    if not dim_vars:
        return None
    scope = next(d for s in flat_structs for d in s.shape if not isinstance(d, int)).scope
    return jax.ShapeDtypeStruct((0, *jexport.symbolic_shape(",".join(dim_vars), scope=scope)), jnp.bool_)


def _input_specs(sh: "_Sharded", inputs: Sequence[Leaf], flat_structs, data_structs) -> list:
    """Each input's PartitionSpec (replicated where the spec has none), refusing splits that do not divide."""
    specs = [st.sharding.spec if st.sharding is not None else PartitionSpec() for st in flat_structs]
    sizes = dict(sh.axes)
    for leaf, st, spec in zip(inputs, data_structs, specs):
        problem = divisibility_problem(f"input '{leaf.key}'", st.shape, spec_to_json(spec), sizes)
        if problem:
            raise VjpsplitError(problem)
    return specs


def export(
    fn: Callable,
    *specs,
    wrt=None,
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

    ``specs`` are one pytree of ``jax.ShapeDtypeStruct`` (or arrays) per positional
    argument; symbolic dims (``jax.export.symbolic_shape``, one scope) make the
    artifact shape-polymorphic, and ``NamedSharding``s on them make it sharded
    (``docs/sharding.md``). ``platforms`` lists the targets lowered into the one
    artifact (default cpu, cuda, tpu; no accelerator is needed to lower for them).
    ``memory_budget`` (bytes or ``"64MiB"``; symbolic dims sized by ``at``) picks
    the policy that recomputes least among those whose stored residuals fit;
    ``policy="auto"`` the one whose forward + backward measures fastest here at
    these sizes (within the budget, if given); ``art.policy_choice`` says why.
    ``weights`` (argument names) adds the zero-bubble split of the backward:
    ``bwd_input`` (gradients of the other arguments, on the critical path) and
    ``bwd_weight`` (the weight gradients, schedulable later).
    """
    problem = not_traceable(fn)
    if problem:
        raise VjpsplitError(
            f"cannot export {fn_name(fn)}: it is {problem}; export needs a Python function that JAX can trace"
        )
    platforms = _platforms(platforms)
    names = tuple(arg_names) if arg_names is not None else tuple(positional_names(fn, len(specs)))
    if len(names) != len(specs):
        raise VjpsplitError(f"{len(specs)} specs given for {len(names)} argument names")
    structs = tuple(_spec_structs(n, s) for n, s in zip(names, specs))
    input_entries = [kv for n, s in zip(names, structs) for kv in flatten_with_keys(n, s)]
    inputs = _leaves_json_safe(input_entries, "input")
    flat_structs, in_tree = jax.tree_util.tree_flatten(structs)
    in_impls = [leaf.prng_impl for leaf in inputs]
    data_structs = [data_struct(s) if is_key(s) else s for s in flat_structs]
    dim_vars = _dim_vars(inputs)
    wrt_pos, single = wrt_positions(names, wrt, getattr(fn, "__qualname__", ""))
    # The manifest records the concrete policy (auto's measured pick, the budget's); the artifact keeps why.
    choice = resolve_policy(
        fn, *structs, policy=policy, memory_budget=memory_budget, wrt=wrt_pos, has_aux=has_aux, at=at
    )
    _refuse_host_callbacks(fn, structs)
    mesh = mesh_of([getattr(st, "sharding", None) for st in flat_structs])
    sh = _Sharded(mesh, dim_vars, at) if mesh is not None else None
    in_specs = None if sh is None else _input_specs(sh, inputs, flat_structs, data_structs)
    if in_specs is not None:
        inputs = tuple(dataclasses.replace(leaf, sharding=spec_to_json(spec)) for leaf, spec in zip(inputs, in_specs))

    policied = apply_policy(fn, choice.policy)
    fwd_flat = _Forward(policied, in_tree, in_impls, wrt_pos, single, has_aux)
    fwd_sh = out_specs = stored_specs = aux_specs = None
    if sh is not None:
        chosen = sh.probe("forward", fwd_flat, data_structs, in_specs, None)
        n_out, n_st = len(fwd_flat.plan.out_avals), fwd_flat.plan.n_stored
        out_specs, stored_specs, aux_specs = chosen[:n_out], chosen[n_out : n_out + n_st], chosen[n_out + n_st :]
        fwd_sh = (sh.shardings(in_specs), sh.shardings((tuple(out_specs), tuple(stored_specs), tuple(aux_specs))))
    fwd_exp = _lower("forward", fwd_flat, platforms, data_structs, fwd_sh)
    if getattr(policied, "fell_back", ""):  # JAX could not apply the policy: the artifact keeps everything
        choice = PolicyChoice(
            "everything",
            f"policy {choice.policy} cannot be applied to this function (JAX's checkpoint fails on it: "
            f"{policied.fell_back[:160]}); exported with policy everything instead",
        )
    plan = fwd_flat.plan
    n_out, n_stored = len(plan.out_avals), plan.n_stored
    stored_avals = list(fwd_exp.out_avals[n_out : n_out + n_stored])
    aux_avals = list(fwd_exp.out_avals[n_out + n_stored :])
    input_backed = [data_structs[k] for k in plan.input_backed]
    ct_avals = [jax.ShapeDtypeStruct(plan.out_avals[i].shape, plan.out_avals[i].dtype) for i in plan.out_diff]
    carrier = _carrier(dim_vars, flat_structs)
    bwd_flat = fwd_flat.backward([in_impls[k] for k in plan.input_backed])
    bwd_in_specs = grad_specs = None
    if sh is not None:
        bwd_in_specs = (
            list(stored_specs),
            [in_specs[k] for k in plan.input_backed],
            [out_specs[i] for i in plan.out_diff],
            PartitionSpec() if carrier is not None else None,
        )
        grad_specs = [in_specs[k] for k in plan.diff_leaves]  # gradients sharded like their arguments
    bwd_exp = _lower(
        "backward",
        bwd_flat,
        platforms,
        (stored_avals, input_backed, ct_avals, carrier),
        None if sh is None else (sh.shardings(bwd_in_specs), sh.shardings(tuple(grad_specs))),
    )

    out_keys = [k for k, _ in flatten_with_keys("out", fwd_flat.out)]
    aux_keys = [k for k, _ in flatten_with_keys("aux", fwd_flat.aux)]
    out_structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in fwd_exp.out_avals[:n_out]]
    input_keys = [k for k, _ in input_entries]
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        vjpsplit_version=__version__,
        jax_version=jax.__version__,
        calling_convention_version=fwd_exp.calling_convention_version,
        function=name or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}",
        arg_names=names,
        wrt=tuple(names[p] for p in wrt_pos),
        single_grad=single,
        has_aux=has_aux,
        policy=choice.policy,
        platforms=platforms,
        x64=bool(jax.config.jax_enable_x64),
        dim_vars=dim_vars,
        inputs=inputs,
        outputs=_leaves_json_safe(
            list(zip(out_keys, out_structs)) + list(zip(aux_keys, aux_avals)),
            "output",
            fwd_flat.out_impls + fwd_flat.aux_impls,
            None if sh is None else out_specs + aux_specs,
        ),
        residuals=_leaves_json_safe(
            [(f"r/{i}", a) for i, a in enumerate(stored_avals)], "residual", fwd_flat.stored_impls, stored_specs
        )
        + tuple(
            dataclasses.replace(inputs[k], key=f"in/{input_keys[k]}", input_backed=True) for k in plan.input_backed
        ),
        # Dtypes as the backward returns them: a custom_vjp may give another dtype than its input's (jax.vjp does).
        grads=tuple(
            dataclasses.replace(inputs[i], dtype=dtype_name(g.dtype)) if not inputs[i].prng_impl else inputs[i]
            for i, g in zip(plan.diff_leaves, bwd_exp.out_avals)
        ),
        structure={
            "args": {n: encode_structure(s, n) for n, s in zip(names, structs)},
            "out": encode_structure(fwd_flat.out, "out"),
            "aux": encode_structure(fwd_flat.aux, "aux"),
        },
        nr_devices=1 if sh is None else sh.nr_devices,
        mesh=() if sh is None else sh.axes,
    )
    exps = {"fwd": fwd_exp, "bwd": bwd_exp}
    if weights:
        weight_names = (weights,) if isinstance(weights, str) else tuple(weights)
        bad = [w for w in weight_names if w not in manifest.wrt]
        if bad:
            raise VjpsplitError(
                f"weights {', '.join(bad)} are not differentiated arguments ({', '.join(manifest.wrt)})"
            )
        exps["bwd_input"], exps["bwd_weight"], inter, w_st, w_ib = _export_split_backward(
            plan,
            manifest,
            weight_names,
            bwd_flat,
            stored_avals,
            input_backed,
            ct_avals,
            carrier,
            platforms,
            sh,
            bwd_in_specs,
            grad_specs,
        )
        backed = manifest.input_backed_keys
        manifest = dataclasses.replace(
            manifest,
            weights=weight_names,
            intermediates=inter,
            weight_residuals=tuple(f"r/{i}" for i in w_st),
            weight_inputs=tuple(backed[j] for j in w_ib),
        )
    modules = {k: bytes(e.serialize()) for k, e in exps.items()}
    manifest = dataclasses.replace(manifest, fingerprint=fingerprint(manifest, modules))
    art = Artifact(manifest, modules, exps)
    art.policy_choice = choice
    return art


def _export_split_backward(
    plan,
    manifest,
    weight_names,
    bwd_flat,
    stored_avals,
    input_backed,
    ct_avals,
    carrier,
    platforms,
    sh=None,
    bwd_in_specs=None,
    grad_specs=None,
):
    """Lower the zero-bubble halves of the backward.

    Returns ``(bwd_input, bwd_weight, intermediate leaves, weight's stored residual
    positions, weight's input-backed positions)``. ``bwd_weight`` takes only the
    residuals it reads, so the rest can be freed as soon as ``bwd_input`` has run.
    """
    closed = jax.make_jaxpr(lambda st, ib, ct: bwd_flat(st, ib, ct, None))(stored_avals, input_backed, ct_avals)
    weight_outs = [i for i, g in enumerate(manifest.grads) if g.key.split("/", 1)[0] in weight_names]
    n_st, n_ib = len(stored_avals), len(input_backed)
    ct_pos = list(range(n_st + n_ib, n_st + n_ib + len(ct_avals)))
    part = partition(closed, weight_outs, ct_pos, merge=sh is None)  # sharded: no merged axes (see fission)
    n_in_grads = len(manifest.grads) - len(weight_outs)
    reads = set(part.weight_reads)
    w_st = [i for i in range(n_st) if i in reads]
    w_ib = [j for j in range(n_ib) if n_st + j in reads]
    n_kept = n_st + n_ib
    keep = w_st + [n_st + j for j in w_ib] + list(range(n_kept, n_kept + part.n_boundary))
    input_fn = jcore.jaxpr_as_fun(part.input_part)
    weight_fn = jcore.jaxpr_as_fun(keep_inputs(part.weight_part, keep))

    def bwd_input(stored, inputs_, cts, carrier_):
        outs = input_fn(*stored, *inputs_, *cts)
        return tuple(outs[:n_in_grads]), tuple(outs[n_in_grads:])

    def bwd_weight(w_stored, w_inputs, inter, carrier_):
        return tuple(weight_fn(*w_stored, *w_inputs, *inter))

    in_args = (stored_avals, input_backed, ct_avals, carrier)
    in_sh = w_sh = inter_specs = None
    if sh is not None:
        weight_set = set(weight_outs)
        in_grad_specs = [sp for i, sp in enumerate(grad_specs) if i not in weight_set]
        chosen = sh.probe("input part of the backward", bwd_input, in_args, bwd_in_specs, (tuple(in_grad_specs), None))
        inter_specs = chosen[n_in_grads:]
        in_sh = (sh.shardings(bwd_in_specs), sh.shardings((tuple(in_grad_specs), tuple(inter_specs))))
        st_specs, ib_specs, _, carrier_spec = bwd_in_specs
        w_sh = (
            sh.shardings(([st_specs[i] for i in w_st], [ib_specs[j] for j in w_ib], list(inter_specs), carrier_spec)),
            sh.shardings(tuple(grad_specs[i] for i in weight_outs)),
        )
    in_exp = _lower("input part of the backward", bwd_input, platforms, in_args, in_sh)
    inter_avals = list(in_exp.out_avals[n_in_grads:])
    w_exp = _lower(
        "weight part of the backward",
        bwd_weight,
        platforms,
        ([stored_avals[i] for i in w_st], [input_backed[j] for j in w_ib], inter_avals, carrier),
        w_sh,
    )
    inter = _leaves_json_safe([(f"c/{i}", a) for i, a in enumerate(inter_avals)], specs=inter_specs)
    return in_exp, w_exp, inter, w_st, w_ib
