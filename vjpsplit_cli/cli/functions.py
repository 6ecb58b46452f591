"""Commands on the user's function: ``export`` and ``plan``."""

from __future__ import annotations

import json
import os
import warnings
from typing import Sequence

import click

from ..safeio.outputs import StagedOutputs
from .app import (
    ARRAY_SUFFIXES,
    ARTIFACT_OUT,
    EXISTING,
    at_option,
    check_at,
    cli_command,
    function_options,
    log,
    main,
    name_list,
    plural_count,
)
from .runtime import enable_x64_if, wants_x64


@main.command(
    "export",
    short_help="Export FN's forward and backward into one artifact.",
    epilog="\b\nExamples:\n  vjpsplit export samples/mlp.py:loss --shapes params=@samples/mlp.py:param_shapes \\\n      --shapes 'x=f32[b,784]' --shapes 'labels=i32[b]' -o mlp.vjps\n  vjpsplit export model.py:stage --shapes w=weights.npz --shapes 'x=bf16[b,512]' \\\n      --policy dots --platforms cpu,cuda -o stage.vjps",
)
@function_options
@click.option("--platforms", default="cpu,cuda,tpu", show_default=True, help="Comma-separated platforms to lower for.")
@click.option(
    "--policy",
    default="everything",
    show_default=True,
    help="What the forward keeps: everything, dots, nothing, names:a,b, or auto (the fastest fwd+bwd "
    "measured here at the --at sizes, within --memory-budget if given).",
)
@click.option(
    "--memory-budget",
    default=None,
    metavar="BYTES",
    help="Pick the policy that recomputes least among those whose stored residuals fit (e.g. 64MiB).",
)
@at_option("Sizes for symbolic dims when weighing residuals against --memory-budget (e.g. b=256).")
@click.option(
    "--weights",
    default=None,
    metavar="NAMES",
    help="Comma-separated weight parameters: adds the zero-bubble split backward (run-bwd --part).",
)
@click.option("-o", "--output", required=True, type=ARTIFACT_OUT, help="Artifact file to write.")
@click.option(
    "--sign-key",
    "sign_key",
    type=EXISTING,
    default=None,
    metavar="KEY",
    help="Sign the artifact with this Ed25519 private key (from `vjpsplit keygen`).",
)
@click.option(
    "--stages",
    "as_stages",
    is_flag=True,
    help="Cut FN at its stage_boundary marks into pipeline stages: -o is a directory (one artifact and one "
    "evaluation program per stage, and stages.json), every stage with the zero-bubble split backward; with "
    "--has-aux, FN returns (loss, aux) and the last stage gives the aux.",
)
@click.option(
    "--stage-count",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="With --stages, for FN without marks: cut it into N stages of balanced estimated cost.",
)
@click.option(
    "--data-parallel",
    "data_parallel",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="With --stages: record N replicas of every stage in stages.json, the Trainer's data_parallel when it "
    "is not given (the batch shapes are then one replica's part of a microbatch).",
)
@cli_command
def export_cmd(
    target: str,
    shapes: tuple[str, ...],
    wrt: str | None,
    has_aux: bool,
    platforms: str,
    policy: str,
    memory_budget: str | None,
    at: tuple[str, ...],
    weights: str | None,
    output: str,
    sign_key: str | None,
    as_stages: bool,
    stage_count: int | None,
    data_parallel: int | None,
) -> None:
    """Export FN's forward and backward into one portable artifact (or, with --stages, one per stage)."""
    from ..artifact.lowering import export
    from ..files.sizes import parse_at
    from ..tracing.policies import PolicyFallbackWarning
    from ..trust.signing import load_private_key
    from .specs import check_fits, load_function, resolve_shapes

    key = load_private_key(sign_key) if sign_key else None  # a bad key fails before any tracing
    if as_stages or stage_count is not None:
        from .stagecmds import export_stages_cmd

        if memory_budget is not None or weights is not None or at:
            raise click.UsageError("--stages takes none of --memory-budget, --weights, --at")
        pol = None if policy == "everything" else policy
        export_stages_cmd(
            target, shapes, wrt, platforms, pol, True, output, key, stage_count, data_parallel or 1, has_aux
        )
        return
    if data_parallel is not None:
        raise click.UsageError("--data-parallel records replicas of pipeline stages: give it with --stages")

    source = click.get_current_context().get_parameter_source("policy")
    if memory_budget is not None and source != click.core.ParameterSource.DEFAULT and policy != "auto":
        raise click.UsageError("give either --policy or --memory-budget (or both with --policy auto), not both")

    with StagedOutputs({"-o": output}, {"MODULE:FN": _module_files(target), "--shapes": _shape_files(shapes)}) as out:
        fn, name = load_function(target)
        names, specs = resolve_shapes(fn, shapes)
        check_at(at, specs)
        enable_x64_if(wants_x64(specs))
        check_fits(fn, target, names, specs, shapes)
        if policy == "auto":
            _log_timing(at)
        with warnings.catch_warnings():  # a policy that falls back is said once, in the log lines below
            warnings.simplefilter("ignore", PolicyFallbackWarning)
            art = export(
                fn,
                *specs,
                wrt=name_list(wrt),
                has_aux=has_aux,
                platforms=platforms,
                policy=None if memory_budget is not None and policy != "auto" else policy,
                arg_names=names,
                name=name,
                memory_budget=memory_budget,
                at=parse_at(at),
                weights=name_list(weights),
            )
        if key is not None:
            art.sign(key)
        out.write("-o", art.save)
    m = art.manifest
    if art.policy_choice.reason:  # auto's measurements, or the budget's pick
        log(art.policy_choice.reason)
    backed = sum(r.input_backed for r in m.residuals)
    log(
        f"wrote {output}: {m.function}, {plural_count(len(m.inputs), 'input')}, "
        f"{plural_count(len(m.residuals) - backed, 'stored residual')} and {backed} input-backed, "
        f"platforms {','.join(m.platforms)}" + (f", signed by {art.signer}" if art.signer else "")
    )


