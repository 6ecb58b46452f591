"""The ``vjpsplit`` command line: a thin layer over the library.

Every failure the user can fix is one line ``error: …`` on stderr and exit 1
(usage mistakes: exit 2); tracebacks only with ``--debug``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback

import click

from .errors import VjpsplitError

_ARRAY_FILE = click.Path(dir_okay=False, path_type=str)
_EXISTING = click.Path(dir_okay=True, path_type=str)  # existence is checked by our loaders, with our message


class CliError(click.ClickException):
    """Printed as ``error: <message>`` (SPEC.md's form), exit 1."""

    exit_code = 1

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def _log(msg: str) -> None:
    click.echo(msg, err=True)


def _debug_enabled(ctx: click.Context) -> bool:
    return bool(ctx.find_root().params.get("debug")) or bool(ctx.params.get("debug")) or os.environ.get("VJPSPLIT_DEBUG") == "1"


def _command(fn):
    """Wrap a command body: library errors become one-line errors, others too unless --debug."""

    @click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
    @functools.wraps(fn)
    def wrapper(*args, debug: bool = False, **kwargs):
        ctx = click.get_current_context()
        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except VjpsplitError as e:
            from .specs import UsageError

            if debug or _debug_enabled(ctx):
                traceback.print_exc()
            if isinstance(e, UsageError):
                raise click.UsageError(str(e)) from e
            raise CliError(str(e)) from e
        except Exception as e:  # user code or a bug: still one line, unless asked
            if debug or _debug_enabled(ctx):
                traceback.print_exc()
            text = str(e).strip().splitlines()
            raise CliError(f"{type(e).__name__}: {text[0] if text else ''} (rerun with --debug for the traceback)") from e

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="vjpsplit", message="vjpsplit %(version)s")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.option("--no-cache", is_flag=True,
              help="Do not use the persistent compilation cache (see VJPSPLIT_CACHE_DIR).")
def main(debug: bool, no_cache: bool) -> None:
    """Run a JAX function's forward now and its backward later, from exported artifacts."""


def cache_dir() -> str | None:
    """Where run-fwd/run-bwd keep compiled executables; None when caching is off.

    ``VJPSPLIT_CACHE_DIR`` moves it (empty, ``0`` or ``off`` turns it off); the
    default is ``vjpsplit/jax`` under ``$XDG_CACHE_HOME`` (``~/.cache``).
    """
    env = os.environ.get("VJPSPLIT_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "none") else env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vjpsplit", "jax")


def _use_compilation_cache() -> None:
    """Turn on JAX's persistent compilation cache, so a repeated run skips XLA compilation."""
    if click.get_current_context().find_root().params.get("no_cache"):
        return
    import jax

    if jax.config.jax_compilation_cache_dir:  # the user configured JAX's own cache: keep it
        return
    path = cache_dir()
    if path is None:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        _log(f"warning: compilation cache {path} unusable ({e.strerror}); running without it")
        return
    jax.config.update("jax_compilation_cache_dir", path)
    # Small programs compile fast but a CLI pays for every one: cache them all.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _names(text: str | None) -> list[str] | None:
    """``"a, b"`` -> ``["a", "b"]``; None stays None (the option was not given)."""
    return None if text is None else [w.strip() for w in text.split(",") if w.strip()]


def _enable_x64_if(needed: bool) -> None:
    if needed:
        import jax

        jax.config.update("jax_enable_x64", True)


def _function_options(fn):
    """The options that say which function to trace and how: shared by export and plan."""
    for option in reversed([
        click.argument("target", metavar="MODULE:FN"),
        click.option("--shapes", "shapes", multiple=True, required=True, metavar="NAME=SPEC",
                     help="One per positional parameter: NAME=f32[b,784], NAME=@module:attr, or NAME=file.npz."),
        click.option("--wrt", default=None, metavar="NAMES",
                     help="Comma-separated parameters to differentiate (default: all)."),
        click.option("--has-aux", is_flag=True, help="FN returns (out, aux); only out is differentiated."),
    ]):
        fn = option(fn)
    return fn


@main.command("export")
@_function_options
@click.option("--platforms", default="cpu,cuda,tpu", show_default=True, help="Comma-separated platforms to lower for.")
@click.option("--policy", default="everything", show_default=True,
              help="What the forward keeps: everything, dots, nothing, or names:a,b.")
@click.option("--memory-budget", default=None, metavar="BYTES",
              help="Pick the policy that recomputes least among those whose stored residuals fit (e.g. 64MiB).")
