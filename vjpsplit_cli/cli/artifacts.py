"""Commands about artifacts and keys: ``inspect``, ``template`` and ``keygen``."""

from __future__ import annotations

import json

import click

from ..safeio.outputs import StagedOutputs
from .app import ARRAY_OUT, ARTIFACT_OUT, EXISTING, at_option, cli_command, log, main, plural_count, trust_options
from .runtime import load_artifact


@main.command(
    "keygen",
    short_help="Make an Ed25519 key pair for signing artifacts.",
    epilog="\b\nExamples:\n  vjpsplit keygen -o ~/.vjpsplit/key\n  vjpsplit export ... --sign-key ~/.vjpsplit/key -o stage.vjps\n  vjpsplit run-fwd stage.vjps --trust-key key.pub --inputs in.npz --residuals res.npz",
)
@click.option(
    "-o",
    "--output",
    required=True,
    type=ARTIFACT_OUT,
    metavar="KEY",
    help="Private key file to write (mode 0600); the public key goes to KEY.pub.",
)
@cli_command
def keygen_cmd(output: str) -> None:
    """Make an Ed25519 key pair for signing artifacts: KEY (private) and KEY.pub (give this one out)."""
    from ..trust.signing import generate_key

    kid = generate_key(output)
    log(f"wrote {output} (private, keep it secret) and {output}.pub (public: --trust-key); key {kid}")


@main.command(
    "inspect",
    short_help="Describe an artifact: keys, dtypes, shapes, bytes.",
    epilog="\b\nExamples:\n  vjpsplit inspect mlp.vjps\n  vjpsplit inspect mlp.vjps --at b=256 --json",
)
@click.argument("artifact", type=EXISTING)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@at_option("Size symbolic dims in the byte totals (b=256).")
@trust_options
@cli_command
def inspect_cmd(
    artifact: str, as_json: bool, at: tuple[str, ...], trust_keys: tuple[str, ...], allow_kernels: bool
) -> None:
    """Describe an artifact: keys, dtypes, shapes, residual bytes, platforms, versions (a stages directory: per stage)."""
    import os

    from ..files.sizes import check_at_names, parse_at

    if os.path.isdir(artifact):
        from .stagecmds import inspect_stages_cmd

        inspect_stages_cmd(artifact, as_json, at, trust_keys, allow_kernels)
        return
    from ..artifact.report import describe, format_table

    art = load_artifact(artifact, trust_keys, allow_kernels, x64=False)
    sizes = parse_at(at)
    check_at_names(sizes, art.manifest.dim_vars, artifact)
    if as_json:
        click.echo(json.dumps(describe(art, sizes), indent=2))
    else:
        click.echo(format_table(art, sizes))


@main.command(
    "template",
    short_help="Write an inputs or cotangents file for an artifact.",
    epilog="\b\nExamples:\n  vjpsplit template mlp.vjps -o inputs.npz --at b=32 --fill normal\n  vjpsplit template mlp.vjps -o ct.npz --what cotangents --at b=32 --fill ones",
)
@click.argument("artifact", type=EXISTING)
@click.option(
    "-o", "--output", required=True, type=ARRAY_OUT, metavar="FILE", help="Array file to write (.npz or .msgpack)."
)
@at_option("Sizes for the artifact's symbolic dims (b=4); every one the keys need.")
@click.option(
    "--what",
    type=click.Choice(["inputs", "cotangents"]),
    default="inputs",
    show_default=True,
    help="Which file: the inputs of run-fwd, or the cotangents of run-bwd.",
)
@click.option(
    "--fill",
    type=click.Choice(["zeros", "ones", "normal"]),
    default="zeros",
    show_default=True,
    help="Values: zeros, ones, or normal (standard normal floats, integers 0..7, random bools and keys).",
)
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    metavar="N",
    help="Random seed for --fill normal.",
)
@trust_options
@cli_command
def template_cmd(
    artifact: str,
    output: str,
    at: tuple[str, ...],
    what: str,
    fill: str,
    seed: int,
    trust_keys: tuple[str, ...],
    allow_kernels: bool,
) -> None:
    """Write an inputs or cotangents file with exactly the keys, dtypes and shapes ARTIFACT expects."""
    from ..artifact.templates import template
    from ..files import save_arrays

    with StagedOutputs({"-o": output}, {"ARTIFACT": artifact}) as out:
        art = load_artifact(artifact, trust_keys, allow_kernels, x64=False)
        arrays = template(art, what=what, at=at, fill=fill, seed=seed)
        meta = {"kind": f"vjpsplit-{what}", "fingerprint": art.manifest.fingerprint}
        out.write("-o", lambda tmp: save_arrays(tmp, arrays, meta))
    sizes = ", ".join(a for a in at)
    log(
        f"wrote {output}: {plural_count(len(arrays), 'array')} for the {what} of {artifact}"
        + (f" at {sizes}" if sizes else "")
        + f", filled with {fill}"
    )
