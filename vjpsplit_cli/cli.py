"""The ``vjpsplit`` command line: a thin layer over the library.

Every failure the user can fix is one line ``error: …`` on stderr and exit 1
(usage mistakes: exit 2); tracebacks only with ``--debug``. Every command checks
its outputs before any work and replaces them all or none (``outputs.StagedOutputs``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import traceback

import click

from .outputs import StagedOutputs, UsageError
from .reading import os_error_message
from .signals import Interrupted, outputs_committed
from .terminal import printable
from .errors import VjpsplitError, one_line

_EXISTING = click.Path(dir_okay=True, path_type=str)  # existence is checked by our loaders, with our message
_EXISTING.name = "file"  # shown as FILE in --help, as the files commands write are
_ARRAY_SUFFIXES = (".npz", ".msgpack")


class CliError(click.ClickException):
    """Printed as ``error: <message>`` (docs/contract.md's form), exit 1; control characters escaped."""

    exit_code = 1

    def show(self, file=None) -> None:
        click.echo(f"error: {printable(self.format_message())}", err=True)


def _log(msg: str) -> None:
    click.echo(printable(msg), err=True)


def _count(n: int, noun: str, plural: str | None = None) -> str:
    """``1 gradient``, ``3 gradients``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


class _OutputFile(click.ParamType):
    """A file a command writes: how it is spelled is checked here (exit 2); what is on disk, by StagedOutputs."""

    name = "FILE"

    def __init__(self, arrays: bool):
        self.arrays = arrays

    def convert(self, value, param, ctx):
        text = os.fspath(value)
        if text == "-":
            self.fail("'-' (standard output) is not supported; give a file name", param, ctx)
        if not text:
            self.fail("the file name is empty; give a file name", param, ctx)
        if text.endswith(("/", os.sep)):
            self.fail(f"{printable(text)} ends with '/', so it names a directory; give a file name", param, ctx)
        if self.arrays and os.path.splitext(text)[1].lower() not in _ARRAY_SUFFIXES:
            ext = os.path.splitext(text)[1]
            what = f"extension {printable(ext)!r}" if ext else "no extension"
            self.fail(f"{printable(text)}: unknown array file format ({what}); use a .npz or .msgpack file name",
                      param, ctx)
        return text


_ARRAY_OUT = _OutputFile(arrays=True)
_ARTIFACT_OUT = _OutputFile(arrays=False)


class _ShapeSpec(click.ParamType):
    """``NAME=SPEC`` for --shapes; a ``DTYPE[DIMS]`` spec is parsed here, so bad dims exit 2."""

    name = "NAME=SPEC"

    def convert(self, value, param, ctx):
        name, eq, spec = str(value).partition("=")
        if not eq or not name.strip() or not spec.strip():
            self.fail(f"{printable(value)!r} is not NAME=SPEC; write e.g. x=f32[b,784]", param, ctx)
        spec = spec.strip()
        if not spec.startswith("@") and not spec.lower().endswith(_ARRAY_SUFFIXES):
            from .shapes import new_scope, parse_array_spec

            try:
                parse_array_spec(spec, new_scope())
            except VjpsplitError as e:
                self.fail(printable(f"{name.strip()}={spec}: {e}"), param, ctx)
        return str(value)


class _AtSizes(click.ParamType):
    """``NAME=SIZE[,NAME=SIZE]`` for --at; sizes are ASCII integers from 1 to 2**40."""

    name = "NAME=SIZE"

    def convert(self, value, param, ctx):
        from .policies import parse_at

        try:
            parse_at([str(value)])
        except VjpsplitError as e:
            self.fail(printable(str(e).removeprefix("--at ")), param, ctx)
        return str(value)


# Options of the whole tool, accepted before or after the subcommand (``vjpsplit --debug run-fwd …``
# or ``vjpsplit run-fwd … --debug``): the group and every command declare them.
_GLOBAL_OPTIONS = (
    click.option("--debug", is_flag=True, help="Show full tracebacks on errors (also VJPSPLIT_DEBUG=1)."),
    click.option("--no-cache", is_flag=True,
                 help="Do not use the persistent compilation cache (see VJPSPLIT_CACHE_DIR)."),
)


def _global_options(fn):
    for option in reversed(_GLOBAL_OPTIONS):
        fn = option(fn)
    return fn


def _global_flag(ctx: click.Context, name: str) -> bool:
    """A global flag, given before the subcommand (the group's) or after it (the command's)."""
    return bool(ctx.find_root().params.get(name)) or bool(ctx.params.get(name))


def _debug_enabled(ctx: click.Context) -> bool:
    return _global_flag(ctx, "debug") or os.environ.get("VJPSPLIT_DEBUG") == "1"


def _command(fn):
    """Wrap a command body: library errors become one-line errors, others too unless --debug."""

    @_global_options
    @functools.wraps(fn)
    def wrapper(*args, debug: bool = False, no_cache: bool = False, **kwargs):
        ctx = click.get_current_context()
        show = debug or _debug_enabled(ctx)
        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except VjpsplitError as e:
            if show:
                traceback.print_exc()
            if isinstance(e, UsageError):
                raise click.UsageError(printable(e)) from e
            raise CliError(str(e)) from e
        except (KeyboardInterrupt, Interrupted) as e:
            # Temp files are gone already (StagedOutputs); SIGTERM/SIGHUP never get here, they end the process.
            if outputs_committed():  # the signal was held until the renames finished
                _log(f"error: {ctx.info_name}: interrupted just after writing its outputs, which are complete")
            else:
                _log(f"error: {ctx.info_name}: interrupted; every previous output is left as it was")
            raise click.exceptions.Exit(128 + getattr(e, "signum", 2)) from e
        except MemoryError as e:
            if show:
                traceback.print_exc()
            raise CliError(f"{_subject(kwargs)}: out of memory while running {ctx.info_name}; "
                           "use smaller inputs or a machine with more memory") from e
        except OSError as e:
            if show:
                traceback.print_exc()
            raise CliError(os_error_message(e.filename or _subject(kwargs), e, f"running {ctx.info_name}")) from e
        except Exception as e:  # user code or a bug: still one line, unless asked
            if show:
                traceback.print_exc()
            raise CliError(_unexpected(ctx.info_name, kwargs, e)) from e

    return wrapper


def _subject(kwargs) -> str:
    """What a command works on, for messages that have no file of their own: the artifact, or MODULE:FN."""
    return str(kwargs.get("artifact") or kwargs.get("target") or "vjpsplit")


def _unexpected(command: str, kwargs, e: Exception) -> str:
    """One line for an exception nothing mapped: name the artifact or function and say what to try."""
    what = f"{type(e).__name__} {one_line(e, 160)}".strip()
    if isinstance(e, ImportError):  # user modules are imported by specs.load_object, which says so itself
        return (f"{_subject(kwargs)}: {command} could not load a part of vjpsplit or of JAX ({what}); "
                "reinstall vjpsplit and its dependencies, or rerun with --debug for the traceback")
    if kwargs.get("artifact"):
        return (f"{kwargs['artifact']}: {command} failed on this artifact ({what}); it may be damaged or "
                "hand-edited: re-export it, or rerun with --debug for the traceback")
    return (f"{_subject(kwargs)}: {command} failed ({what}); check the function and its --shapes, "
            "or rerun with --debug for the traceback")


class _OneLineUsageError(click.UsageError):
    """A usage error printed as one line, ``error: <message> (see '<command> --help')``; exit 2."""

    def show(self, file=None) -> None:
        hint = f" (see '{self.ctx.command_path} --help')" if self.ctx is not None else ""
        click.echo(f"error: {printable(self.format_message())}{hint}", err=True)


@contextlib.contextmanager
def _one_line_usage_errors():
    """Turn click's usage errors (usage text, hint, message: several lines) into one line."""
    try:
        yield
    except click.UsageError as e:
        if isinstance(e, (_OneLineUsageError, getattr(click.exceptions, "NoArgsIsHelpError", ()))):
            raise  # bare 'vjpsplit' prints the help, as click does
        raise _OneLineUsageError(e.format_message(), e.ctx) from e


class _Main(click.Group):
    """The ``vjpsplit`` group: usage errors of the group and of every command are one line."""

    def make_context(self, *args, **kwargs):
        with _one_line_usage_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with _one_line_usage_errors():
            return super().invoke(ctx)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]},
             epilog="\b\nExample (the sample MLP, from a clone of the repository):\n"
                    "  vjpsplit export samples/mlp.py:loss --shapes params=@samples/mlp.py:param_shapes \\\n"
                    "      --shapes 'x=f32[b,784]' --shapes 'labels=i32[b]' -o mlp.vjps\n"
                    "  vjpsplit template mlp.vjps -o inputs.npz --at b=32 --fill normal\n"
                    "  vjpsplit run-fwd mlp.vjps --inputs inputs.npz --residuals res.npz\n"
                    "  vjpsplit run-bwd mlp.vjps --residuals res.npz --inputs inputs.npz --grads grads.npz\n"
                    "Global options (--debug, --no-cache) go before or after the command.")
