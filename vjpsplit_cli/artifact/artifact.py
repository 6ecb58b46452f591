"""Artifacts: the forward and backward as ``jax.export`` modules in one self-contained file.

An artifact runs without the user's code: its manifest says every key, dtype and
(symbolic) shape, and its modules are serialized StableHLO for each platform.
``Artifact`` reads, writes and runs them; ``export`` (module ``export``) makes them.
"""

from __future__ import annotations

import dataclasses
import uuid
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
from jax import export as jexport

from ..errors import VjpsplitError, cannot_deserialize, first_line, xla_status
from ..files.dtypes import dtype_from_name
from ..files.prng import from_data, to_data
from ..files.trees import decode_structure, flatten_with_keys
from ..safeio.outputs import atomic_write
from ..safeio.signals import signals_end_process
from ..safeio.system import current_platform
from ..tracing.residuals import Intermediates, Residuals, SplitResiduals
from ..trust import checks as _trust_mod
from ..trust import signing
from ..trust.kernelcheck import check_at_call
from .manifest import MAGIC, Leaf, Manifest, check_array, check_keys, flatten_args, grads_per_arg, recorded_dims
from .sharding import host_mesh, named, place


class Artifact:
    """A loaded or freshly exported artifact: manifest plus forward and backward modules."""

    def __init__(
        self,
        manifest: Manifest,
        modules: Mapping[str, bytes],
        exps: Mapping[str, Any] | None = None,
        source: str = "artifact",
    ):
        self.manifest = manifest
        self.modules = dict(modules)
        self.source = source
        exps = dict(exps or {})
        for k in self.modules:
            if k not in exps:
                exps[k] = deserialize_module(self.modules[k], source, manifest, k)
        self._exps = exps  # One jit per module: jax caches the compiled executable per input signature.
        self._calls = {k: jax.jit(e.call) for k, e in exps.items()}
        # A directory of serialized executables (the CLI sets it): a fresh process then
        # neither lowers nor compiles a module it ran before. None: jit's own caches only.
        self.executable_cache: str | None = None
        # Signatures of residuals this object's fwd made (by residuals_id): a bwd on them
        # unchanged skips the per-leaf checks, which cost ~1 ms a call on 40 residuals.
        self._made: dict[str, tuple] = {}
        # Trust (module trust): the signature entry, and the signer's key id once verified.
        self.signature: dict | None = None
        self.signer: str | None = None
        self._devices: tuple | None = None  # a sharded artifact's device group; None: this host's first devices
        self._mesh = None
        self._siblings: dict[tuple, "Artifact"] = {}
        # How export chose the manifest's policy (auto's measurements, a budget's pick); None when loaded.
        self.policy_choice = None
        # Modules whose LAPACK calls have symbolic dims: checked at each call's shapes (module kernelcheck).
        self._check_at_call: frozenset[str] = frozenset()
        self._verdicts: Any = _trust_mod.DEFAULT

    def check_kernels_at_call(self, modules, cache_dir=_trust_mod.DEFAULT) -> None:
        """Check ``modules``' kernel calls at each call's concrete shapes, before they compile (``load`` sets it)."""
        self._check_at_call = frozenset(modules)
        self._verdicts = cache_dir

    def on_devices(self, devices) -> "Artifact":
        """This artifact running on ``devices`` (exactly ``nr_devices`` of them, in mesh order).

        Pipeline stages use it to put each stage on its own device group. The
        result shares the modules and is cached per device group, so its
        compiled programs are reused; arrays on other devices are moved when a
        module runs. Unsharded artifacts run where JAX puts them: self.
        """
        devices = tuple(devices)
        if not self.manifest.sharded or devices == self._devices:
            return self
        key = tuple(d.id for d in devices)
        other = self._siblings.get(key)
        if other is None:
            other = Artifact(self.manifest, self.modules, self._exps, self.source)
            other._mesh = host_mesh(self.manifest.mesh, devices, self.source)
            other._devices = devices
            other.executable_cache = self.executable_cache
            other.check_kernels_at_call(self._check_at_call, self._verdicts)
            self._siblings[key] = other
        return other

    @property
    def devices(self) -> tuple:
        """The devices a sharded artifact runs on, in mesh order; () when unsharded."""
        return tuple(self.mesh.devices.flat) if self.mesh is not None else ()

    @property
    def mesh(self):
        """The mesh a sharded artifact runs on (this host's first ``nr_devices`` devices by default); None when unsharded."""
        if self._mesh is None and self.manifest.sharded:
            self._mesh = host_mesh(self.manifest.mesh, self._devices, self.source)
        return self._mesh

    def place_arg(self, name: str | int, value):
        """Argument ``name`` (or position) laid out as the artifact's forward takes it.

        On a sharded artifact each leaf goes to its recorded sharding on ``mesh``
        (moved from other devices if need be); otherwise it goes to JAX's default
        device. A pipeline places parameters once, and activations as they arrive.
        """
        m = self.manifest
        arg = m.arg_names[name] if isinstance(name, int) else name
        if self.mesh is None:
            return jax.device_put(value)
        by_key = {leaf.key: leaf for leaf in m.inputs}
        entries = flatten_with_keys(arg, value)
        try:
            leaves = [by_key[k] for k, _ in entries]
        except KeyError as e:
            raise VjpsplitError(
                f"{self.source}: argument {arg!r} has leaf {e.args[0]!r}, which is not an input of the artifact"
            ) from e
        placed = self._place(leaves, [to_data(v) for _, v in entries])
        placed = self._wrap_keys(leaves, placed)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(value), placed)

    def place_cotangent(self, ct):
        """A cotangent of the output laid out as the backward takes it (see ``place_arg``)."""
        if self.mesh is None or ct is None:
            return ct
        by_key = {leaf.key: leaf for leaf in self.manifest.cotangent_leaves}
        entries = flatten_with_keys("out", ct)
        placed = [place(v, named(self.mesh, by_key[k].sharding)) if k in by_key else v for k, v in entries]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(ct), placed)

    def _place(self, leaves: Sequence[Leaf], values: Sequence) -> list:
        """``values`` laid out as the manifest's ``leaves`` say (sharded artifacts); unchanged otherwise."""
        mesh = self.mesh
        if mesh is None:
            return list(values)
        return [place(v, named(mesh, leaf.sharding)) for leaf, v in zip(leaves, values)]

    @property
    def exported(self) -> Mapping[str, Any]:
        """Each module as the ``jax.export.Exported`` it was read back as (read-only)."""
        return MappingProxyType(self._exps)

    def __repr__(self) -> str:
        m = self.manifest
        return f"Artifact({m.function}, args={list(m.arg_names)}, platforms={list(m.platforms)}, fingerprint={m.fingerprint[:12]})"

    # -- file ---------------------------------------------------------------
    def _unsigned_map(self) -> dict:
        return {"manifest": self.manifest.to_json(), **self.modules}

    def to_bytes(self) -> bytes:
        """The artifact file's bytes (with its signature, if signed)."""
        top = self._unsigned_map()
        if self.signature is not None:
            top[signing.SIGNATURE] = self.signature
        return MAGIC + pack(top)

    def sign(self, key) -> str:
        """Sign the artifact (manifest and every module) with an Ed25519 private key or its file; return the key id."""
        if not hasattr(key, "sign"):
            key = signing.load_private_key(key)
        self.signature = signing.sign(pack(self._unsigned_map()), key)
        self.signer = signing.key_id(self.signature["key"])
        return self.signer

    def save(self, path) -> None:
        """Write the artifact to ``path`` (atomically: no partial file on failure)."""
        data = self.to_bytes()
        # Unlike residuals, an artifact is kept and copied around: make it durable.
        atomic_write(path, lambda f: f.write(data), fsync=True)

    # -- running --------------------------------------------------------------
    def _check_runnable(self):
        plat = current_platform()
        if plat not in self.manifest.platforms:
            raise VjpsplitError(
                f"{self.source}: this host runs on {plat}, but the artifact was exported for "
                f"{', '.join(self.manifest.platforms)} only; re-export with --platforms including {plat}"
            )
        if self.manifest.x64 and not jax.config.jax_enable_x64:
            raise VjpsplitError(
                f"{self.source}: the artifact was exported with 64-bit types enabled; "
                "set JAX_ENABLE_X64=1 (or jax.config.update('jax_enable_x64', True)) before running it"
            )
        if self.manifest.nr_devices > 1:
            _ = self.mesh  # a host with too few devices is refused here, naming both counts

    def input_dims(self, inputs: Mapping[str, Any], source: str = "inputs") -> tuple[list, dict[str, int]]:
        """Check ``inputs`` (flat keys) against the manifest; return the arrays in order and the dims."""
        m = self.manifest
        check_keys(source, "input", [leaf.key for leaf in m.inputs], inputs)
        dims: dict[str, int] = {}
        arrays = [check_array(source, "input", leaf, inputs[leaf.key], dims) for leaf in m.inputs]
        return arrays, dims

    def run_fwd_arrays(self, inputs: Mapping[str, Any], source: str = "inputs") -> tuple[dict, Residuals]:
        """Forward on flat-keyed inputs: ``({out/aux key: array}, residuals)``."""
        self._check_runnable()
        m = self.manifest
        arrays, dims = self.input_dims(inputs, source)
        arrays = self._place(m.inputs, arrays)
        # Format 1 lowered the forward over one pytree per argument; 2 over the flat leaves.
        call_args = arrays if m.format_version >= 2 else self._args_tree(arrays)
        outs, stored, aux = self._run("fwd", call_args, f"{source}: the forward refused these inputs", dims)
        out_values = list(outs) + list(aux)
        outputs = {leaf.key: v for leaf, v in zip(m.outputs, out_values)}
        by_key = dict(zip((leaf.key for leaf in m.inputs), arrays))
        res = Residuals(
            {leaf.key: v for leaf, v in zip(m.stored_residuals, stored)},
            {k: by_key[k] for k in m.input_backed_keys},
            dims=dims,
            fingerprint=m.fingerprint,
            arg_names=m.arg_names,
            residuals_id=uuid.uuid4().hex,
            bound_inputs=by_key,
        )
        if len(self._made) >= 256:  # ids only, never arrays: bounded, and keeps no memory alive
            self._made.pop(next(iter(self._made)))
        self._made[res.residuals_id] = res.signature()  # residuals are immutable: this stays true
        return outputs, res

    def _args_tree(self, arrays: list) -> list:
        m = self.manifest
        it = iter(arrays)
        return [decode_structure(m.structure["args"][n], it) for n in m.arg_names]

    def check_residuals(self, res: Residuals, source: str = "residuals") -> tuple[list, list, dict]:
        """Validate residuals against this artifact; return stored, input-backed arrays and dims."""
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
        made = self._made.get(res.residuals_id)
        if made is not None and made == res.signature():
            # Exactly what this artifact's fwd returned (keys, shapes, dtypes, dims): already checked.
            return (
                list(res.stored.values()),
                [res.inputs[k] for k in m.input_backed_keys],
                {n: res.dims[n] for n in m.dim_vars},
            )
        dims = recorded_dims(self.manifest, res.dims, source, "residuals", "rerun the forward")
        check_keys(source, "residual", [r.key for r in m.stored_residuals], res.stored)
        stored = [
            check_array(source, "residual", leaf, res.stored[leaf.key], dict(dims)) for leaf in m.stored_residuals
        ]
        inputs = []
        for leaf, key in zip([r for r in m.residuals if r.input_backed], m.input_backed_keys):
            if key not in res.inputs:
                raise VjpsplitError(
                    f"{source}: the residuals need input '{key}', which was left out of the file to avoid a copy; "
                    "pass the forward's inputs (--inputs FILE, or load_residuals(path, inputs=args))"
                )
            inputs.append(
                check_array(
                    res.inputs_source or source,
                    "input",
                    dataclasses.replace(leaf, key=key),
                    res.inputs[key],
                    dict(dims),
                )
            )
        return stored, inputs, dims

    def run_bwd_arrays(
        self,
        res: Residuals,
        cotangents: Mapping[str, Any] | None = None,
        source: str = "residuals",
        ct_source: str = "cotangents",
    ) -> dict:
        """Backward from residuals and flat-keyed cotangents (None: 1 for a scalar output): ``{key: grad}``."""
        self._check_runnable()
        stored, inputs, dims = self.check_residuals(res, source)
        cts = self._cotangents(cotangents, dims, ct_source)
        stored, inputs, cts = self._placed_backward_args(stored, inputs, cts)
        grads = self._run(
            "bwd", (stored, inputs, cts, self._carrier(dims)), f"{source}: the backward refused these residuals", dims
        )
        return {leaf.key: g for leaf, g in zip(self.manifest.grads, grads)}

    def _run(self, module: str, args, refused: str, dims: Mapping[str, int] | None = None):
        """Call one module; jax's own shape/dtype refusals become one-line errors prefixed ``refused``.

        Its outputs are checked against the module's declared avals (``dims`` binds
        the symbolic ones). Under the CLI's signal guard the run finishes here, with
        termination signals ending the process (a module may never return).
        """
        try:
            call = self._calls[module]
            if module in self._check_at_call:
                check_at_call(self.source, module, call, args, self.modules[module], self._verdicts)
            # LAPACK custom calls need jax's lowering to register their kernels first: no shortcut.
            # Serialized executables are keyed by avals, not by devices: sharded modules compile each process.
            if (
                self.executable_cache is not None
                and self.manifest.nr_devices == 1
                and b"lapack" not in self.modules.get(module, b"lapack")
            ):
                from .execcache import compiled_call

                call = compiled_call(call, args, (self.manifest.fingerprint, module), self.executable_cache)
            with signals_end_process() as ends:
                result = call(*args)
                if ends:
                    jax.block_until_ready(result)
        except (ValueError, TypeError) as e:
            raise VjpsplitError(f"{refused}: {first_line(e)}") from e
        except Exception as e:
            if xla_status(e) == "RESOURCE_EXHAUSTED":
                # The sizes come from the caller's arrays or a file's recorded dims: name that source.
                raise VjpsplitError(
                    f"{refused}: this host ran out of memory running the {module} module "
                    f"({first_line(e)[:120]}); check the sizes (the dims a file records), or use a "
                    "host with more memory"
                ) from e
            if not cannot_deserialize(e):
                raise
            raise VjpsplitError(unreadable_module(self.source, self.manifest, module)) from e
        _trust_mod.check_outputs(self.source, module, jax.tree_util.tree_leaves(result), self._exps[module], dims or {})
        return result

    def _carrier(self, dims: Mapping[str, int]):
        m = self.manifest
        if not m.dim_vars:
            return None
        carrier = np.zeros((0, *(dims[n] for n in m.dim_vars)), np.bool_)
        return carrier if self.mesh is None else jax.device_put(carrier, named(self.mesh, ()))

    def _placed_backward_args(self, stored: list, inputs: list, cts: list) -> tuple[list, list, list]:
        """The backward's arguments laid out as the forward left them (sharded artifacts)."""
        m = self.manifest
        if not m.sharded:
            return stored, inputs, cts
        return (
            self._place(m.stored_residuals, stored),
            self._place([r for r in m.residuals if r.input_backed], inputs),
            self._place(m.cotangent_leaves, cts),
        )

    def _cotangents(self, cotangents, dims, ct_source: str) -> list:
        m = self.manifest
        ct_leaves = m.cotangent_leaves
        if cotangents is None:
            if len(m.out_keys) != 1 or len(ct_leaves) != 1 or ct_leaves[0].shape != ():
                raise VjpsplitError(
                    f"{self.source}: the output is not a single floating-point scalar, so cotangents are required; "
                    f"pass --cotangents FILE with keys {', '.join(m.out_keys)}"
                )
            cts = [np.ones((), dtype_from_name(ct_leaves[0].dtype))]
        else:
            expected = list(m.out_keys)
            check_keys(ct_source, "cotangent", expected, cotangents)
            cts = [check_array(ct_source, "cotangent", leaf, cotangents[leaf.key], dict(dims)) for leaf in ct_leaves]
        return cts

    # -- zero-bubble split backward ----------------------------------------------
    def _require_split(self):
        if not self.manifest.weights:
            raise VjpsplitError(
                f"{self.source}: the artifact has no split backward; export it with --weights NAMES "
                "(weights=...) to get bwd_input and bwd_weight"
            )

    def run_bwd_input_arrays(
        self,
        res: Residuals,
        cotangents: Mapping[str, Any] | None = None,
        source: str = "residuals",
        ct_source: str = "cotangents",
    ) -> tuple[dict, "Intermediates"]:
        """Input part (B): gradients of the non-weight arguments, and what the weight part needs."""
        self._check_runnable()
        self._require_split()
        m = self.manifest
        stored, inputs, dims = self.check_residuals(res, source)
        cts = self._cotangents(cotangents, dims, ct_source)
        stored, inputs, cts = self._placed_backward_args(stored, inputs, cts)
        grads, inter = self._run(
            "bwd_input",
            (stored, inputs, cts, self._carrier(dims)),
            f"{source}: the backward refused these residuals",
            dims,
        )
        keys = [g.key for g in m.grads_of(m.non_weight_wrt)]
        computed = {leaf.key: v for leaf, v in zip(m.intermediates, inter)}
        # W's own residuals ride with the intermediates; the caller may drop res now.
        w_stored, w_inputs = self.weight_part_residuals(res)
        out = Intermediates(
            computed, dims, m.fingerprint, res.residuals_id, w_stored, w_inputs, arg_trees=res.arg_trees
        )
        return dict(zip(keys, grads)), out

    def weight_part_residuals(self, res: Residuals) -> tuple[dict, dict]:
        """The stored residuals and inputs of ``res`` the weight part reads (every one for formats <= 2).

        The arrays themselves, not copies: what :class:`Intermediates` carries from B to W.
        """
        m = self.manifest
        if m.weight_reads_subset:
            return {k: res.stored[k] for k in m.weight_residuals}, {k: res.inputs[k] for k in m.weight_inputs}
        return dict(res.stored), dict(res.inputs)

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
        """
        self._check_runnable()
        self._require_split()
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
        if res is not None:
            res_stored, res_inputs, dims = self.check_residuals(res, source)
            if inter.dims != dims or (
                inter.residuals_id and res.residuals_id and inter.residuals_id != res.residuals_id
            ):
                raise VjpsplitError(
                    f"{inter_source}: the intermediates were made from other residuals than {source} "
                    "(another forward run or microbatch); pass the pair from one microbatch"
                )
        dims = recorded_dims(self.manifest, inter.dims, inter_source, "intermediates", "rerun run-bwd --part input")
        check_keys(inter_source, "intermediate", [leaf.key for leaf in m.intermediates], inter.arrays)
        values = [
            check_array(inter_source, "intermediate", leaf, inter.arrays[leaf.key], dict(dims))
            for leaf in m.intermediates
        ]
        if m.weight_reads_subset:
            by_key = {r.key: r for r in m.residuals}
            check_keys(inter_source, "residual", list(m.weight_residuals), inter.stored)
            w_stored = [
                check_array(inter_source, "residual", by_key[k], inter.stored[k], dict(dims))
                for k in m.weight_residuals
            ]
            w_inputs = []
            for k in m.weight_inputs:
                if k not in inter.inputs:
                    raise VjpsplitError(
                        f"{inter_source}: the weight part needs input '{k}', which was left out of "
                        "the file to avoid a copy; pass the forward's inputs (--inputs FILE)"
                    )
                w_inputs.append(
                    check_array(
                        inter_source,
                        "input",
                        dataclasses.replace(by_key[f"in/{k}"], key=k),
                        inter.inputs[k],
                        dict(dims),
                    )
                )
        else:  # formats <= 2: W reads every residual, checked above
            w_stored, w_inputs = res_stored, res_inputs
        if m.sharded:
            by_key = {r.key: r for r in m.residuals}
            w_stored = self._place([by_key[k] for k in m.weight_residuals], w_stored)
            w_inputs = self._place([by_key[f"in/{k}"] for k in m.weight_inputs], w_inputs)
            values = self._place(m.intermediates, values)
        grads = self._run(
            "bwd_weight",
            (w_stored, w_inputs, values, self._carrier(dims)),
            f"{inter_source}: the weight backward refused these intermediates",
            dims,
        )
        return dict(zip([g.key for g in m.grads_of(m.weights)], grads))

    def bwd_input(self, res: Residuals, ct=None) -> tuple[dict, "Intermediates"]:
        """Input part of the backward: ``({arg name: grad} for non-weight args, intermediates)``.

        The intermediates hold what the weight part reads (including its share of
        the residuals), so ``res`` can be dropped once this returns.
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
        """
        if isinstance(inter, Residuals) and isinstance(res, Intermediates):
            inter, res = res, inter
        grads = self.run_bwd_weight_arrays(res, inter)
        return grads_per_arg(self.manifest, grads, self.manifest.weights, inter.dims, getattr(inter, "arg_trees", ()))

    def _wrap_keys(self, leaves: Sequence[Leaf], values: Sequence) -> list:
        """Typed PRNG keys back from their key data, where the manifest says so."""
        return [from_data(jnp.asarray(v), leaf.prng_impl) if leaf.prng_impl else v for leaf, v in zip(leaves, values)]

    def fwd(self, *args):
        """Forward on pytree arguments: ``(out, res)``, or ``(out, res, aux)`` with has_aux."""
        m = self.manifest
        if len(args) != len(m.arg_names):
            raise VjpsplitError(
                f"{self.source}: fwd takes {len(m.arg_names)} arguments ({', '.join(m.arg_names)}), got {len(args)}"
            )
        flat, trees = flatten_args(m, args)
        outputs, res = self.run_fwd_arrays(flat, source="args")
        res = res.replace(arg_trees=trees)
        values = self._wrap_keys(m.outputs, [outputs[leaf.key] for leaf in m.outputs])
        by_key = dict(zip((leaf.key for leaf in m.outputs), values))
        out = decode_structure(m.structure["out"], iter(by_key[k] for k in m.out_keys))
        if m.has_aux:
            aux = decode_structure(m.structure["aux"], iter(v for k, v in by_key.items() if k not in m.out_keys))
            return out, res, aux
        return out, res

    def bwd(self, res: Residuals, ct=None):
        """Backward from residuals: gradients shaped like the ``wrt`` arguments (float0 for ints)."""
        m = self.manifest
        cts = None if ct is None else dict(flatten_with_keys("out", ct))
        grads = self.run_bwd_arrays(res, cts, source=getattr(res, "source", None) or "residuals", ct_source="cotangent")
        per_arg = grads_per_arg(self.manifest, grads, m.wrt, res.dims, res.arg_trees)
        return per_arg[m.wrt[0]] if m.single_grad else tuple(per_arg[n] for n in m.wrt)


def unreadable_module(source: str, manifest: Manifest, module: str) -> str:
    """The message for a module this jax cannot deserialize though another jax wrote it whole."""
    why = (
        " (sharded modules from jax >= 0.7 use the Shardy partitioner, which jax 0.6 cannot read)"
        if manifest.sharded
        else ""
    )
    return (
        f"{source}: this jax {jax.__version__} cannot read the {module} module that "
        f"jax {manifest.jax_version} exported{why}; run it with jax {manifest.jax_version} or newer, or "
        "re-export it with this jax"
    )


def pack(top: Mapping) -> bytes:
    """The artifact's top-level map as msgpack (canonical: what a signature covers)."""
    return msgpack.packb(top, use_bin_type=True)


