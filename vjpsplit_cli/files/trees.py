"""Pytrees as flat ``/``-joined file keys, and their structure as plain JSON.

Files and manifests never hold Python objects, so an artifact can rebuild its
outputs and gradients without the user's code. A leaf's file key is its
argument name followed by its ``jax.tree_util`` key path (dict key, sequence
index, attribute name, flattened index), one segment each; inside a segment
``%`` is written ``%25`` and ``/`` is written ``%2F``, so every dict key
round-trips (haiku's ``mlp/~/linear_0`` is the segment ``mlp%2F~%2Flinear_0``).

The JSON structure keeps dicts (with ``str`` or ``int`` keys), lists, tuples and
``None`` exactly. Any other node (a NamedTuple, a dataclass, a flax struct, an
equinox Module, ``nnx.State``) is recorded as a ``node`` with its type's name and
its children's key segments; without the user's classes it comes back as a dict
keyed by those segments.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, PyTreeDef, SequenceKey

from ..errors import VjpsplitError
from .prng import from_data, impl_name, is_key, to_data

# One argument: (name, treedef, file key of each leaf in the treedef's leaf order).
ArgTree = tuple[str, PyTreeDef, tuple[str, ...]]
ArgTrees = Sequence[ArgTree]


def escape_segment(name: str) -> str:
    """One key segment as written in files: ``%`` -> ``%25``, ``/`` -> ``%2F``."""
    return name.replace("%", "%25").replace("/", "%2F")


def unescape_segment(segment: str) -> str:
    """The inverse of ``escape_segment``; other ``%`` sequences are kept as they are."""
    out: list[str] = []
    i = 0
    while i < len(segment):
        if segment.startswith("%2F", i) or segment.startswith("%2f", i):
            out.append("/")
            i += 3
        elif segment.startswith("%25", i):
            out.append("%")
            i += 3
        else:
            out.append(segment[i])
            i += 1
    return "".join(out)


def split_key(key: str) -> list[str]:
    """A file key's segments, unescaped: ``'p/mlp%2F~%2Flinear_0/w'`` -> ``['p', 'mlp/~/linear_0', 'w']``."""
    return [unescape_segment(s) for s in key.split("/")]


def _dict_key(key: object, where: str) -> str | int:
    """A dict key the manifest can record (``str`` or ``int``), else a clear error naming it."""
    if isinstance(key, str):
        if not key:
            raise VjpsplitError(f"{where}: an empty dict key cannot be a file key segment; rename it")
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return int(key)
    if hasattr(key, "__index__") and not isinstance(key, bool) and type(key).__module__ == "numpy":
        return int(key)
    raise VjpsplitError(
        f"{where}: dict key {key!r} of type {type(key).__name__} cannot be written to a file; use str or int dict keys"
    )


def entry_name(entry: object, where: str = "pytree") -> str:
    """The unescaped name of one key-path entry (dict key, index, attribute or flattened index)."""
    if isinstance(entry, DictKey):
        return str(_dict_key(entry.key, where))
    if isinstance(entry, SequenceKey):
        return str(entry.idx)
    if isinstance(entry, GetAttrKey):
        return entry.name
    if isinstance(entry, FlattenedIndexKey):
        return str(entry.key)
    name = str(entry)  # a key type newer than this code: its str is the best name we have
    if not name:
        raise VjpsplitError(f"{where}: a pytree key path entry {entry!r} has no name; it cannot be a file key")
    return name


def join_key(prefix: str, path: Sequence[object], where: str | None = None) -> str:
    """The file key of a leaf: ``prefix`` then each path entry, escaped and joined by ``/``."""
    where = where or (prefix or "pytree")
    segments = [escape_segment(entry_name(e, where)) for e in path]
    return "/".join([prefix, *segments]) if prefix else "/".join(segments)


def flatten_with_keys(prefix: str, tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[str, Any]]:
    """``[(key, leaf), ...]`` in JAX's leaf order, keys like ``params/layers/0/w``.

    Two leaves whose keys would collide (``{1: a, "1": b}``) are refused, naming the key.
    """
    try:
        leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    except (TypeError, ValueError) as e:
        # e.g. a dict mixing int and str keys, which jax cannot sort
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise VjpsplitError(
            f"{prefix or 'the pytree'}: jax cannot flatten it ({reason}); "
            "use dict keys of one sortable type (all str or all int)"
        ) from e
    out = [(join_key(prefix, path, prefix or None), leaf) for path, leaf in leaves]
    if len({k for k, _ in out}) != len(out):
        seen: set[str] = set()
        for k, _ in out:
            if k in seen:
                raise VjpsplitError(
                    f"two leaves of {prefix or 'the pytree'} would both be written as key '{k}' "
                    "(e.g. dict keys 1 and '1'); rename one"
                )
            seen.add(k)
    return out


def _type_name(tree: object) -> str:
    t = type(tree)
    return f"{t.__module__}.{t.__qualname__}"