@click.option("--at", "at", multiple=True, metavar="NAME=SIZE",
              help="Sizes for symbolic dims when weighing residuals against --memory-budget (e.g. b=256).")
@click.option("--weights", default=None, metavar="NAMES",
              help="Comma-separated weight parameters: adds the zero-bubble split backward (run-bwd --part).")
@click.option("-o", "--output", required=True, type=_ARRAY_FILE, help="Artifact file to write.")
@_command
def export_cmd(target, shapes, wrt, has_aux, platforms, policy, memory_budget, at, weights, output):
    """Export FN's forward and backward into one portable artifact."""
    from .artifact import export
    from .economy import parse_at
    from .specs import load_object, resolve_shapes

    source = click.get_current_context().get_parameter_source("policy")
    if memory_budget is not None and source != click.core.ParameterSource.DEFAULT:
        raise click.UsageError("give either --policy or --memory-budget, not both")

    fn, name = load_object(target)
    if not callable(fn):
        raise VjpsplitError(f"{target} is not callable; point MODULE:FN at a function")
    names, specs = resolve_shapes(fn, shapes)
    _enable_x64_if(_wants_x64(specs))
    art = export(fn, *specs, wrt=_names(wrt), has_aux=has_aux, platforms=platforms,
                 policy=None if memory_budget is not None else policy,
                 arg_names=names, name=name, memory_budget=memory_budget, at=parse_at(at),
                 weights=_names(weights))
    art.save(output)
    m = art.manifest
    if memory_budget is not None:
        _log(f"memory budget {memory_budget}: chose policy {m.policy}")
    _log(f"wrote {output}: {m.function}, {len(m.inputs)} inputs, {len(m.residuals)} residuals "
         f"({sum(r.input_backed for r in m.residuals)} input-backed), platforms {','.join(m.platforms)}")


def _wants_x64(specs) -> bool:
    import jax
    import numpy as np

    wide = {np.dtype(n) for n in ("float64", "int64", "uint64", "complex128")}
    return any(np.dtype(s.dtype) in wide for s in jax.tree_util.tree_leaves(specs))


def _load_artifact(path):
    from .artifact import load

    # Read the manifest's x64 flag before jax touches any array.
    art = load(path)
    _enable_x64_if(art.manifest.x64)
    return art


def _numpy(values: dict) -> dict:
    import numpy as np

    return {k: np.asarray(v) for k, v in values.items()}


@main.command("run-fwd")
@click.argument("artifact", type=_EXISTING)
@click.option("--inputs", "inputs_path", required=True, type=_EXISTING, help="Array file with every input key.")
@click.option("--residuals", "residuals_path", required=True, type=_ARRAY_FILE, help="Residuals file to write.")
@click.option("--outputs", "outputs_path", type=_ARRAY_FILE, default=None, help="Outputs file to write (out, aux).")
@click.option("--self-contained", is_flag=True, help="Also write input-backed residuals, so run-bwd needs no --inputs.")
@_command
def run_fwd_cmd(artifact, inputs_path, residuals_path, outputs_path, self_contained):
    """Run the forward: inputs -> outputs and residuals."""
    from .arrays import load_arrays, save_arrays
    from .residuals import save_residuals

    _use_compilation_cache()
    art = _load_artifact(artifact)
    inputs, _ = load_arrays(inputs_path)
    outputs, res = art.run_fwd_arrays(inputs, source=inputs_path)
    outputs = _numpy(outputs)  # finish the compute before any file is written
    save_residuals(residuals_path, res, self_contained=self_contained)
    if outputs_path:
        save_arrays(outputs_path, outputs, {"kind": "vjpsplit-outputs", "fingerprint": art.manifest.fingerprint})
    _log(f"wrote {residuals_path}: {len(res.stored)} stored residuals "
         f"({'with' if self_contained else 'without'} {len(res.inputs)} input-backed)"
         + (f"; {outputs_path}: {len(outputs)} outputs" if outputs_path else ""))


@main.command("run-bwd")
@click.argument("artifact", type=_EXISTING)
@click.option("--residuals", "residuals_path", required=True, type=_EXISTING, help="Residuals file from run-fwd.")
@click.option("--inputs", "inputs_path", type=_EXISTING, default=None,
              help="The forward's inputs file; needed unless the residuals are self-contained.")
@click.option("--cotangents", "cotangents_path", type=_EXISTING, default=None,
              help="Cotangents keyed like the outputs; default 1 for a scalar output.")
