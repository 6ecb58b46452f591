"""One stage's optimizer as a loaded program: the ``OptimizerProgram`` that runs, its leaves, its bytes.

An ``OptimizerProgram`` holds one stage's exported ``init``, ``update`` and
``shares/<round>`` modules over flat ``{leaf key: array}`` mappings (``optimizer``
exports them). It travels as bytes (``to_bytes``: a msgpack map, no pickle, of
the leaves' keys, dtypes, shapes and shardings and the modules) and runs, after
``load_optimizer``, in a process that imports neither optax nor the user's code.
Loading checks the modules as artifacts are checked (signatures against the
recorded leaves, no host callbacks, no unvetted kernels) before anything compiles.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import msgpack
import numpy as np
from jax import export as jexport
from jax.typing import ArrayLike

from ...artifact.sharding import SpecJSON, host_mesh, named, place, spec_from_json
from ...errors import VjpsplitError, first_line
from ...files.dtypes import dtype_from_name
from ...files.prng import from_data, to_data
from ...trust import checks as _trust_mod
from ...trust import custom_calls, probes
from ...treetypes import Leaf

MAGIC = "vjpsplit-optimizer"
FORMAT = 2  # 2: the update takes the loss value= and the reductions over leaves; shares/<round> modules


@dataclasses.dataclass(frozen=True)
class OptLeaf:
    """One parameter or state leaf of an optimizer program: key, dtype name, shape, sharding, PRNG impl."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    sharding: SpecJSON | None = None
    prng_impl: str = ""

    def to_json(self) -> dict[str, object]:
        """The leaf as the program file's index stores it."""
        return {
            "key": self.key,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "sharding": self.sharding,
            "prng_impl": self.prng_impl,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> OptLeaf:  # msgpack's output, checked by the reader's except
        """The leaf from the program file's index (``to_json``'s form)."""
        sh = d.get("sharding")
        return cls(
            str(d["key"]),
            str(d["dtype"]),
            tuple(int(n) for n in d["shape"]),
            None if sh is None else spec_from_json(sh),
            str(d.get("prng_impl") or ""),
        )

    def struct(self) -> jax.ShapeDtypeStruct:
        """The leaf as its module sees it (key data for a typed key)."""
        return jax.ShapeDtypeStruct(self.shape, dtype_from_name(self.dtype))


class OptimizerProgram:
    """One stage's optimizer: ``init`` and ``update`` as exported modules over flat ``{key: array}`` mappings."""

    def __init__(
        self,
        name: str,
        params: Sequence[OptLeaf],
        state: Sequence[OptLeaf],
        mesh: Sequence[tuple[str, int]],
        modules: Mapping[str, bytes],
        *,
        source: str = "optimizer",
        check: bool = True,
        devices: Sequence[jax.Device] | None = None,
        meta: Mapping[str, Any] | None = None,  # a program file's fields, read in the try below
        abstract: bool = False,
    ):
        self.name, self.source = name, source
        meta = dict(meta or {})
        try:
            self.reductions = [(str(r["op"]), str(r["dtype"]), int(r["round"])) for r in meta.get("reductions", ())]
            self.uses_value = bool(meta.get("uses_value", False))
        except (KeyError, TypeError, ValueError) as e:
            raise VjpsplitError(f"{source}: its reductions are not readable ({first_line(e)}); export it again") from e
        self.rounds = 1 + max((r for _, _, r in self.reductions), default=-1)
        self.param_leaves, self.state_leaves = tuple(params), tuple(state)
        self.mesh_axes = tuple((str(a), int(n)) for a, n in mesh)
        self.modules = dict(modules)
        want_modules = {"init", "update", *(f"shares/{r}" for r in range(self.rounds))}
        if set(self.modules) != want_modules:
            raise VjpsplitError(
                f"{source}: needs the modules {sorted(want_modules)}, has {sorted(self.modules)}; export it again"
            )
        exps = {}
        for k, data in self.modules.items():
            try:
                exps[k] = jexport.deserialize(bytearray(data))
            except Exception as e:
                raise VjpsplitError(
                    f"{source}: cannot read its {k} module ({first_line(e)}); export it again with this jax"
                ) from e
        if check:
            self._check(exps)
        self._exps = exps
        self._calls = {k: jax.jit(e.call) for k, e in exps.items()}
        self._outputs_checked = False  # update's outputs checked against the module's declared avals (once)
        # Exported over an AbstractMesh (``abstract``): no devices here; it runs once loaded onto some.
        self.abstract = bool(abstract and self.mesh_axes)
        self.mesh = host_mesh(self.mesh_axes, devices, source) if self.mesh_axes and not self.abstract else None

    def _check(self, exps: Mapping[str, jexport.Exported]) -> None:
        """What loading an artifact checks: signatures against the recorded leaves, custom calls."""
        found = probes.probe_modules({k: e.mlir_module_serialized for k, e in exps.items()}, self.source)
        p = _trust_mod.expected_leaves(self.param_leaves)
        s = _trust_mod.expected_leaves(self.state_leaves)
        red = [(dt, ()) for _, dt, _ in self.reductions]
        args = p + s + p + [("float32", ()), ("float32", ())] + red
        want = {"init": (p, s), "update": (args, p + s)}
        for r in range(self.rounds):
            want[f"shares/{r}"] = (args, [(dt, ()) for _, dt, rr in self.reductions if rr == r])
        for module, exp in exps.items():
            info = found.get(module) or {}
            _trust_mod.check_avals(self.source, module, exp, *want[module], info.get("main"))
            custom_calls.check_calls(
                self.source, module, info.get("calls", ()), trusted_signer=False, allow_kernels=False
            )

    @property
    def param_keys(self) -> list[str]:
        """The stage's parameter keys, in the modules' order."""
        return [p.key for p in self.param_leaves]

    @property
    def state_keys(self) -> list[str]:
        """The optimizer state's leaf keys (its structure, as data)."""
        return [s.key for s in self.state_leaves]

    def on_devices(self, devices: Sequence[jax.Device]) -> OptimizerProgram:
        """This program on ``devices`` (a sharded stage's device group); unsharded: self."""
        if not self.mesh_axes:
            return self
        other = OptimizerProgram.__new__(OptimizerProgram)
        other.__dict__.update(self.__dict__)
        other.mesh = host_mesh(self.mesh_axes, devices, self.source)
        other.abstract = False
        return other

    def _args(self, leaves: Sequence[OptLeaf], values: Mapping[str, Leaf], what: str) -> list[Leaf]:
        if self.abstract:
            raise VjpsplitError(
                f"{self.source}: exported over an abstract mesh of {dict(self.mesh_axes)}, it has no devices; "
                "run it after load_optimizer(program.to_bytes(), devices=...) or on_devices(...)"
            )
        keys = [leaf.key for leaf in leaves]
        if set(values) != set(keys):
            extra, missing = sorted(set(values) - set(keys)), sorted(set(keys) - set(values))
            raise VjpsplitError(
                f"{self.source}: {what} "
                + (f"lack {missing[0]!r}" if missing else f"have an unknown key {extra[0]!r}")
                + f"; pass exactly the keys {keys[:4]}{'...' if len(keys) > 4 else ''}"
            )
        out = []
        for leaf in leaves:
            v = to_data(values[leaf.key])
            if tuple(np.shape(v)) != leaf.shape or np.dtype(v.dtype) != np.dtype(dtype_from_name(leaf.dtype)):
                raise VjpsplitError(
                    f"{self.source}: {what} '{leaf.key}' is {v.dtype}{list(np.shape(v))}, the program takes {leaf.dtype}{list(leaf.shape)}"
                )
            out.append(place(v, named(self.mesh, leaf.sharding)) if self.mesh is not None else v)
        return out

    def _state_out(self, leaves: Sequence[jax.Array]) -> dict[str, jax.Array]:
        return {s.key: from_data(v, s.prng_impl or None) for s, v in zip(self.state_leaves, leaves)}

    def init(self, params: Mapping[str, Leaf]) -> dict[str, jax.Array]:
        """The optimizer state for ``params`` (``{key: array}``), as ``{state key: array}``."""
        out = self._calls["init"](self._args(self.param_leaves, params, "parameters"))
        _trust_mod.check_outputs(self.source, "init", jax.tree_util.tree_leaves(out), self._exps["init"], {})
        return self._state_out(out)

    def _call_args(
        self,
        params: Mapping[str, Leaf],
        state: Mapping[str, Leaf],
        grads: Mapping[str, Leaf],
        scale: float,
        value: float,
        reduced: Sequence[ArrayLike],
    ) -> tuple[object, ...]:
        if len(reduced) != len(self.reductions):
            raise VjpsplitError(
                f"{self.source}: takes {len(self.reductions)} reductions over leaves, got {len(reduced)}"
            )
        scalars = [np.float32(scale), np.float32(value)]
        red = [np.asarray(v, dtype_from_name(dt)) for v, (_, dt, _) in zip(reduced, self.reductions)]
        if self.mesh is not None:
            scalars = [place(x, named(self.mesh, ())) for x in scalars]
            red = [place(x, named(self.mesh, ())) for x in red]
        return (
            self._args(self.param_leaves, params, "parameters"),
            self._args(self.state_leaves, state, "optimizer state"),
            self._args(self.param_leaves, grads, "gradients"),
            *scalars,
            red,
        )

    def shares(
        self,
        rnd: int,
        params: Mapping[str, Leaf],
        state: Mapping[str, Leaf],
        grads: Mapping[str, Leaf],
        scale: float = 1.0,
        value: float = 0.0,
        reduced: Sequence[ArrayLike] = (),
    ) -> list[jax.Array]:
        """This stage's shares of the reductions of round ``rnd`` (``reduced``: every reduction's combined
        value so far; the later ones are not read)."""
        return list(self._calls[f"shares/{rnd}"](*self._call_args(params, state, grads, scale, value, reduced)))

    def update(
        self,
        params: Mapping[str, Leaf],
        state: Mapping[str, Leaf],
        grads: Mapping[str, Leaf],
        scale: float = 1.0,
        value: float = 0.0,
        reduced: Sequence[ArrayLike] = (),
    ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
        """One optimizer step on ``grads * scale``: ``(new params, new state)``, keyed as given. ``value``: the
        step's loss (for an update that takes ``value=``); ``reduced``: the reductions over leaves, combined
        over the stages."""
        new_p, new_s = self._calls["update"](*self._call_args(params, state, grads, scale, value, reduced))
        if not self._outputs_checked:  # its inputs' avals are the program's own on every call: so are its outputs'
            _trust_mod.check_outputs(self.source, "update", [*new_p, *new_s], self._exps["update"], {})
            self._outputs_checked = True
        return dict(zip(self.param_keys, new_p)), self._state_out(new_s)

    def to_bytes(self) -> bytes:
        """The program as msgpack bytes (no pickle): what a worker loads with ``load_optimizer``."""
        top = {
            "magic": MAGIC,
            "format": FORMAT,
            "name": self.name,
            "jax_version": jax.__version__,
            "mesh": [list(a) for a in self.mesh_axes],
            "params": [p.to_json() for p in self.param_leaves],
            "state": [s.to_json() for s in self.state_leaves],
            "modules": self.modules,
            "reductions": [{"op": o, "dtype": d, "round": r} for o, d, r in self.reductions],
            "uses_value": self.uses_value,
        }
        return msgpack.packb(top, use_bin_type=True)


def load_optimizer(
    data: bytes, *, source: str = "optimizer", devices: Sequence[jax.Device] | None = None
) -> OptimizerProgram:
    """An ``OptimizerProgram`` from ``to_bytes`` output, checked before anything compiles; optax is not needed."""
    try:
        top = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
        if not isinstance(top, dict) or top.get("magic") != MAGIC:
            raise ValueError("not an optimizer program")
        if top.get("format") != FORMAT:
            raise VjpsplitError(
                f"{source}: optimizer program format {top.get('format')!r}, this vjpsplit reads {FORMAT}; export it again"
            )
        params = [OptLeaf.from_json(d) for d in top["params"]]
        state = [OptLeaf.from_json(d) for d in top["state"]]
        mesh = [(str(a), int(n)) for a, n in top["mesh"]]
        modules = {str(k): bytes(v) for k, v in top["modules"].items()}
    except VjpsplitError:
        raise
    except Exception as e:
        raise VjpsplitError(
            f"{source}: is not a vjpsplit optimizer program ({first_line(e)}); pass the bytes OptimizerProgram.to_bytes wrote"
        ) from e
    meta = {"reductions": top.get("reductions", []), "uses_value": top.get("uses_value", False)}
    return OptimizerProgram(
        str(top.get("name", "optimizer")), params, state, mesh, modules, source=source, devices=devices, meta=meta
    )