def encode_structure(tree: Any, where: str = "pytree") -> Any:
    """The structure of ``tree`` as JSON.

    ``"*"`` a leaf, ``None``, ``{"dict": [[key, child], ...]}`` (key a str or int),
    ``{"list"|"tuple": [child, ...]}``, or ``{"node": [[segment, child], ...],
    "type": "module.Class"}`` for any other pytree node. Children are in JAX's
    leaf order, so leaves line up with ``tree_leaves``.
    """
    if tree is None:
        return None
    children, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda n: n is not tree)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1 and not children[0][0]:  # type: ignore[attr-defined]
        return "*"  # a leaf: the only "child" is the tree itself, with an empty path
    if type(tree) is dict:
        return {"dict": [[_dict_key(p[0].key, where), encode_structure(c, where)] for p, c in children]}
    if type(tree) in (list, tuple):
        return {type(tree).__name__: [encode_structure(c, where) for _, c in children]}
    if not children:
        # A node with no children (an empty NamedTuple, a module without arrays) has no leaves to place.
        return {"node": [], "type": _type_name(tree)}
    items: list[list[Any]] = []
    for p, c in children:
        if len(p) != 1:
            raise VjpsplitError(f"{where}: pytree node {_type_name(tree)} has a multi-entry child path {p!r}")
        items.append([entry_name(p[0], where), encode_structure(c, where)])
    return {"node": items, "type": _type_name(tree)}


def decode_structure(node: Any, leaves: Iterator[Any]) -> Any:
    """Rebuild a pytree from ``encode_structure``'s JSON, taking leaves in order from ``leaves``.

    ``node`` entries (user classes) come back as dicts keyed by their segments.
    """
    if node is None:
        return None
    if node == "*":
        return next(leaves)
    if isinstance(node, dict):
        if "dict" in node and len(node) == 1:
            return {k: decode_structure(c, leaves) for k, c in node["dict"]}
        if "list" in node and len(node) == 1:
            return [decode_structure(c, leaves) for c in node["list"]]
        if "tuple" in node and len(node) == 1:
            return tuple(decode_structure(c, leaves) for c in node["tuple"])
        if "node" in node and set(node) <= {"node", "type"}:
            return {str(k): decode_structure(c, leaves) for k, c in node["node"]}
    raise VjpsplitError(f"malformed pytree structure {node!r} in the artifact manifest; re-export the artifact")


def structure_keys(prefix: str, node: Any) -> list[str]:
    """The file keys of the leaves of an encoded structure, in leaf order."""
    out: list[str] = []

    def walk(n: Any, path: list[str]) -> None:
        if n is None:
            return
        if n == "*":
            out.append("/".join(path))
            return
        if not isinstance(n, dict):
            raise VjpsplitError(f"malformed pytree structure {n!r} in the artifact manifest; re-export the artifact")
        if "dict" in n or "node" in n:
            for k, c in n["dict"] if "dict" in n else n["node"]:
                walk(c, path + [escape_segment(str(k))])
        else:
            for i, c in enumerate(n["list"] if "list" in n else n.get("tuple", [])):
                walk(c, path + [str(i)])

    walk(node, [prefix] if prefix else [])
    return out


def unflatten_keys(flat: dict[str, Any]) -> Any:
    """A nested pytree from flat file keys: dicts, with runs of ``0..n-1`` turned into lists.

    Used where only a file is at hand (``--shapes NAME=file.npz``). Segments are
    unescaped, so ``mlp%2F~%2Flinear_0`` becomes the dict key ``mlp/~/linear_0``.
    A single key ``""`` (the whole tree is one leaf) returns that leaf.
    """
    if set(flat) == {""}:
        return flat[""]
    root: dict[str, Any] = {}
    for key, value in flat.items():
        parts = split_key(key)
        node = root
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise VjpsplitError(f"key {key!r} nests under a leaf key {p!r}; the keys do not form a pytree")
            node = child
        if parts[-1] in node:
            raise VjpsplitError(f"key {key!r} is both a leaf and a subtree")
        node[parts[-1]] = value

    def listify(n: Any) -> Any:
        if not isinstance(n, dict):
            return n
        n = {k: listify(v) for k, v in n.items()}
        if n and sorted(n) == sorted(str(i) for i in range(len(n))):
            return [n[str(i)] for i in range(len(n))]
        return n

    return listify(root)


def file_arrays(**trees: Any) -> dict[str, Any]:
    """``{file key: array}`` for named argument pytrees, as array files hold them.

    ``vs.save_arrays("inputs.npz", vs.file_arrays(params=params, x=x))`` writes an
    inputs file for ``run-fwd``; typed PRNG keys become their key data.

    Args:
        **trees: The argument pytrees, by argument name.

    Returns:
        The arrays by file key (``params/w``, ``x``).
    """
    return {k: to_data(v) for name, tree in trees.items() for k, v in flatten_with_keys(name, tree)}


def tree_from_file(arrays: Mapping[str, Any], name: str, like: Any) -> Any:
    """The pytree ``like`` (any pytree type) filled from a file's ``{key: array}`` under ``name``.

    Reads a grads, inputs or outputs file back into the caller's own structure;
    typed PRNG key leaves of ``like`` are wrapped back from their key data. A
    missing key is refused by name.

    Args:
        arrays: A file's arrays, by key.
        name: The argument (or ``out``, ``aux``) whose keys to read.
        like: A pytree of the wanted structure; its leaves only say where keys go.

    Returns:
        A pytree of ``like``'s structure holding the file's arrays.

    Raises:
        VjpsplitError: If a key of ``like`` under ``name`` is missing from ``arrays``.
    """
    entries = flatten_with_keys(name, like)
    leaves: list[Any] = []
    for key, leaf in entries:
        if key not in arrays:
            raise VjpsplitError(f"key '{key}' is missing from the arrays; expected keys under '{name}'")
        leaves.append(from_data(arrays[key], impl_name(leaf)) if is_key(leaf) else arrays[key])
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)
