"""Artifacts: the forward and backward as ``jax.export`` modules in one self-contained file.

An artifact runs without the user's code: its manifest says every key, dtype and
(symbolic) shape, and its modules are serialized StableHLO for each platform.
``Artifact`` is the public face, one class; it delegates each job to its own module: the file's bytes
(``artifact_file``), device placement (``placement``), checking what callers hand a module
(``binding``) and running modules (``runner``), with each module's signature read from one
table (``trust.module_io``). It holds the pytree calls' planned fast path, the calls on flat
``{key: array}`` dicts and the general path of every call, and the split backward (``bwd_input``,
``bwd_weight``). ``export`` (module ``lowering``) makes artifacts, ``loading`` reads them back.
"""

from __future__ import annotations

import functools
import os
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

from jax.sharding import Mesh

from ..errors import VjpsplitError
from ..files.trees import ArgTrees, decode_structure, flatten_with_keys
from ..tracing.residuals import Intermediates, Residuals
from ..safeio.signals import signals_guarded
from ..trust import signing
from ..trust.module_io import AUX, COTANGENTS, DIMS_ARG, GRADS, INPUT_BACKED, INTERMEDIATES, OUT, STORED
from ..trust.verdicts import DEFAULT
from . import artifact_file
from .arguments import grads_per_arg
from .binding import Binding
from .callplan import CallPlan, avals_key, wrap_keys
from .manifest import Manifest
from .placement import Placement
from .runner import ModuleRunner

_FWD_REFUSED = "args: the forward refused these inputs"
_BWD_REFUSED = "residuals: the backward refused these residuals"


