"""The command group and what every command shares: one-line errors, global options, parameter types, caches.

Every failure the user can fix is one line ``error: …`` on stderr and exit 1
(usage mistakes: exit 2); tracebacks only with ``--debug``. Every command checks
its outputs before any work and replaces them all or none (``outputs.StagedOutputs``).
The commands live beside this module, one module per concern (functions, runs,
artifacts); names here without an underscore are what they share.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
from typing import IO, Any, Callable, Iterator, Mapping, Sequence, TypeVar

import click

from .. import config
from ..errors import VjpsplitError, one_line
from ..safeio.outputs import UsageError
from ..safeio.reading import os_error_message
from ..safeio.signals import Interrupted, outputs_committed
from ..terminal import printable

EXISTING = click.Path(dir_okay=True, path_type=str)  # existence is checked by our loaders, with our message
EXISTING.name = "file"  # shown as FILE in --help, as the files commands write are
ARRAY_SUFFIXES = (".npz", ".msgpack")
_F = TypeVar("_F", bound=Callable[..., Any])  # a command's callback, as click's decorators take and return it
_R = TypeVar("_R")


class CliError(click.ClickException):
    """Printed as ``error: <message>`` (docs/contract.md's form), exit 1; control characters escaped."""

    exit_code = 1

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {printable(self.format_message())}", err=True)


def log(msg: str) -> None:
    click.echo(printable(msg), err=True)


def plural_count(n: int, noun: str, plural: str | None = None) -> str:
    """``1 gradient``, ``3 gradients``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


class _OutputFile(click.ParamType):
    """A file a command writes: how it is spelled is checked here (exit 2); what is on disk, by StagedOutputs."""

    name = "FILE"

    def __init__(self, arrays: bool) -> None:
        self.arrays = arrays

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = os.fspath(value)
        if text == "-":
            self.fail("'-' (standard output) is not supported; give a file name", param, ctx)
        if not text:
            self.fail("the file name is empty; give a file name", param, ctx)
        if text.endswith(("/", os.sep)):
            self.fail(f"{printable(text)} ends with '/', so it names a directory; give a file name", param, ctx)
        if self.arrays and os.path.splitext(text)[1].lower() not in ARRAY_SUFFIXES:
            ext = os.path.splitext(text)[1]
            what = f"extension {printable(ext)!r}" if ext else "no extension"
            self.fail(
                f"{printable(text)}: unknown array file format ({what}); use a .npz or .msgpack file name", param, ctx
            )
        return text


ARRAY_OUT = _OutputFile(arrays=True)
ARTIFACT_OUT = _OutputFile(arrays=False)


class ShapeSpec(click.ParamType):
    """``NAME=SPEC`` for --shapes; a ``DTYPE[DIMS]`` spec is parsed here, so bad dims exit 2."""

    name = "NAME=SPEC"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        name, eq, spec = str(value).partition("=")
        if not eq or not name.strip() or not spec.strip():
            self.fail(f"{printable(value)!r} is not NAME=SPEC; write e.g. x=f32[b,784]", param, ctx)
        spec = spec.strip()
        if not spec.startswith("@") and not spec.lower().endswith(ARRAY_SUFFIXES):
            from ..files.shapes import new_scope, parse_array_spec

            try:
                parse_array_spec(spec, new_scope())
            except VjpsplitError as e:
                self.fail(printable(f"{name.strip()}={spec}: {e}"), param, ctx)
        return str(value)


class AtSizes(click.ParamType):
    """``NAME=SIZE[,NAME=SIZE]`` for --at; sizes are ASCII integers from 1 to 2**40."""

    name = "NAME=SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from ..files.sizes import parse_at

        try:
            parse_at([str(value)], option="")
        except VjpsplitError as e:
            self.fail(printable(str(e)), param, ctx)
        return str(value)


def at_option(help: str) -> Callable[[_F], _F]:
    """``--at NAME=SIZE`` (repeatable, or comma-separated): sizes for symbolic dims; ``help`` says what for."""
    return click.option("--at", "at", multiple=True, type=AtSizes(), metavar="NAME=SIZE", help=help)


# Options of the whole tool, accepted before or after the subcommand (``vjpsplit --debug run-fwd …``
# or ``vjpsplit run-fwd … --debug``): the group and every command declare them.
_GLOBAL_OPTIONS = (
    click.option("--debug", is_flag=True, help="Show full tracebacks on errors (also VJPSPLIT_DEBUG=1)."),
    click.option(
        "--no-cache", is_flag=True, help="Do not use the persistent compilation cache (see VJPSPLIT_CACHE_DIR)."
    ),
)


def _global_options(fn: _F) -> _F:
    for option in reversed(_GLOBAL_OPTIONS):
        fn = option(fn)
    return fn


def global_flag(ctx: click.Context, name: str) -> bool:
    """A global flag, given before the subcommand (the group's) or after it (the command's)."""
    return bool(ctx.find_root().params.get(name)) or bool(ctx.params.get(name))


def debug_enabled(ctx: click.Context) -> bool:
    return global_flag(ctx, "debug") or config.debug()


def cli_command(fn: Callable[..., _R]) -> Callable[..., _R]:
    """Wrap a command body: library errors become one-line errors, others too unless --debug."""

    @_global_options
    @functools.wraps(fn)
    def wrapper(*args: Any, debug: bool = False, no_cache: bool = False, **kwargs: Any) -> _R:
        ctx = click.get_current_context()
        try:
            show = debug or debug_enabled(ctx)
        except VjpsplitError as e:  # VJPSPLIT_DEBUG set to a value that is neither on nor off
            raise click.UsageError(printable(e)) from e
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
                log(f"error: {ctx.info_name}: interrupted just after writing its outputs, which are complete")
            else:
                log(f"error: {ctx.info_name}: interrupted; every previous output is left as it was")
            raise click.exceptions.Exit(128 + getattr(e, "signum", 2)) from e
        except MemoryError as e:
            if show:
                traceback.print_exc()
            raise CliError(
                f"{_subject(kwargs)}: out of memory while running {ctx.info_name}; "
                "use smaller inputs or a machine with more memory"
            ) from e
        except OSError as e:
            if show:
                traceback.print_exc()
            raise CliError(os_error_message(e.filename or _subject(kwargs), e, f"running {ctx.info_name}")) from e
        except Exception as e:  # user code or a bug: still one line, unless asked
            if show:
                traceback.print_exc()
            raise CliError(_unexpected(ctx.info_name or "vjpsplit", kwargs, e)) from e

    return wrapper


def _subject(kwargs: Mapping[str, Any]) -> str:
    """What a command works on, for messages that have no file of their own: the artifact, or MODULE:FN."""
    return str(kwargs.get("artifact") or kwargs.get("target") or "vjpsplit")


def _unexpected(command: str, kwargs: Mapping[str, Any], e: Exception) -> str:
    """One line for an exception nothing mapped: name the artifact or function and say what to try."""
    what = f"{type(e).__name__} {one_line(e, 160)}".strip()
    if isinstance(e, ImportError):  # user modules are imported by specs.load_object, which says so itself
        return (
            f"{_subject(kwargs)}: {command} could not load a part of vjpsplit or of JAX ({what}); "
            "reinstall vjpsplit and its dependencies, or rerun with --debug for the traceback"
        )
    if kwargs.get("artifact"):
        return (
            f"{kwargs['artifact']}: {command} failed on this artifact ({what}); it may be damaged or "
            "hand-edited: re-export it, or rerun with --debug for the traceback"
        )
    return (
        f"{_subject(kwargs)}: {command} failed ({what}); check the function and its --shapes, "
        "or rerun with --debug for the traceback"
    )


class _OneLineUsageError(click.UsageError):
    """A usage error printed as one line, ``error: <message> (see '<command> --help')``; exit 2."""

    def show(self, file: IO[Any] | None = None) -> None:
        hint = f" (see '{self.ctx.command_path} --help')" if self.ctx is not None else ""
        click.echo(f"error: {printable(self.format_message())}{hint}", err=True)


@contextlib.contextmanager
def _one_line_usage_errors() -> Iterator[None]:
    """Turn click's usage errors (usage text, hint, message: several lines) into one line."""
    try:
        yield
    except click.UsageError as e:
        if isinstance(e, (_OneLineUsageError, getattr(click.exceptions, "NoArgsIsHelpError", ()))):
            raise  # bare 'vjpsplit' prints the help, as click does
        raise _OneLineUsageError(e.format_message(), e.ctx) from e


class _Main(click.Group):
    """The ``vjpsplit`` group: usage errors of the group and of every command are one line."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        with _one_line_usage_errors():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        with _one_line_usage_errors():
            return super().invoke(ctx)


@click.group(
    cls=_Main,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="\b\nExample (the sample MLP, from a clone of the repository):\n"
    "  vjpsplit export samples/mlp.py:loss --shapes params=@samples/mlp.py:param_shapes \\\n"
    "      --shapes 'x=f32[b,784]' --shapes 'labels=i32[b]' -o mlp.vjps\n"
    "  vjpsplit template mlp.vjps -o inputs.npz --at b=32 --fill normal\n"
    "  vjpsplit run-fwd mlp.vjps --inputs inputs.npz --residuals res.npz\n"
    "  vjpsplit run-bwd mlp.vjps --residuals res.npz --inputs inputs.npz --grads grads.npz\n"
    "Global options (--debug, --no-cache) go before or after the command.",
)
@click.version_option(package_name="vjpsplit", message="vjpsplit %(version)s")
@_global_options
def main(debug: bool, no_cache: bool) -> None:
    """Run a JAX function's forward now and its backward later, from exported artifacts."""


def name_list(text: str | None) -> list[str] | None:
    """``"a, b"`` -> ``["a", "b"]``; None stays None (the option was not given)."""
    return None if text is None else [w.strip() for w in text.split(",") if w.strip()]


def function_options(fn: _F) -> _F:
    """The options that say which function to trace and how: shared by export and plan."""
    for option in reversed(
        [
            click.argument("target", metavar="MODULE:FN"),
            click.option(
                "--shapes",
                "shapes",
                multiple=True,
                required=True,
                type=ShapeSpec(),
                metavar="NAME=SPEC",
                help="One per positional parameter: NAME=f32[b,784], NAME=@module:attr, or NAME=file.npz.",
            ),
            click.option(
                "--wrt",
                default=None,
                metavar="NAMES",
                help="Comma-separated parameters to differentiate (default: all).",
            ),
            click.option("--has-aux", is_flag=True, help="FN returns (out, aux); only out is differentiated."),
        ]
    ):
        fn = option(fn)
    return fn


def trust_options(fn: _F) -> _F:
    """--trust-key and --allow-kernels: for every command that loads an artifact."""
    fn = click.option(
        "--allow-kernels",
        is_flag=True,
        help="Trust this artifact's kernel custom calls (LAPACK & co.) without a signature.",
    )(fn)
    return click.option(
        "--trust-key",
        "trust_keys",
        multiple=True,
        type=EXISTING,
        metavar="KEY.pub",
        help="Refuse the artifact unless signed by this public key (repeatable; also "
        "VJPSPLIT_TRUST_KEYS, paths separated by the OS path separator).",
    )(fn)


def check_at(at: Sequence[str], specs: Sequence[Any]) -> dict[str, int]:
    """--at sizes for the traced function: a name that is no symbolic dim of the --shapes is a usage error."""
    from ..files.sizes import check_at_names, parse_at
    from ..tracing.specs import symbolic_dim_names

    sizes = parse_at(at)
    check_at_names(sizes, symbolic_dim_names(specs), "the --shapes")
    return sizes