def _log_timing(at: Sequence[str]) -> None:
    """Policy auto compiles and times every candidate: seconds each, so say so before the wait."""
    sizes = f" at {', '.join(at)}" if at else ""
    log(f"policy auto: compiling and timing fwd+bwd of each policy{sizes} (about a second each)...")


def _module_files(target: str) -> list[str]:
    """The source files that ``MODULE:FN`` (or ``@MODULE:ATTR``) can name, found without importing anything."""
    module = target.rpartition(":")[0]
    if module.endswith(".py") or "/" in module or os.sep in module:
        return [module]
    base = os.path.join(*module.split(".")) if module else ""
    return [base + ".py", os.path.join(base, "__init__.py")] if base else []


def _shape_files(shapes: Sequence[str]) -> list[str]:
    """The files that --shapes values read: array files and @MODULE:ATTR sources."""
    files = []
    for item in shapes:
        spec = str(item).partition("=")[2].strip()
        if spec.startswith("@"):
            files += _module_files(spec[1:])
        elif spec.lower().endswith(ARRAY_SUFFIXES):
            files.append(spec)
    return files


@main.command(
    "plan",
    short_help="Compare policies before exporting.",
    epilog="\b\nExamples:\n  vjpsplit plan samples/mlp.py:loss --shapes params=@samples/mlp.py:param_shapes \\\n      --shapes 'x=f32[b,784]' --shapes 'labels=i32[b]' --at b=256",
)
@function_options
@at_option("Sizes for symbolic dims (b=256): bytes and FLOPs.")
@click.option(
    "--policies",
    default="everything,dots,nothing",
    show_default=True,
    help="Comma-separated policies to compare (names:a,b allowed; separate several with ';'); "
    "add auto to time them here and show which auto picks and why (needs --at for symbolic dims).",
)
@click.option("--memory-budget", default=None, metavar="BYTES", help="With auto: only policies whose residuals fit.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
@cli_command
def plan_cmd(
    target: str,
    shapes: tuple[str, ...],
    wrt: str | None,
    has_aux: bool,
    at: tuple[str, ...],
    policies: str,
    memory_budget: str | None,
    as_json: bool,
) -> None:
    """Compare policies before exporting: stored residual bytes and backward recompute per policy."""
    from ..artifact.report import format_plan
    from ..tracing.policies import plan_policies
    from .specs import check_fits, load_function, resolve_shapes

    fn, _ = load_function(target)
    names, specs = resolve_shapes(fn, shapes)
    sizes = check_at(at, specs)
    enable_x64_if(wants_x64(specs))
    check_fits(fn, target, names, specs, shapes)
    chosen = [p.strip() for p in (policies.split(";") if "names:" in policies else policies.split(",")) if p.strip()]
    auto = None
    if "auto" in chosen:
        from ..tracing.choice import choose_auto
        from ..tracing.signatures import wrt_positions

        chosen = [p for p in chosen if p != "auto"]
        _log_timing(at)
        auto = choose_auto(
            fn,
            *specs,
            wrt=wrt_positions(names, name_list(wrt))[0],
            has_aux=has_aux,
            at=sizes,
            memory_budget=memory_budget,
        )
    costs = plan_policies(fn, *specs, wrt=name_list(wrt), has_aux=has_aux, at=sizes, policies=chosen)
    if as_json:
        click.echo(json.dumps([c.to_json() for c in costs] + ([{"auto": auto.to_json()}] if auto else []), indent=2))
    else:
        click.echo(format_plan(costs, sizes) + (f"\n{auto.reason}" if auto else ""))