@click.option("--grads", "grads_path", required=True, type=_ARRAY_FILE, help="Gradients file to write.")
@click.option("--part", type=click.Choice(["all", "input", "weight"]), default="all", show_default=True,
              help="Zero-bubble split: 'input' writes non-weight grads and --intermediates; 'weight' reads them.")
@click.option("--intermediates", "inter_path", type=_ARRAY_FILE, default=None,
              help="With --part: the intermediates file (written by input, read by weight).")
@click.option("--no-verify", is_flag=True, help="Skip the CRC-32 check of residuals and intermediates.")
@_command
def run_bwd_cmd(artifact, residuals_path, inputs_path, cotangents_path, grads_path, part, inter_path, no_verify):
    """Run the backward: residuals (+ cotangents) -> gradients, without the forward."""
    from .arrays import load_arrays, save_arrays
    from .artifact import check_keys
    from .residuals import load_residuals

    if part != "all" and not inter_path:
        raise click.UsageError(f"--part {part} needs --intermediates FILE")
    if part == "weight" and cotangents_path:
        raise click.UsageError("--part weight reads no cotangents: they are inside the intermediates")
    _use_compilation_cache()
    art = _load_artifact(artifact)
    inputs = None
    if inputs_path:
        inputs = load_arrays(inputs_path)[0]
        # The same inputs file run-fwd read: every input key, nothing else.
        check_keys(inputs_path, "input", [leaf.key for leaf in art.manifest.inputs], inputs)
    res = load_residuals(residuals_path, inputs=inputs, artifact=art, inputs_source=inputs_path,
                         verify=not no_verify)
    if part == "weight":
        from .residuals import load_intermediates

        inter = load_intermediates(inter_path, artifact=art, verify=not no_verify)
        grads = art.run_bwd_weight_arrays(res, inter, source=residuals_path, inter_source=inter_path)
        inter = None
    else:
        cts = load_arrays(cotangents_path)[0] if cotangents_path else None
        ct_source = cotangents_path or "cotangents"
        if part == "input":
            grads, inter = art.run_bwd_input_arrays(res, cts, source=residuals_path, ct_source=ct_source)
        else:
            grads, inter = art.run_bwd_arrays(res, cts, source=residuals_path, ct_source=ct_source), None
    grads = _numpy(grads)  # finish the compute before any file is written
    if inter is not None:
        from .residuals import save_intermediates

        save_intermediates(inter_path, inter)
    save_arrays(grads_path, grads, {"kind": "vjpsplit-grads", "fingerprint": art.manifest.fingerprint})
    _log(f"wrote {grads_path}: {len(grads)} gradients" + (f"; {inter_path}: {len(inter.arrays)} intermediates" if inter else ""))


@main.command("inspect")
@click.argument("artifact", type=_EXISTING)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--at", "at", multiple=True, metavar="NAME=SIZE", help="Size symbolic dims in the byte totals (b=256).")
@_command
def inspect_cmd(artifact, as_json, at):
    """Describe an artifact: keys, dtypes, shapes, residual bytes, platforms, versions."""
    from .artifact import load
    from .economy import parse_at
    from .report import describe, format_table

    art = load(artifact)
    sizes = parse_at(at)
    if as_json:
        click.echo(json.dumps(describe(art, sizes), indent=2))
    else:
        click.echo(format_table(art, sizes))


@main.command("plan")
@_function_options
@click.option("--at", "at", multiple=True, metavar="NAME=SIZE", help="Sizes for symbolic dims (b=256): bytes and FLOPs.")
@click.option("--policies", default="everything,dots,nothing", show_default=True,
              help="Comma-separated policies to compare (names:a,b allowed; separate several with ';').")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
@_command
def plan_cmd(target, shapes, wrt, has_aux, at, policies, as_json):
    """Compare policies before exporting: stored residual bytes and backward recompute per policy."""
    from .economy import parse_at, plan_policies
    from .report import format_plan
    from .specs import load_object, resolve_shapes

    fn, _ = load_object(target)
    names, specs = resolve_shapes(fn, shapes)
    _enable_x64_if(_wants_x64(specs))
    sizes = parse_at(at)
    chosen = [p.strip() for p in (policies.split(";") if "names:" in policies else policies.split(",")) if p.strip()]
    costs = plan_policies(fn, *specs, wrt=_names(wrt), has_aux=has_aux, at=sizes, policies=chosen)
    if as_json:
        click.echo(json.dumps([c.to_json() for c in costs], indent=2))
    else:
        click.echo(format_plan(costs, sizes))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