class Artifact:
    """A loaded or freshly exported artifact: manifest plus forward and backward modules.

    Made by ``export`` and ``load``; not usually constructed by hand.

    Args:
        manifest: What the modules take and give (keys, dtypes, symbolic shapes).
        modules: Each module's serialized bytes, by name (``fwd``, ``bwd``, ...).
        exps: The modules already deserialized as ``jax.export.Exported``, by name;
            ``None`` reads them from ``modules``.
        source: What to call the artifact in messages (its file name, say).

    Attributes:
        manifest: The artifact's ``Manifest``.
        modules: Each module's serialized bytes, by name.
        source: The artifact's name in messages.
        signature: The signature entry of a signed artifact; ``None`` if unsigned.
        signer: The signer's key id once the signature is verified (or made by ``sign``); else ``None``.
        policy_choice: How ``export`` chose the manifest's policy (auto's measurements, a
            budget's pick); ``None`` when loaded.
    """

    def __init__(
        self,
        manifest: Manifest,
        modules: Mapping[str, bytes],
        exps: Mapping[str, Any] | None = None,
        source: str = "artifact",
    ) -> None:
        self.manifest = manifest
        self.modules = dict(modules)
        self.source = source
        self._runner = ModuleRunner(manifest, self.modules, exps, source)
        self._placement = Placement(manifest, source)
        self._binding = Binding(manifest, source)
        # Trust (module trust): the signature entry, and the signer's key id once verified.
        self.signature: dict | None = None
        self.signer: str | None = None
        self._siblings: dict[tuple, "Artifact"] = {}
        # How export chose the manifest's policy (auto's measurements, a budget's pick); None when loaded.
        self.policy_choice: Any = None
        # fwd and bwd call their modules straight on a signature seen before where nothing lies between: no
        # placement (unsharded), flat leaves in (format >= 2), no typed keys out, the backward's slots as
        # ``bwd`` builds them. Else the general path, which does the same work through its slots.
        fwd_io, bwd_io = self._runner.signatures["fwd"], self._runner.signatures.get("bwd")
        self._lean = (
            not manifest.sharded
            and fwd_io.inputs is not None
            and fwd_io.output_names == (OUT, STORED, AUX)
            and not self._binding.typed_outputs
            and bwd_io is not None
            and bwd_io.input_names == (STORED, INPUT_BACKED, COTANGENTS, DIMS_ARG)
            and bwd_io.output_names == (GRADS,)
        )
        self._bare_out = manifest.structure.get("out") == "*"  # the output is one array
        self._nargs = len(manifest.arg_names)
        self._runnable = functools.partial(self._runner.check_runnable, self._mesh)  # no frame of our own per call

    # -- running, as configured by the caller ---------------------------------------------
    @property
    def executable_cache(self) -> str | None:
        """A directory of serialized executables (the CLI sets it); None: jit's own caches only."""
        return self._runner.executable_cache

    @executable_cache.setter
    def executable_cache(self, directory: str | None) -> None:
        self._runner.executable_cache = directory

    @property
    def _exps(self) -> Mapping[str, Any]:
        return self._runner.exported

    @property
    def _calls(self) -> Mapping[str, Any]:
        return self._runner.jitted

    @property
    def _check_at_call(self) -> frozenset[str]:
        return self._runner.check_at_call

    def check_kernels_at_call(self, modules: Iterable[str], cache_dir: Any = DEFAULT) -> None:
        """Check ``modules``' kernel calls at each call's concrete shapes, before they compile (``load`` sets it).

        Args:
            modules: The names of the modules to check at each call.
            cache_dir: Where to remember the verdicts; the default is vjpsplit's own cache.
        """
        self._runner.check_at_call = frozenset(modules)
        self._runner.verdict_cache = cache_dir

    # -- placement -----------------------------------------------------------------------
    def on_devices(self, devices: Iterable[Any]) -> "Artifact":
        """This artifact running on ``devices`` (exactly ``nr_devices`` of them, in mesh order).

        Pipeline stages use it to put each stage on its own device group. The
        result shares the modules and is cached per device group, so its
        compiled programs are reused; arrays on other devices are moved when a
        module runs. Unsharded artifacts run where JAX puts them: self.

        Args:
            devices: The devices, in mesh order.

        Returns:
            An ``Artifact`` on those devices (this one if unsharded or already there).
        """
        devices = tuple(devices)
        if not self.manifest.sharded or devices == self._placement.devices:
            return self
        key = tuple(d.id for d in devices)
        other = self._siblings.get(key)
        if other is None:
            other = Artifact(self.manifest, self.modules, self._runner.exported, self.source)
            other._placement = Placement(self.manifest, self.source, devices)
            other.executable_cache = self.executable_cache
            other.check_kernels_at_call(self._runner.check_at_call, self._runner.verdict_cache)
            self._siblings[key] = other
        return other

    @property
    def devices(self) -> tuple:
        """The devices a sharded artifact runs on, in mesh order; () when unsharded."""
        mesh = self.mesh
        return tuple(mesh.devices.flat) if mesh is not None else ()

    @property
    def mesh(self) -> Mesh | None:
        """The mesh a sharded artifact runs on (this host's first ``nr_devices`` devices by default); None when unsharded."""
        return self._placement.mesh

    def place_arg(self, name: str | int, value: Any) -> Any:
        """Argument ``name`` (or position) laid out as the artifact's forward takes it.

        On a sharded artifact each leaf goes to its recorded sharding on ``mesh``
        (moved from other devices if need be); otherwise it goes to JAX's default
        device. A pipeline places parameters once, and activations as they arrive.

        Args:
            name: The argument's name or position.
            value: The argument's pytree of arrays.

        Returns:
            The same pytree with its leaves placed.
        """
        return self._placement.place_arg(name, value)

    def place_cotangent(self, ct: Any) -> Any:
        """A cotangent of the output laid out as the backward takes it (see ``place_arg``).

        Args:
            ct: The cotangent, a pytree shaped like the output.

        Returns:
            The same pytree with its leaves placed.
        """
        return self._placement.place_cotangent(ct)

    @property
    def exported(self) -> Mapping[str, Any]:
        """Each module as the ``jax.export.Exported`` it was read back as (read-only)."""
        return MappingProxyType(self._runner.exported)

    def __repr__(self) -> str:
        m = self.manifest
        return f"Artifact({m.function}, args={list(m.arg_names)}, platforms={list(m.platforms)}, fingerprint={m.fingerprint[:12]})"

    # -- file ---------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The artifact file's bytes (with its signature, if signed).

        Returns:
            The whole file's contents, as ``save`` writes them.
        """
        return artifact_file.file_bytes(self.manifest, self.modules, self.signature)

    def sign(self, key: Any) -> str:
        """Sign the artifact (manifest and every module) with an Ed25519 private key or its file; return the key id.

        Args:
            key: An Ed25519 private key, or the path of its file.

        Returns:
            The signer's key id (also kept in ``signer``).
        """
        self.signature = artifact_file.signature_of(self.manifest, self.modules, key)
        self.signer = signing.key_id(self.signature["key"])
        return self.signer

    def save(self, path: str | os.PathLike) -> None:
        """Write the artifact to ``path`` (atomically: no partial file on failure).

        Args:
            path: The file to write.
        """
        artifact_file.save_file(path, self.to_bytes())

    # -- the pytree calls, on their planned fast path ------------------------------------
    def _mesh(self) -> Mesh | None:
        return self.mesh

    def fwd(self, *args: Any) -> tuple[Any, ...]:
        """Forward on pytree arguments: ``(out, res)``, or ``(out, res, aux)`` with has_aux.

        Args:
            *args: The arguments, in the exported function's order.

        Returns:
            ``(out, res)``, or ``(out, res, aux)`` when exported with ``has_aux``: the
            output pytree, the ``Residuals``, and the aux pytree.

        Raises:
            VjpsplitError: If the number of arguments is wrong, the host cannot run the
                artifact, or an argument does not match the manifest, naming the leaf.
        """
        m = self.manifest
        if len(args) != self._nargs:
            raise VjpsplitError(
                f"{self.source}: fwd takes {len(m.arg_names)} arguments ({', '.join(m.arg_names)}), got {len(args)}"
            )
        binding = self._binding
        if self._lean:
            key = avals_key(args, binding.aval_type)  # arguments that are each one concrete jax array
            if key is not None:
                signed: tuple = (key, args)
                plan = binding.plans.get(key)
            else:
                plan, signed = binding.planned(args)
            if plan is not None:
                # A signature seen before, on a plain artifact: the module straight, then what fwd returns.
                if not self._runner.host_ok:
                    self._runnable()
                arrays = signed[1] if plan.order is None else binding.ordered(plan, signed[1])
                got, stored, got_aux = self._call_planned("fwd", plan, arrays, _FWD_REFUSED)
                res = binding.forward_residuals(arrays, stored, plan.dims, plan.trees, plan)
                out = got[0] if self._bare_out else decode_structure(m.structure["out"], iter(got))
                return (out, res, decode_structure(m.structure["aux"], iter(got_aux))) if m.has_aux else (out, res)
            arrays, dims, trees, plan = binding.arguments(args, self._runnable, signed=signed)
        else:
            arrays, dims, trees, plan = binding.arguments(args, self._runnable)
        by_slot, res = self._forward(arrays, dims, trees, "args", plan)
        io = self._runner.signatures["fwd"]
        # ``out``'s leaves, then ``aux``'s, each in manifest order; typed keys wrapped back from their data.
        outs: Sequence[Any] = by_slot[OUT]
        auxs: Sequence[Any] = by_slot[AUX]
        if self._binding.typed_outputs:
            outs, auxs = wrap_keys(io.output(OUT), outs), wrap_keys(io.output(AUX), auxs)
        out = decode_structure(m.structure["out"], iter(outs))
        return (out, res, decode_structure(m.structure["aux"], iter(auxs))) if m.has_aux else (out, res)

    def _call_planned(self, module: str, plan: CallPlan, args: Sequence, refused: str) -> Any:
        """``ModuleRunner.run`` on arguments checked under ``plan``; the jitted call itself where nothing else is due.

        The call ``ModuleRunner.ready`` gave at the plan's dims is kept on the plan, with the
        runner's epoch: a change of what the checks depend on (``ModuleRunner.epoch``) asks again.
        """
        runner = self._runner
        ready = plan.ready.get(module)
        if ready is not None and ready[0] == runner.epoch and not signals_guarded():
            call = ready[1]
        else:
            epoch = runner.epoch
            got = runner.ready(module, plan.dims)
            if got is None:
                return runner.run(module, args, refused, plan.dims)
            plan.ready[module] = (epoch, got)
            call = got
        try:
            return call(*args)
        except Exception as e:
            err = runner.refusal(e, module, refused)
            if err is None:
                raise
            raise err from e

    def bwd(self, res: Residuals, ct: Any = None) -> Any:
        """Backward from residuals: gradients shaped like the ``wrt`` arguments (float0 for ints).

        Args:
            res: The residuals of this artifact's ``fwd``.
            ct: The output's cotangent, a pytree shaped like the output; ``None`` means
                1 for a floating-point scalar output.

        Returns:
            One gradient when exported with a single ``wrt``, else a tuple of gradients
            in ``wrt`` order.

        Raises:
            VjpsplitError: As ``run_bwd_arrays`` raises.
        """
        m = self.manifest
        if ct is None and self._lean:
            binding = self._binding
            made = binding.own_residuals(res)
            plan = None if made is None else made[2]
            if plan is not None:
                gather = plan.gather
                if gather is None:
                    gather = plan.gather = plan.gather_of(m.wrt, binding.grad_keys, m.single_grad)
                if gather is not None:
                    # This artifact's forward made ``res`` from a signature seen before (checked then): the
                    # module straight on them and the unit cotangent, the gradients laid out as planned.
                    if not self._runner.host_ok:
                        self._runnable()
                    call_args = (
                        list(res.stored.values()),
                        list(res.inputs.values()),
                        binding.units or binding.cotangents(None, res.dims, "cotangent"),
                        self._placement.dims_arg(res.dims) if m.dim_vars else None,
                    )
                    return gather(self._call_planned("bwd", plan, call_args, _BWD_REFUSED))
        cts = None if ct is None else dict(flatten_with_keys("out", ct))
        source = getattr(res, "source", None) or "residuals"
        values, plan = self._run_bwd(res, cts, source, "cotangent")
        layout = None if plan is None else plan.layout(m.wrt, self._binding.grad_keys)
        if layout is None:
            per_arg = grads_per_arg(m, dict(zip(self._binding.grad_keys, values)), m.wrt, res.dims, res.arg_trees)
            return per_arg[m.wrt[0]] if m.single_grad else tuple([per_arg[n] for n in m.wrt])
        # The forward's own residuals: each argument's tree and its leaves' places, worked out once per signature.
        grads = tuple(
            [
                values[where[0]] if tree is None else tree.unflatten([values[i] for i in where])
                for _, tree, where in layout
            ]
        )
        return grads[0] if m.single_grad else grads

    # -- calls on flat-keyed arrays, and the general path of every call ---------------------------
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
        """Run a backward module on checked arguments by slot: placed, with the dims argument; results by slot."""
        io = self._runner.signatures[module]
        return io.results(self._runner.run(module, self._placement.call_arguments(io, bound, dims), refused, dims))

    # -- the split backward: the input part (a plan's I) and the weight part (W) -------------------
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
