"""Commands that run an artifact's modules: ``run-fwd`` and ``run-bwd``."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ContextManager, Mapping

import click

from ..safeio.outputs import StagedOutputs
from ..safeio.signals import time_limit
from .app import ARRAY_OUT, EXISTING, cli_command, log, main, plural_count, trust_options
from .runtime import executable_cache, load_artifact, to_numpy, use_compilation_cache

if TYPE_CHECKING:  # imported when a command runs: ``vjpsplit --help`` imports no JAX
    from ..artifact.artifact import Artifact
    from ..tracing.residuals import Intermediates, Residuals

_timeout_option = click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="SECONDS",
    help="Give up (error, exit 1, no output written) if loading and running the artifact take longer.",
)


def _timed(seconds: float | None, artifact: str) -> ContextManager[None]:
    """``time_limit`` for --timeout (None: no limit)."""
    if seconds is None:
        return contextlib.nullcontext()
    return time_limit(
        seconds,
        f"{artifact}: {click.get_current_context().info_name} did not finish within "
        f"{seconds:g} s (--timeout); every previous output is left as it was; "
        "allow more time, or do not run this artifact if it never ends",
    )


# Residuals, outputs, grads and intermediates are transient: by default they are not
# flushed to disk (the rename is atomic, checksums catch a file torn by a power loss).
_fsync_option = click.option(
    "--fsync",
    is_flag=True,
    help="Flush every file written to disk before exiting, so it survives a power loss "
    "(slower; also VJPSPLIT_FSYNC=1).",
)


@main.command(
    "run-fwd",
    short_help="Run the forward: inputs -> outputs and residuals.",
    epilog="\b\nExamples:\n  vjpsplit template mlp.vjps -o inputs.npz --at b=32 --fill normal\n  vjpsplit run-fwd mlp.vjps --inputs inputs.npz --residuals res.npz --outputs out.npz",
)
@click.argument("artifact", type=EXISTING)
@click.option("--inputs", "inputs_path", required=True, type=EXISTING, help="Array file with every input key.")
@click.option("--residuals", "residuals_path", required=True, type=ARRAY_OUT, help="Residuals file to write.")
@click.option("--outputs", "outputs_path", type=ARRAY_OUT, default=None, help="Outputs file to write (out, aux).")
@click.option("--self-contained", is_flag=True, help="Also write input-backed residuals, so run-bwd needs no --inputs.")
@_fsync_option
@trust_options
@_timeout_option
@cli_command
def run_fwd_cmd(
    artifact: str,
    inputs_path: str,
    residuals_path: str,
    outputs_path: str | None,
    self_contained: bool,
    fsync: bool,
    trust_keys: tuple[str, ...],
    allow_kernels: bool,
    timeout: float | None,
) -> None:
    """Run the forward: inputs -> outputs and residuals."""
    from ..artifact.residual_files import save_residuals
    from ..files import load_arrays, save_arrays

    with StagedOutputs(
        {"--residuals": residuals_path, "--outputs": outputs_path},
        {"ARTIFACT": artifact, "--inputs": inputs_path},
        fsync=fsync,
    ) as out:
        use_compilation_cache()
        with _timed(timeout, artifact):
            art = load_artifact(artifact, trust_keys, allow_kernels)
            art.executable_cache = executable_cache()
            inputs, _ = load_arrays(inputs_path)
            outputs, res = art.run_fwd_arrays(inputs, source=inputs_path)
            outputs = to_numpy(outputs)  # finish the compute before any file is written
        out.write("--residuals", lambda tmp: save_residuals(tmp, res, self_contained=self_contained))
        if outputs_path:
            meta = {"kind": "vjpsplit-outputs", "fingerprint": art.manifest.fingerprint}
            out.write("--outputs", lambda tmp: save_arrays(tmp, outputs, meta))
    backed = plural_count(len(res.inputs), "input-backed residual")
    log(
        f"wrote {residuals_path}: {plural_count(len(res.stored), 'stored residual')}"
        + (
            (f" and {backed}" if self_contained else f"; {backed} left out, run-bwd reads them from --inputs")
            if res.inputs
            else ""
        )
        + (f"; {outputs_path}: {plural_count(len(outputs), 'output')}" if outputs_path else "")
    )


@main.command(
    "run-bwd",
    short_help="Run the backward: residuals -> gradients.",
    epilog="\b\nExamples:\n  vjpsplit run-bwd mlp.vjps --residuals res.npz --inputs inputs.npz --grads grads.npz\n  vjpsplit run-bwd mlp.vjps --residuals res.npz --inputs inputs.npz --cotangents ct.npz --grads grads.npz",
)
@click.argument("artifact", type=EXISTING)
@click.option(
    "--residuals",
    "residuals_path",
    type=EXISTING,
    help="Residuals file from run-fwd (required, except for --part weight, whose intermediates carry "
    "the residuals it reads).",
)
@click.option(
    "--inputs",
    "inputs_path",
    type=EXISTING,
    default=None,
    help="The forward's inputs file; needed unless the residuals are self-contained.",
)
@click.option(
    "--cotangents",
    "cotangents_path",
    type=EXISTING,
    default=None,
    help="Cotangents keyed like the outputs; default 1 for a scalar output.",
)
@click.option("--grads", "grads_path", required=True, type=ARRAY_OUT, help="Gradients file to write.")
@click.option(
    "--part",
    type=click.Choice(["all", "input", "weight"]),
    default="all",
    show_default=True,
    help="Zero-bubble split: 'input' writes non-weight grads and --intermediates; 'weight' reads them.",
)
@click.option(
    "--intermediates",
    "inter_path",
    type=ARRAY_OUT,
    default=None,
    help="With --part: the intermediates file (written by input, read by weight).",
)
@click.option(
    "--no-verify",
    is_flag=True,
    help="Skip every check that ties the files together: the CRC-32s of residuals and intermediates, "
    "that --inputs are the very inputs the forward ran on (dims and content), and that the "
    "intermediates come from the same forward run as the residuals.",
)
@_fsync_option
@trust_options
@_timeout_option
@cli_command
def run_bwd_cmd(
    artifact: str,
    residuals_path: str | None,
    inputs_path: str | None,
    cotangents_path: str | None,
    grads_path: str,
    part: str,
    inter_path: str | None,
    no_verify: bool,
    fsync: bool,
    trust_keys: tuple[str, ...],
    allow_kernels: bool,
    timeout: float | None,
) -> None:
    """Run the backward: residuals (+ cotangents) -> gradients, without the forward."""
    from ..artifact.arguments import check_keys
    from ..artifact.residual_files import load_residuals
    from ..files import load_arrays, save_arrays

    _check_part(part, residuals_path, cotangents_path, inter_path)
    writes_inter = part == "input"
    staged = StagedOutputs(
        {"--grads": grads_path, "--intermediates": inter_path if writes_inter else None},
        {
            "ARTIFACT": artifact,
            "--residuals": residuals_path,
            "--inputs": inputs_path,
            "--cotangents": cotangents_path,
            "--intermediates": None if writes_inter else inter_path,
        },
        fsync=fsync,
    )
    with staged as out:
        use_compilation_cache()
        with _timed(timeout, artifact):
            art = load_artifact(artifact, trust_keys, allow_kernels)
            art.executable_cache = executable_cache()
            inputs = None
            if inputs_path:
                inputs = load_arrays(inputs_path)[0]
                # The same inputs file run-fwd read: every input key, nothing else.
                check_keys(inputs_path, "input", [leaf.key for leaf in art.manifest.inputs], inputs)
            res = None
            if residuals_path:
                res = load_residuals(
                    residuals_path, inputs=inputs, artifact=art, inputs_source=inputs_path, verify=not no_verify
                )
            paths = {"residuals": residuals_path, "inputs": inputs_path, "cotangents": cotangents_path}
            grads, inter = _backward(art, part, res, inputs, paths, inter_path, verify=not no_verify)
            grads = to_numpy(grads)  # finish the compute before any file is written
        if inter is not None:
            from ..artifact.residual_files import save_intermediates

            # Without --inputs now there will be none for --part weight either: keep the inputs W reads.
            out.write("--intermediates", lambda tmp: save_intermediates(tmp, inter, self_contained=inputs_path is None))
        meta = {"kind": "vjpsplit-grads", "fingerprint": art.manifest.fingerprint}
        out.write("--grads", lambda tmp: save_arrays(tmp, grads, meta))
    log(
        f"wrote {grads_path}: {plural_count(len(grads), 'gradient')}"
        + (f"; {inter_path}: {plural_count(len(inter.arrays), 'intermediate')}" if inter else "")
    )


def _check_part(part: str, residuals_path: str | None, cotangents_path: str | None, inter_path: str | None) -> None:
    """The files each --part reads and writes: a missing or extra one is a usage error."""
    if part != "all" and not inter_path:
        raise click.UsageError(f"--part {part} needs --intermediates FILE")
    if part != "weight" and not residuals_path:
        raise click.UsageError("--residuals FILE is required (only --part weight can do without)")
    if part == "weight" and cotangents_path:
        raise click.UsageError("--part weight reads no cotangents: they are inside the intermediates")
    if part == "all" and inter_path:
        raise click.UsageError(
            "--intermediates goes with --part input (which writes it) or --part weight (which reads it)"
        )


def _backward(
    art: Artifact,
    part: str,
    res: Residuals | None,
    inputs: Mapping[str, Any] | None,
    paths: Mapping[str, str | None],
    inter_path: str | None,
    *,
    verify: bool,
) -> tuple[dict[str, Any], Intermediates | None]:
    """Run ``--part`` of the backward: ``(grads, intermediates to write or None)``."""
    from ..files import load_arrays

    if part == "weight":
        from ..artifact.residual_files import load_intermediates

        assert inter_path is not None  # _check_part: every --part but all has --intermediates
        inter = load_intermediates(
            inter_path, inputs=inputs, artifact=art, inputs_source=paths["inputs"], verify=verify
        )
        return art.run_bwd_weight_arrays(
            res, inter, source=paths["residuals"] or "residuals", inter_source=inter_path
        ), None
    source = paths["residuals"]
    assert res is not None and source is not None  # _check_part: every --part but weight has --residuals
    cts = load_arrays(paths["cotangents"])[0] if paths["cotangents"] else None
    ct_source = paths["cotangents"] or "cotangents"
    if part == "input":
        return art.run_bwd_input_arrays(res, cts, source=source, ct_source=ct_source)
    return art.run_bwd_arrays(res, cts, source=source, ct_source=ct_source), None