@click.version_option(package_name="vjpsplit", message="vjpsplit %(version)s")
@_global_options
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


def _executable_cache() -> str | None:
    """Where run-fwd/run-bwd keep serialized executables (``executables`` under ``cache_dir()``); None when off."""
    if _global_flag(click.get_current_context(), "no_cache"):
        return None
    path = cache_dir()
    return None if path is None else os.path.join(path, "executables")


def _use_compilation_cache() -> None:
    """Turn on JAX's persistent compilation cache, so a repeated run skips XLA compilation."""
    if _global_flag(click.get_current_context(), "no_cache"):
        return
    import jax

    if jax.config.jax_compilation_cache_dir:  # the user configured JAX's own cache: keep it
        return
    path = cache_dir()
    if path is None:
        return
    try:
        os.makedirs(path, exist_ok=True)
        usable = os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)
        problem = "not a writable directory"
    except OSError as e:
        usable, problem = False, e.strerror or str(e)
    if not usable:
        # A cache is an optimisation: without one the command still works, so say so only when asked.
        if _debug_enabled(click.get_current_context()):
            _log(f"debug: compilation cache {path} unusable ({problem}); running without it")
        return
    if not _debug_enabled(click.get_current_context()):
        import warnings

        # JAX warns per entry when the cache fails later (disk full, removed); the run is fine without it.
        warnings.filterwarnings("ignore", message=".*persistent compilation cache.*")
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
        click.option("--shapes", "shapes", multiple=True, required=True, type=_ShapeSpec(), metavar="NAME=SPEC",
                     help="One per positional parameter: NAME=f32[b,784], NAME=@module:attr, or NAME=file.npz."),
        click.option("--wrt", default=None, metavar="NAMES",
                     help="Comma-separated parameters to differentiate (default: all)."),
        click.option("--has-aux", is_flag=True, help="FN returns (out, aux); only out is differentiated."),
    ]):
        fn = option(fn)
    return fn


