"""Turning command-line words into what ``export`` takes: ``MODULE:FN`` and ``--shapes``."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import export as jexport

from ..errors import UsageError, VjpsplitError, jax_message
from ..files import load_arrays
from ..files.shapes import new_scope, parse_array_spec, to_struct
from ..files.trees import unflatten_keys
from ..safeio.reading import open_for_read
from ..tracing.signatures import not_traceable, signature_positionals


def load_object(target: str, label: str = "FN") -> tuple[Any, str]:
    """Import ``MODULE:ATTR`` (dotted module from the cwd, or a ``.py`` path); return it and its name."""
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise UsageError(f"{target!r} is not MODULE:{label}; write e.g. samples/mlp.py:loss or mypkg.model:loss")
    if module_part.endswith(".py") or os.sep in module_part or "/" in module_part:
        path = Path(module_part)
        if not path.is_file():
            raise VjpsplitError(f"{path}: no such Python file; check the path in {target!r}")
        open_for_read(path, "Python module").close()  # unreadable: say so before importlib does
        name = f"_vjpsplit_user_{path.stem}_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise VjpsplitError(f"{path}: Python cannot load this file as a module; give a .py file")
            module = importlib.util.module_from_spec(spec)
            # Sibling imports in the user's file should work as when run as a script.
            sys.path.insert(0, str(path.resolve().parent))
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[name]
                raise VjpsplitError(f"{path}: importing it failed ({type(e).__name__}: {e}); fix the module") from e
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as e:
            raise VjpsplitError(
                f"cannot import module {module_part!r} ({e}); run from the directory that holds it, "
                "or give the path to its .py file"
            ) from e
        except Exception as e:
            raise VjpsplitError(
                f"module {module_part!r}: importing it failed ({type(e).__name__}: {e}); fix the module"
            ) from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise VjpsplitError(
                f"{module_part} has no attribute {attr!r}; check the name after ':' in {target!r}"
            ) from e
    return obj, f"{module_part}:{attr}"


def load_function(target: str) -> tuple[Callable, str]:
    """``load_object`` for ``MODULE:FN``, refusing what is not a Python function JAX can trace, saying what it is."""
    fn, name = load_object(target)
    problem = not_traceable(fn)
    if problem:
        raise VjpsplitError(
            f"{target} is {problem}; export needs a Python function that JAX can trace, taking arrays "
            "(or pytrees of arrays) and returning them, e.g. def loss(w, x): return jnp.sum(jnp.tanh(x @ w))"
        )
    return fn, name


def parameter_names(fn: Callable) -> tuple[list[str], int]:
    """Positional parameter names of ``fn`` and how many of them are required."""
    try:
        names, required, var = signature_positionals(fn)
    except (TypeError, ValueError) as e:
        raise VjpsplitError(f"cannot read the signature of {fn!r}; wrap it in a def with named parameters") from e
    if var is not None:
        raise UsageError(f"{fn.__name__} takes *{var}; --shapes needs named parameters, so wrap it in a def")
    return names, required


def resolve_shapes(fn: Callable, shapes: Sequence[str]) -> tuple[list[str], tuple]:
    """``--shapes NAME=SPEC ...`` -> argument names and one spec pytree per argument."""
    names, required = parameter_names(fn)
    given: dict[str, str] = {}
    for item in shapes:
        name, eq, spec = item.partition("=")
        name = name.strip()
        if not eq or not name or not spec.strip():
            raise UsageError(f"--shapes {item!r} is not NAME=SPEC; write e.g. x=f32[b,784]")
        if name not in names:
            raise UsageError(
                f"--shapes names {name!r}, which is not a parameter; the parameters are {', '.join(names)}"
            )
        if name in given:
            raise UsageError(f"--shapes gives {name!r} twice")
        given[name] = spec.strip()
    count = max([required] + [names.index(n) + 1 for n in given])
    missing = [n for n in names[:count] if n not in given]
    if missing:
        raise UsageError(f"missing --shapes for parameter(s) {', '.join(missing)}; give one NAME=SPEC per parameter")
    scope = new_scope()
    return names[:count], tuple(parse_spec(n, given[n], scope) for n in names[:count])


def parse_spec(name: str, text: str, scope: jexport.SymbolicScope) -> Any:
    """One ``--shapes`` value: ``DTYPE[DIMS]``, ``@MODULE:ATTR`` or an array file."""
    if text.startswith("@"):
        obj, where = load_object(text[1:], label="ATTR")
        if callable(obj) and not isinstance(obj, jax.ShapeDtypeStruct):
            try:
                obj = obj()
            except Exception as e:
                raise VjpsplitError(f"--shapes {name}=@{where}: calling it failed ({type(e).__name__}: {e})") from e
        try:
            return jax.tree_util.tree_map(to_struct, obj)
        except VjpsplitError as e:
            raise VjpsplitError(f"--shapes {name}=@{where}: {e}") from e
    if text.lower().endswith((".npz", ".msgpack")):  # as load_arrays reads them: any case
        try:  # a file that is not there (or cannot be opened) is a mistake in the command line
            open_for_read(text, "--shapes arrays", named=f"--shapes {name}={text}").close()
        except VjpsplitError as e:
            raise UsageError(*e.args) from e
        arrays, _ = load_arrays(text)
        mine = {k: v for k, v in arrays.items() if k == name or k.startswith(name + "/")}
        if mine:
            flat = {k[len(name) + 1 :]: v for k, v in mine.items()}
        else:  # a file holding just this argument's pytree, keys relative to it
            flat = dict(arrays)
        if not flat:
            raise VjpsplitError(
                f"{text}: holds no arrays for parameter {name!r}; its keys should be {name} or {name}/..."
            )
        for k, v in flat.items():
            if np.dtype(v.dtype).kind == "V":
                raise VjpsplitError(
                    f"{text}: key {k!r} has raw void dtype {v.dtype} (numpy's npz for bfloat16 & co.); "
                    "write the file with vjpsplit, or give the spec as DTYPE[DIMS]"
                )
        return jax.tree_util.tree_map(to_struct, unflatten_keys(flat))
    try:
        return parse_array_spec(text, scope)
    except VjpsplitError as e:
        raise UsageError(f"--shapes {name}={text}: {e}") from e


_INT_RE = re.compile(r"(?<![\w.])\d+(?![\w.])")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_fits(fn: Callable, target: str, names: Sequence[str], specs: tuple, shapes: Sequence[str]) -> None:
    """Trace ``fn`` on ``specs`` (no compute); a failure names the ``--shapes`` entries it involves.

    Which entries: those with a dim (a size above 1, else a symbolic name) that the
    error message mentions; all of them when none does.
    """
    try:
        jax.eval_shape(fn, *specs)
    except VjpsplitError:
        raise
    except Exception as e:
        message = jax_message(e)
        entries = {str(s).partition("=")[0].strip(): str(s).strip() for s in shapes}
        ints = {int(n) for n in _INT_RE.findall(message)} - {0, 1}
        words = set(_NAME_RE.findall(message))
        dims = {
            n: [d for leaf in jax.tree_util.tree_leaves(s) for d in getattr(leaf, "shape", ())]
            for n, s in zip(names, specs)
        }
        involved = [n for n in names if ints & {int(d) for d in dims[n] if isinstance(d, (int, np.integer))}]
        if not involved:
            involved = [n for n in names if words & {str(d) for d in dims[n] if not isinstance(d, (int, np.integer))}]
        listed = " and ".join(entries.get(n, n) for n in involved)
        if involved:
            raise VjpsplitError(
                f"{target}: the --shapes {listed} do not fit the function ({message}); fix those --shapes entries"
            ) from e
        raise VjpsplitError(
            f"{target}: the --shapes do not fit the function ({message}); check every --shapes "
            "entry against the function's parameters, or rerun with --debug for the traceback"
        ) from e