def deserialize_module(data: bytes, source: str, manifest: Manifest, what: str):
    """A module's ``jax.export.Exported``, its device count reconciled with the manifest; one-line errors."""
    try:
        exp = jexport.deserialize(bytearray(data))
    except Exception as e:
        lo = jexport.minimum_supported_calling_convention_version
        hi = jexport.maximum_supported_calling_convention_version
        raise VjpsplitError(
            f"{source}: cannot read the {what} module (exported with jax {manifest.jax_version}, calling convention "
            f"{manifest.calling_convention_version}; this jax {jax.__version__} reads {lo}..{hi}): {first_line(e)}; "
            "install a jax close to the exporting one, or re-export the artifact with this jax"
        ) from e
    if exp.nr_devices == 0:
        # jax >= 0.9.1 writes the device count only in the 32-bit field added in 0.8;
        # jax <= 0.7 reads the old 16-bit one and gets 0, which Exported.call refuses.
        # 0 is never a real count: the manifest has the true one (1 before format 4).
        exp = dataclasses.replace(exp, nr_devices=manifest.nr_devices)
    elif exp.nr_devices != manifest.nr_devices:
        raise VjpsplitError(
            f"{source}: the {what} module runs on {exp.nr_devices} devices, the manifest says "
            f"{manifest.nr_devices}; export it again"
        )
    return exp