@main.command("export", short_help="Export FN's forward and backward into one artifact.",
              epilog="\b\nExamples:\n  vjpsplit export samples/mlp.py:loss --shapes params=@samples/mlp.py:param_shapes \\\n      --shapes 'x=f32[b,784]' --shapes 'labels=i32[b]' -o mlp.vjps\n  vjpsplit export model.py:stage --shapes w=weights.npz --shapes 'x=bf16[b,512]' \\\n      --policy dots --platforms cpu,cuda -o stage.vjps")
@_function_options
@click.option("--platforms", default="cpu,cuda,tpu", show_default=True, help="Comma-separated platforms to lower for.")
@click.option("--policy", default="everything", show_default=True,
              help="What the forward keeps: everything, dots, nothing, names:a,b, or auto (the fastest fwd+bwd "
                   "measured here at the --at sizes, within --memory-budget if given).")
@click.option("--memory-budget", default=None, metavar="BYTES",
              help="Pick the policy that recomputes least among those whose stored residuals fit (e.g. 64MiB).")
@click.option("--at", "at", multiple=True, type=_AtSizes(), metavar="NAME=SIZE",
              help="Sizes for symbolic dims when weighing residuals against --memory-budget (e.g. b=256).")
@click.option("--weights", default=None, metavar="NAMES",
              help="Comma-separated weight parameters: adds the zero-bubble split backward (run-bwd --part).")
