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
from ..safeio.signals import signals_end_process
from ..safeio.system import current_platform
from ..trust import verdicts
from ..trust.checks import check_outputs
from ..trust.kernelcheck import check_at_call
from ..trust.module_io import ModuleIO, module_table
from . import artifact_file
from .manifest import Manifest


class ModuleRunner:
    """An artifact's modules, ready to run; ``run`` calls one and checks what it returned."""

    def __init__(
        self,
        manifest: Manifest,
        modules: Mapping[str, bytes],
        exported: Mapping[str, Any] | None,
        source: str,
    ):
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
        # A directory of serialized executables (the CLI sets it): a fresh process then
        # neither lowers nor compiles a module it ran before. None: jit's own caches only.
        self.executable_cache: str | None = None
        # Modules whose LAPACK calls have symbolic dims: checked at each call's shapes (module kernelcheck).
        self.check_at_call: frozenset[str] = frozenset()
        self.verdict_cache: Any = verdicts.DEFAULT  # where those checks keep their verdicts

    def check_runnable(self, mesh: Callable[[], Any]) -> None:
        """Refuse a host of another platform, without 64-bit types the artifact needs, or with too few devices.

        ``mesh``: makes the artifact's mesh, which refuses a host with too few devices, naming both counts.
        """
        m = self.manifest
        plat = current_platform()
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
        if m.nr_devices > 1:
            mesh()

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
        """Call one module; jax's own shape/dtype refusals become one-line errors prefixed ``refused``.

        Its outputs are checked against the module's declared avals (``dims`` binds
        the symbolic ones). Under the CLI's signal guard the run finishes here, with
        termination signals ending the process (a module may never return).
        """
        try:
            call = self._call_of(module, args)
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
            raise VjpsplitError(artifact_file.unreadable_module(self.source, self.manifest, module)) from e
        check_outputs(self.source, module, jax.tree_util.tree_leaves(result), self.exported[module], dims or {})
        return result

    def run_by_slot(
        self, module: str, by_slot: Mapping[str, Any], refused: str, dims: Mapping[str, int]
    ) -> dict[str, list]:
        """Call a backward module on its arguments by slot; its results by slot (``trust.module_io``)."""
        io = self.signatures[module]
        return io.results(self.run(module, io.arguments(by_slot), refused, dims))
