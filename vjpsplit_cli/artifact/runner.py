"""Running an artifact's modules: their ``Exported`` and jitted calls, the executable cache, and each call.

``ModuleRunner`` owns what running needs beyond the arguments: the deserialized modules
and one ``jax.jit`` per module (jax caches the compiled executable per input signature),
the optional directory of serialized executables, the kernel checks due at a call's
shapes, the termination-signal guard, and the check of each call's outputs against the
module's declared avals. It refuses a host the artifact cannot run on, in one line.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax

from ..errors import VjpsplitError, cannot_deserialize, first_line, xla_status
from ..safeio.signals import signals_end_process, signals_guarded
from ..safeio.system import current_platform
from ..trust import verdicts
from ..trust.checks import check_outputs
from ..trust.kernelcheck import check_at_call
from ..trust.module_io import ModuleIO, module_table
from . import artifact_file
from .manifest import Manifest
from .checked_calls import CheckedCalls, dims_signature, placed_signature


class ModuleRunner:
    """An artifact's modules, ready to run; ``run`` calls one and checks what it returned."""

    def __init__(
        self,
        manifest: Manifest,
        modules: Mapping[str, bytes],
        exported: Mapping[str, Any] | None,
        source: str,
    ) -> None:
        self.manifest = manifest
        self.modules = modules
        self.source = source
        self.signatures: dict[str, ModuleIO] = module_table(manifest)  # each module's inputs and outputs, in order
        exps = dict(exported or {})
        for k in modules:
            if k not in exps:
                exps[k] = artifact_file.deserialize_module(modules[k], source, manifest, k)
        self.exported = exps
        self.jitted: dict[str, Any] = {k: jax.jit(e.call) for k, e in exps.items()}
        self._executable_cache: str | None = None
        # Calls whose results (and kernels) were checked: by module and dims, and by the arguments'
        # signature for the modules whose kernels are checked at call shapes.
        self._checked = CheckedCalls()
        # Counts the changes that make a call seen before due for its checks again: what a caller
        # kept from ``ready`` holds while the epoch is the one it read before asking.
        self.epoch = 0
        self._platform = ""  # this host's platform, once it passed
        # True once ``check_runnable`` passed where its verdict cannot change in this process
        # (a platform is fixed once jax started; no 64-bit flag to read again, no mesh to make).
        self.host_ok = False
        self._check_at_call: frozenset[str] = frozenset()
        self._verdict_cache: Any = verdicts.DEFAULT

    @property
    def executable_cache(self) -> str | None:
        """A directory of serialized executables (the CLI sets it): a fresh process then neither lowers nor
        compiles a module it ran before. None: jit's own caches only."""
        return self._executable_cache

    @executable_cache.setter
    def executable_cache(self, directory: str | None) -> None:
        self._executable_cache = directory
        self.epoch += 1  # a program read from the cache is checked on every call: no straight calls

    @property
    def check_at_call(self) -> frozenset[str]:
        """Modules whose LAPACK calls have symbolic dims: checked at each call's shapes (module kernelcheck)."""
        return self._check_at_call

    @check_at_call.setter
    def check_at_call(self, modules: frozenset[str]) -> None:
        self._check_at_call = frozenset(modules)
        self._checked.clear()  # calls seen before were not checked so
        self.epoch += 1

    @property
    def verdict_cache(self) -> Any:
        """Where the kernel checks at call keep their verdicts (``verdicts.DEFAULT``, a directory, or None)."""
        return self._verdict_cache

    @verdict_cache.setter
    def verdict_cache(self, cache_dir: Any) -> None:
        self._verdict_cache = cache_dir
        self._checked.clear()
        self.epoch += 1

    def check_runnable(self, mesh: Callable[[], Any]) -> None:
        """Refuse a host of another platform, without 64-bit types the artifact needs, or with too few devices.

        ``mesh``: makes the artifact's mesh, which refuses a host with too few devices, naming both counts.
        """
        m = self.manifest
        if self._platform and not m.x64 and m.nr_devices == 1:
            return  # passed before: this platform is fixed for the process, and the manifest frozen
        plat = self._platform or current_platform()
        if plat not in m.platforms:
            raise VjpsplitError(
                f"{self.source}: this host runs on {plat}, but the artifact was exported for "
                f"{', '.join(m.platforms)} only; re-export with --platforms including {plat}"
            )
        # jax defines its options at run time: the stub does not declare jax_enable_x64.
        if m.x64 and not jax.config.jax_enable_x64:  # type: ignore[attr-defined]
            raise VjpsplitError(
                f"{self.source}: the artifact was exported with 64-bit types enabled; "
                "set JAX_ENABLE_X64=1 (or jax.config.update('jax_enable_x64', True)) before running it"
            )
        self._platform = plat  # jax's backend is fixed once it has started
        if m.nr_devices > 1:
            mesh()
        self.host_ok = not m.x64 and m.nr_devices == 1

    def _call_of(self, module: str, args: Sequence) -> Callable:
        call = self.jitted[module]
        if module in self.check_at_call:
            check_at_call(self.source, module, call, args, self.modules[module], self.verdict_cache)
        # LAPACK custom calls need jax's lowering to register their kernels first: no shortcut.
        # Serialized executables are keyed by avals, not by devices: sharded modules compile each process.
        if (
            self.executable_cache is not None
            and self.manifest.nr_devices == 1
            and b"lapack" not in self.modules.get(module, b"lapack")
        ):
            from .execcache import compiled_call

            return compiled_call(call, args, (self.manifest.fingerprint, module), self.executable_cache)
        return call

    def run(self, module: str, args: Sequence, refused: str, dims: Mapping[str, int] | None = None) -> Any:
        """Call one module on arguments checked against its signature under ``dims`` (``Binding``).

        jax's own shape/dtype refusals become one-line errors prefixed ``refused``. The
        outputs are checked against the module's declared avals (``dims`` binds the
        symbolic ones), and its kernels at these shapes where they need it, once per
        signature: the dims fix the checked arguments' avals and so the results', and
        the kernel checks depend on those avals and the arguments' shardings. Under the
        CLI's signal guard the run finishes here, with termination signals ending the
        process (a module may never return).
        """
        if self.executable_cache is None and module not in self._check_at_call:  # the common key, inline
            key: tuple | None = (module, dims_signature(dims) if dims else ())
        else:
            key = self._call_key(module, args, dims)
        seen = self._checked.get(key) is not None
        try:
            call = self.jitted[module] if seen else self._call_of(module, args)
            if not signals_guarded():  # outside the CLI's guard (every call from Python code): nothing to set
                result = call(*args)
            else:
                with signals_end_process() as ends:
                    result = call(*args)
                    if ends:
                        jax.block_until_ready(result)
        except Exception as e:
            err = self.refusal(e, module, refused)
            if err is None:
                raise
            raise err from e
        if not seen:
            check_outputs(self.source, module, jax.tree_util.tree_leaves(result), self.exported[module], dims or {})
            if call is self.jitted[module]:  # a program read from the executable cache is checked on every call
                self._checked.add(key, True)
        return result

    def refusal(self, e: Exception, module: str, refused: str) -> VjpsplitError | None:
        """The one-line error a module call's exception ``e`` becomes (prefixed ``refused``); None: raise ``e`` as is.

        jax's own shape/dtype refusals, running out of memory, a module this jax cannot read.
        """
        if isinstance(e, (ValueError, TypeError)):
            return VjpsplitError(f"{refused}: {first_line(e)}")
        if xla_status(e) == "RESOURCE_EXHAUSTED":
            # The sizes come from the caller's arrays or a file's recorded dims: name that source.
            return VjpsplitError(
                f"{refused}: this host ran out of memory running the {module} module "
                f"({first_line(e)[:120]}); check the sizes (the dims a file records), or use a "
                "host with more memory"
            )
        if not cannot_deserialize(e):
            return None
        return VjpsplitError(artifact_file.unreadable_module(self.source, self.manifest, module))

    def ready(self, module: str, dims: Mapping[str, int]) -> Callable | None:
        """``module``'s jitted call where ``run`` would call it straight: its checks at ``dims`` passed before.

        None where ``run`` has more to do (a first call at these dims, kernels checked at call
        shapes, the executable cache, the CLI's signal guard): call ``run`` then. A caller of the
        jitted call turns its exceptions into errors with ``refusal``.
        """
        if self.executable_cache is not None or module in self._check_at_call or signals_guarded():
            return None
        if self._checked.get((module, dims_signature(dims) if dims else ())) is None:
            return None
        return self.jitted[module]

    def _call_key(self, module: str, args: Sequence, dims: Mapping[str, int] | None) -> tuple | None:
        """What a call's checks depend on: the module and dims, and the shardings where kernels are checked."""
        if self.executable_cache is not None:
            return None
        key = (module, dims_signature(dims) if dims else ())
        if module not in self._check_at_call:
            return key
        sig = placed_signature(jax.tree_util.tree_leaves(args))
        return None if sig is None else (*key, sig)

    def run_by_slot(
        self, module: str, by_slot: Mapping[str, Any], refused: str, dims: Mapping[str, int]
    ) -> dict[str, Sequence]:
        """Call a backward module on its arguments by slot; its results by slot (``trust.module_io``)."""
        io = self.signatures[module]
        return io.results(self.run(module, io.arguments(by_slot), refused, dims))