@click.option("-o", "--output", required=True, type=_ARTIFACT_OUT, help="Artifact file to write.")
@_command
def export_cmd(target, shapes, wrt, has_aux, platforms, policy, memory_budget, at, weights, output):
    """Export FN's forward and backward into one portable artifact."""
    from .lowering import export
    from .policies import parse_at
    from .specs import check_fits, load_object, resolve_shapes

    source = click.get_current_context().get_parameter_source("policy")
    if memory_budget is not None and source != click.core.ParameterSource.DEFAULT and policy != "auto":
        raise click.UsageError("give either --policy or --memory-budget (or both with --policy auto), not both")

    with StagedOutputs({"-o": output}, {"MODULE:FN": _module_files(target), "--shapes": _shape_files(shapes)}) as out:
        fn, name = load_object(target)
        if not callable(fn):
            raise VjpsplitError(f"{target} is not callable; point MODULE:FN at a function")
        names, specs = resolve_shapes(fn, shapes)
        _check_at(at, specs)
        _enable_x64_if(_wants_x64(specs))
        check_fits(fn, target, names, specs, shapes)
        if policy == "auto":
            _log_timing(at)
        art = export(fn, *specs, wrt=_names(wrt), has_aux=has_aux, platforms=platforms,
                     policy=None if memory_budget is not None and policy != "auto" else policy,
                     arg_names=names, name=name, memory_budget=memory_budget, at=parse_at(at),
                     weights=_names(weights))
        out.write("-o", art.save)
    m = art.manifest
    if art.policy_choice.reason:  # auto's measurements, or the budget's pick
        _log(art.policy_choice.reason)
    backed = sum(r.input_backed for r in m.residuals)
    _log(f"wrote {output}: {m.function}, {_count(len(m.inputs), 'input')}, "
         f"{_count(len(m.residuals) - backed, 'stored residual')} and {backed} input-backed, "
         f"platforms {','.join(m.platforms)}")


def _log_timing(at) -> None:
    """Policy auto compiles and times every candidate: seconds each, so say so before the wait."""
    sizes = f" at {', '.join(at)}" if at else ""
    _log(f"policy auto: compiling and timing fwd+bwd of each policy{sizes} (about a second each)...")


def _check_at(at, specs) -> dict[str, int]:
    """--at sizes for the traced function: a name that is no symbolic dim of the --shapes is a usage error."""
    from .policies import check_at_names, parse_at, symbolic_dim_names

    sizes = parse_at(at)
    check_at_names(sizes, symbolic_dim_names(specs), "the --shapes")
    return sizes


def _module_files(target: str) -> list[str]:
    """The source files that ``MODULE:FN`` (or ``@MODULE:ATTR``) can name, found without importing anything."""
    module = target.rpartition(":")[0]
    if module.endswith(".py") or "/" in module or os.sep in module:
        return [module]
    base = os.path.join(*module.split(".")) if module else ""
    return [base + ".py", os.path.join(base, "__init__.py")] if base else []


def _shape_files(shapes) -> list[str]:
    """The files that --shapes values read: array files and @MODULE:ATTR sources."""
    files = []
    for item in shapes:
        spec = str(item).partition("=")[2].strip()
        if spec.startswith("@"):
            files += _module_files(spec[1:])
        elif spec.lower().endswith(_ARRAY_SUFFIXES):
            files.append(spec)
    return files


def _wants_x64(specs) -> bool:
    import jax
    import numpy as np

    wide = {np.dtype(n) for n in ("float64", "int64", "uint64", "complex128")}
    from .prng import is_key

    return any(not is_key(s) and np.dtype(s.dtype) in wide for s in jax.tree_util.tree_leaves(specs))


def _load_artifact(path, *, x64: bool = True):
    """Load an artifact; a manifest that decodes but does not fit the format is one line naming the file."""
    from .artifact import load

    try:
        art = load(path)
    except (VjpsplitError, MemoryError, OSError):
        raise
    except Exception as e:  # e.g. a hand-edited manifest whose fingerprint was recomputed
        raise VjpsplitError(f"{path}: the artifact's manifest is malformed ({type(e).__name__} {one_line(e, 80)}); "
                            "re-export it with vjpsplit export") from e
    if x64:
        # Read the manifest's x64 flag before jax touches any array.
        _enable_x64_if(art.manifest.x64)
    return art


