"""``export --stages`` and ``inspect DIR``: the command line's side of stages from one function."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Sequence

import click

from ..errors import VjpsplitError
from .app import check_at, log, name_list
from .runtime import enable_x64_if, wants_x64

if TYPE_CHECKING:  # cryptography is imported only by a command that signs
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


def export_stages_cmd(
    target: str,
    shapes: Sequence[str],
    wrt: str | None,
    platforms: str,
    policy: str | None,
    weights: bool,
    output: str,
    key: Ed25519PrivateKey | None,
    count: int | None,
    data_parallel: int = 1,
    has_aux: bool = False,
) -> None:
    """Trace MODULE:FN once, cut it at its marks (or into ``count`` balanced stages) and save the directory
    (``data_parallel``: the replicas of every stage its index records; ``has_aux``: FN returns ``(loss, aux)``,
    and the last stage's artifact gives the aux)."""
    from .specs import check_fits, load_object, resolve_shapes
    from ..pipeline.stages.exporting import export_stages

    fn, name = load_object(target)
    if not callable(fn):
        raise VjpsplitError(f"{target} is not callable; point MODULE:FN at a function")
    names, specs = resolve_shapes(fn, shapes)
    check_at((), specs)
    enable_x64_if(wants_x64(specs))
    check_fits(fn, target, names, specs, shapes)
    wrt_names = name_list(wrt)
    if wrt_names is None or len(wrt_names) != 1:
        raise click.UsageError("--stages needs --wrt NAME: the one parameter argument (the rest are batch inputs)")
    stages = export_stages(
        fn,
        *specs,
        wrt=wrt_names[0],
        platforms=platforms,
        policy=policy,
        weights=weights,
        stages=count,
        name=name,
        data_parallel=data_parallel,
        has_aux=has_aux,
    )
    stages.save(output, sign_key=key)
    signed = f", signed by {stages.artifacts[0].signer}" if key is not None else ""
    dp = f", data_parallel {data_parallel}" if data_parallel > 1 else ""
    aux = ", the last stage returns aux" if has_aux else ""
    log(f"wrote {output}: {name}, {len(stages)} stages ({stages.index.cut}), platforms {platforms}{dp}{aux}{signed}")


def inspect_stages_cmd(
    directory: str, as_json: bool, at: Sequence[str], trust_keys: Sequence[str], allow_kernels: bool
) -> None:
    """Print a stages directory's table (or JSON): one row per stage."""
    from ..files.sizes import parse_at
    from ..pipeline.stages.directory import load_stages
    from ..pipeline.stages.report import format_stages, stage_rows

    stages = load_stages(directory, trust=list(trust_keys) or None, allow_kernels=allow_kernels)
    sizes = parse_at(at)
    if as_json:
        rows = stage_rows(stages, sizes)
        costs = [r["cost"] for r in rows]
        imbalance = max(costs) / (sum(costs) / len(costs))
        top = {"function": stages.index.function, "data_parallel": stages.index.data_parallel}
        click.echo(json.dumps({**top, "stages": rows, "imbalance": imbalance}, indent=2))
    else:
        click.echo(format_stages(stages, sizes))
