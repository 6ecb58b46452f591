"""Module probes: each module's StableHLO parsed safely into its main signature and custom calls.

A corrupt bytecode can crash (or corrupt the heap of) the MLIR parser, so a module whose
author is not vouched for is parsed in a child process first (``python -m
vjpsplit_cli.trust.mlirprobe``, with glibc's heap checks on); only a signed module from a
trusted key is parsed here. Clean results are kept in the verdict cache (``verdicts``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Mapping

from ..errors import CorruptModule, VjpsplitError, cannot_deserialize
from . import verdicts
from .verdicts import DEFAULT

_MALLOC_DEBUG = "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"
PROBE_TIMEOUT_S = 60  # parsing a real module's StableHLO takes seconds, even for large models


def probe_here(modules: Mapping[str, bytes], source: str) -> dict[str, dict[str, Any]]:
    """Probe in this process (only for modules whose author is trusted: jax would parse them here anyway).

    The MLIR parser prints its diagnostics on file descriptor 2: they are kept off
    the terminal, and a failure is one ``VjpsplitError``.
    """
    from .mlirprobe import probe

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        return {k: probe(v) for k, v in modules.items()}
    except Exception as e:
        raise VjpsplitError(
            f"{source}: a module's StableHLO is corrupt ({type(e).__name__}); the signed artifact "
            "is damaged: ask its author to export it again"
        ) from e
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _child_env() -> dict[str, str]:
    """The child's environment: this vjpsplit on its path, CPU only, glibc's heap checks on."""
    # The directory holding this vjpsplit_cli package (trust/probes.py is two levels in): this vjpsplit, not another.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu", MALLOC_CHECK_="3", MALLOC_PERTURB_="165")
    if os.path.exists(_MALLOC_DEBUG) and "libc_malloc_debug" not in env.get("LD_PRELOAD", ""):
        # glibc >= 2.34 honours MALLOC_CHECK_ only with its debug malloc loaded.
        env["LD_PRELOAD"] = ":".join(p for p in (env.get("LD_PRELOAD", ""), _MALLOC_DEBUG) if p)
    return env


def _run_child(modules: Mapping[str, bytes], source: str) -> subprocess.CompletedProcess[bytes]:
    request = json.dumps({k: bytes(v).hex() for k, v in modules.items()})
    try:
        return subprocess.run(
            [sys.executable, "-m", "vjpsplit_cli.trust.mlirprobe"],
            input=request.encode(),
            capture_output=True,
            env=_child_env(),
            timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        # A real module parses in seconds; a forged one can keep the bytecode reader spinning.
        raise VjpsplitError(
            f"{source}: parsing the artifact's modules took over {PROBE_TIMEOUT_S} s; the artifact is damaged "
            "or forged: copy or export it again"
        ) from e
    except OSError as e:
        raise VjpsplitError(
            f"{source}: could not check the artifact's modules ({type(e).__name__}: {e}); "
            "retry, or export the artifact again"
        ) from e


def probe_child(modules: Mapping[str, bytes], source: str) -> dict[str, Any]:
    """Probe in a child process: a module that crashes the parser crashes the child, not us."""
    done = _run_child(modules, source)
    if done.returncode < 0:  # the parser crashed (or glibc caught it corrupting the heap)
        raise VjpsplitError(
            f"{source}: a module's StableHLO is corrupt (the parser died of signal "
            f"{-done.returncode}); the artifact is damaged or forged: copy or export it again"
        )
    try:
        result = json.loads(done.stdout) if done.returncode == 0 else None
    except ValueError:
        result = None
    if not isinstance(result, dict):
        last = (done.stderr.decode(errors="replace").strip().splitlines() or [""])[-1][:200]
        raise VjpsplitError(
            f"{source}: could not check the artifact's modules (checker exit {done.returncode}: "
            f"{last}); check that jax imports in this Python, then retry"
        )
    for k, v in result.items():
        if isinstance(v, dict) and "error" in v:
            raise CorruptModule(
                f"{source}: the {k} module's StableHLO is corrupt ({str(v['error'])[:160]}); "
                "the artifact is damaged or forged: copy or export it again",
                k,
                unreadable=cannot_deserialize(v["error"]),
            )
    return result


def probe_modules(
    modules: Mapping[str, bytes], source: str, *, in_process: bool = False, cache_dir: str | None = DEFAULT
) -> dict[str, dict[str, Any]]:
    """Each module's main signature and custom calls (``{"main": ..., "calls": [...]}``), parsed safely.

    ``cache_dir``: where verdicts persist between processes (``DEFAULT``: the default
    location; None: nowhere). Only a directory private to this user is used.
    """
    directory = verdicts.verdict_dir(cache_dir)
    found: dict[str, dict[str, Any]] = {}
    todo: dict[str, bytes] = {}
    for k, data in modules.items():
        name = verdicts.module_verdict_name(data)
        v = verdicts.seen(name) or (verdicts.read_verdict(directory, name) if directory else None)
        if v is not None:
            verdicts.remember(name, v)
            found[k] = v
        else:
            todo[k] = data
    if todo:
        fresh = probe_here(todo, source) if in_process else probe_child(todo, source)
        for k, data in todo.items():
            if not isinstance(fresh.get(k), dict):
                raise VjpsplitError(f"{source}: could not check the {k} module (bad probe reply); retry")
            name = verdicts.module_verdict_name(data)
            verdicts.remember(name, fresh[k])
            found[k] = fresh[k]
            if directory:
                verdicts.write_verdict(directory, name, fresh[k])
    return found