def _numpy(values: dict) -> dict:
    import numpy as np

    return {k: np.asarray(v) for k, v in values.items()}


# Residuals, outputs, grads and intermediates are transient: by default they are not
# flushed to disk (the rename is atomic, checksums catch a file torn by a power loss).
_fsync_option = click.option(
    "--fsync", is_flag=True,
    help="Flush every file written to disk before exiting, so it survives a power loss "
         "(slower; also VJPSPLIT_FSYNC=1).")


@main.command("run-fwd", short_help="Run the forward: inputs -> outputs and residuals.",
              epilog="\b\nExamples:\n  vjpsplit template mlp.vjps -o inputs.npz --at b=32 --fill normal\n  vjpsplit run-fwd mlp.vjps --inputs inputs.npz --residuals res.npz --outputs out.npz")
@click.argument("artifact", type=_EXISTING)
@click.option("--inputs", "inputs_path", required=True, type=_EXISTING, help="Array file with every input key.")
@click.option("--residuals", "residuals_path", required=True, type=_ARRAY_OUT, help="Residuals file to write.")
@click.option("--outputs", "outputs_path", type=_ARRAY_OUT, default=None, help="Outputs file to write (out, aux).")
@click.option("--self-contained", is_flag=True, help="Also write input-backed residuals, so run-bwd needs no --inputs.")
@_fsync_option
@_command
def run_fwd_cmd(artifact, inputs_path, residuals_path, outputs_path, self_contained, fsync):
    """Run the forward: inputs -> outputs and residuals."""
    from .files import load_arrays, save_arrays
    from .residual_files import save_residuals

    with StagedOutputs({"--residuals": residuals_path, "--outputs": outputs_path},
                       {"ARTIFACT": artifact, "--inputs": inputs_path}, fsync=fsync) as out:
        _use_compilation_cache()
        art = _load_artifact(artifact)
        art.executable_cache = _executable_cache()
        inputs, _ = load_arrays(inputs_path)
        outputs, res = art.run_fwd_arrays(inputs, source=inputs_path)
        outputs = _numpy(outputs)  # finish the compute before any file is written
        out.write("--residuals", lambda tmp: save_residuals(tmp, res, self_contained=self_contained))
        if outputs_path:
            meta = {"kind": "vjpsplit-outputs", "fingerprint": art.manifest.fingerprint}
            out.write("--outputs", lambda tmp: save_arrays(tmp, outputs, meta))
    backed = _count(len(res.inputs), "input-backed residual")
    _log(f"wrote {residuals_path}: {_count(len(res.stored), 'stored residual')}"
         + ((f" and {backed}" if self_contained else f"; {backed} left out, run-bwd reads them from --inputs")
            if res.inputs else "")
         + (f"; {outputs_path}: {_count(len(outputs), 'output')}" if outputs_path else ""))


@main.command("run-bwd", short_help="Run the backward: residuals -> gradients.",
              epilog="\b\nExamples:\n  vjpsplit run-bwd mlp.vjps --residuals res.npz --inputs inputs.npz --grads grads.npz\n  vjpsplit run-bwd mlp.vjps --residuals res.npz --inputs inputs.npz --cotangents ct.npz --grads grads.npz")
@click.argument("artifact", type=_EXISTING)
@click.option("--residuals", "residuals_path", type=_EXISTING,
              help="Residuals file from run-fwd (required, except for --part weight, whose intermediates carry "
                   "the residuals it reads).")
@click.option("--inputs", "inputs_path", type=_EXISTING, default=None,
              help="The forward's inputs file; needed unless the residuals are self-contained.")
@click.option("--cotangents", "cotangents_path", type=_EXISTING, default=None,
              help="Cotangents keyed like the outputs; default 1 for a scalar output.")
@click.option("--grads", "grads_path", required=True, type=_ARRAY_OUT, help="Gradients file to write.")
@click.option("--part", type=click.Choice(["all", "input", "weight"]), default="all", show_default=True,
              help="Zero-bubble split: 'input' writes non-weight grads and --intermediates; 'weight' reads them.")
@click.option("--intermediates", "inter_path", type=_ARRAY_OUT, default=None,
              help="With --part: the intermediates file (written by input, read by weight).")
@click.option("--no-verify", is_flag=True,
              help="Skip every check that ties the files together: the CRC-32s of residuals and intermediates, "
                   "that --inputs are the very inputs the forward ran on (dims and content), and that the "
                   "intermediates come from the same forward run as the residuals.")
@_fsync_option
@_command
def run_bwd_cmd(artifact, residuals_path, inputs_path, cotangents_path, grads_path, part, inter_path, no_verify,
                fsync):
    """Run the backward: residuals (+ cotangents) -> gradients, without the forward."""
    from .files import load_arrays, save_arrays
    from .manifest import check_keys
    from .residual_files import load_residuals

    if part != "all" and not inter_path:
        raise click.UsageError(f"--part {part} needs --intermediates FILE")
    if part != "weight" and not residuals_path:
        raise click.UsageError("--residuals FILE is required (only --part weight can do without)")
    if part == "weight" and cotangents_path:
        raise click.UsageError("--part weight reads no cotangents: they are inside the intermediates")
    if part == "all" and inter_path:
        raise click.UsageError("--intermediates goes with --part input (which writes it) or --part weight (which reads it)")
    writes_inter = part == "input"
    staged = StagedOutputs(
        {"--grads": grads_path, "--intermediates": inter_path if writes_inter else None},
        {"ARTIFACT": artifact, "--residuals": residuals_path, "--inputs": inputs_path,
         "--cotangents": cotangents_path, "--intermediates": None if writes_inter else inter_path},
        fsync=fsync,
    )
    with staged as out:
        _use_compilation_cache()
        art = _load_artifact(artifact)
        art.executable_cache = _executable_cache()
        inputs = None
        if inputs_path:
            inputs = load_arrays(inputs_path)[0]
            # The same inputs file run-fwd read: every input key, nothing else.
            check_keys(inputs_path, "input", [leaf.key for leaf in art.manifest.inputs], inputs)
        res = None
        if residuals_path:
            res = load_residuals(residuals_path, inputs=inputs, artifact=art, inputs_source=inputs_path,
                                 verify=not no_verify)
        if part == "weight":
            from .residual_files import load_intermediates

            inter = load_intermediates(inter_path, inputs=inputs, artifact=art, inputs_source=inputs_path,
                                       verify=not no_verify)
            grads = art.run_bwd_weight_arrays(res, inter, source=residuals_path or "residuals", inter_source=inter_path)
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
            from .residual_files import save_intermediates

            # Without --inputs now there will be none for --part weight either: keep the inputs W reads.
            out.write("--intermediates", lambda tmp: save_intermediates(tmp, inter, self_contained=inputs_path is None))
        meta = {"kind": "vjpsplit-grads", "fingerprint": art.manifest.fingerprint}
        out.write("--grads", lambda tmp: save_arrays(tmp, grads, meta))
    _log(f"wrote {grads_path}: {_count(len(grads), 'gradient')}"
         + (f"; {inter_path}: {_count(len(inter.arrays), 'intermediate')}" if inter else ""))


@main.command("inspect", short_help="Describe an artifact: keys, dtypes, shapes, bytes.",
              epilog="\b\nExamples:\n  vjpsplit inspect mlp.vjps\n  vjpsplit inspect mlp.vjps --at b=256 --json")
@click.argument("artifact", type=_EXISTING)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--at", "at", multiple=True, type=_AtSizes(), metavar="NAME=SIZE",
              help="Size symbolic dims in the byte totals (b=256).")
@_command
def inspect_cmd(artifact, as_json, at):
    """Describe an artifact: keys, dtypes, shapes, residual bytes, platforms, versions."""
    from .policies import check_at_names, parse_at
    from .report import describe, format_table

    art = _load_artifact(artifact, x64=False)
    sizes = parse_at(at)
    check_at_names(sizes, art.manifest.dim_vars, artifact)
    if as_json:
        click.echo(json.dumps(describe(art, sizes), indent=2))
    else:
        click.echo(format_table(art, sizes))


@main.command("template", short_help="Write an inputs or cotangents file for an artifact.",
              epilog="\b\nExamples:\n  vjpsplit template mlp.vjps -o inputs.npz --at b=32 --fill normal\n  vjpsplit template mlp.vjps -o ct.npz --what cotangents --at b=32 --fill ones")
@click.argument("artifact", type=_EXISTING)
@click.option("-o", "--output", required=True, type=_ARRAY_OUT, metavar="FILE",
              help="Array file to write (.npz or .msgpack).")
@click.option("--at", "at", multiple=True, type=_AtSizes(), metavar="NAME=SIZE",
              help="Sizes for the artifact's symbolic dims (b=4); every one the keys need.")
@click.option("--what", type=click.Choice(["inputs", "cotangents"]), default="inputs", show_default=True,
              help="Which file: the inputs of run-fwd, or the cotangents of run-bwd.")
@click.option("--fill", type=click.Choice(["zeros", "ones", "normal"]), default="zeros", show_default=True,
              help="Values: zeros, ones, or normal (standard normal floats, integers 0..7, random bools and keys).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
              help="Random seed for --fill normal.")
@_command
def template_cmd(artifact, output, at, what, fill, seed):
    """Write an inputs or cotangents file with exactly the keys, dtypes and shapes ARTIFACT expects."""
    from .files import save_arrays
    from .templates import template

    with StagedOutputs({"-o": output}, {"ARTIFACT": artifact}) as out:
        art = _load_artifact(artifact, x64=False)
        arrays = template(art, what=what, at=at, fill=fill, seed=seed)
        meta = {"kind": f"vjpsplit-{what}", "fingerprint": art.manifest.fingerprint}
        out.write("-o", lambda tmp: save_arrays(tmp, arrays, meta))
    sizes = ", ".join(a for a in at)
    _log(f"wrote {output}: {_count(len(arrays), 'array')} for the {what} of {artifact}"
         + (f" at {sizes}" if sizes else "") + f", filled with {fill}")


@main.command("plan", short_help="Compare policies before exporting.",
              epilog="\b\nExamples:\n  vjpsplit plan samples/mlp.py:loss --shapes params=@samples/mlp.py:param_shapes \\\n      --shapes 'x=f32[b,784]' --shapes 'labels=i32[b]' --at b=256")
@_function_options
@click.option("--at", "at", multiple=True, type=_AtSizes(), metavar="NAME=SIZE",
              help="Sizes for symbolic dims (b=256): bytes and FLOPs.")
@click.option("--policies", default="everything,dots,nothing", show_default=True,
              help="Comma-separated policies to compare (names:a,b allowed; separate several with ';'); "
                   "add auto to time them here and show which auto picks and why (needs --at for symbolic dims).")
@click.option("--memory-budget", default=None, metavar="BYTES", help="With auto: only policies whose residuals fit.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
@_command
def plan_cmd(target, shapes, wrt, has_aux, at, policies, memory_budget, as_json):
    """Compare policies before exporting: stored residual bytes and backward recompute per policy."""
    from .policies import plan_policies
    from .report import format_plan
    from .specs import check_fits, load_object, resolve_shapes

    fn, _ = load_object(target)
    names, specs = resolve_shapes(fn, shapes)
    sizes = _check_at(at, specs)
    _enable_x64_if(_wants_x64(specs))
    check_fits(fn, target, names, specs, shapes)
    chosen = [p.strip() for p in (policies.split(";") if "names:" in policies else policies.split(",")) if p.strip()]
    auto = None
    if "auto" in chosen:
        from .choice import choose_auto
        from .vjp import wrt_positions

        chosen = [p for p in chosen if p != "auto"]
        _log_timing(at)
        auto = choose_auto(fn, *specs, wrt=wrt_positions(names, _names(wrt))[0], has_aux=has_aux, at=sizes,
                           memory_budget=memory_budget)
    costs = plan_policies(fn, *specs, wrt=_names(wrt), has_aux=has_aux, at=sizes, policies=chosen)
    if as_json:
        click.echo(json.dumps([c.to_json() for c in costs] + ([{"auto": auto.to_json()}] if auto else []), indent=2))
    else:
        click.echo(format_plan(costs, sizes) + (f"\n{auto.reason}" if auto else ""))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
