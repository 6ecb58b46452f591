"""Pytrees as flat ``/``-joined keys, and their structure as plain JSON.

Files and manifests never hold Python objects, so an artifact can rebuild its
outputs and gradients without the user's code: dicts, lists, tuples and None
survive exactly; any other node (namedtuple, dataclass, flax struct) comes back
as a dict keyed by its attribute names.
"""

from __future__ import annotations

from typing import Any, Iterator

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from .errors import VjpsplitError


def _entry_name(entry) -> str:
    if isinstance(entry, DictKey):
        name = str(entry.key)
    elif isinstance(entry, SequenceKey):
        name = str(entry.idx)
    elif isinstance(entry, GetAttrKey):
        name = entry.name
    elif isinstance(entry, FlattenedIndexKey):
        name = str(entry.key)
    else:  # future key types: their str is the best name we have
        name = str(entry)
    if not name or "/" in name:
        raise VjpsplitError(f"pytree key {name!r} cannot be a file key: keys must be non-empty and contain no '/'")
    return name


def join_key(prefix: str, path) -> str:
    """The file key of a leaf: ``prefix`` then each path entry, joined by ``/``."""
    return "/".join([prefix, *(_entry_name(e) for e in path)]) if prefix else "/".join(_entry_name(e) for e in path)


def flatten_with_keys(prefix: str, tree) -> list[tuple[str, Any]]:
    """``[(key, leaf), ...]`` in JAX's leaf order, keys like ``params/layers/0/w``."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(join_key(prefix, path), leaf) for path, leaf in leaves]


def encode_structure(tree) -> Any:
    """The structure of ``tree`` as JSON: ``"*"`` a leaf, ``None``, or ``{"dict"|"list"|"tuple": ...}``."""
    if tree is None:
        return None
    if isinstance(tree, dict):
        # JAX orders dict leaves by sorted key; keep that order so leaves line up.
        children, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda n: n is not tree)
        return {"dict": [[_entry_name(p[0]), encode_structure(c)] for p, c in children]}
    if type(tree) in (list, tuple):
        return {type(tree).__name__: [encode_structure(c) for c in tree]}
    children, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda n: n is not tree)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1 and not children[0][0]:
        return "*"  # a leaf: the only "child" is the tree itself, with an empty path
    return {"dict": [[_entry_name(p[0]), encode_structure(c)] for p, c in children]}


def decode_structure(node, leaves: Iterator) -> Any:
    """Rebuild a pytree from ``encode_structure``'s JSON, taking leaves in order from ``leaves``."""
    if node is None:
        return None
    if node == "*":
        return next(leaves)
    if isinstance(node, dict) and len(node) == 1:
        (kind, items), = node.items()
        if kind == "dict":
            return {k: decode_structure(c, leaves) for k, c in items}
        if kind == "list":
            return [decode_structure(c, leaves) for c in items]
        if kind == "tuple":
            return tuple(decode_structure(c, leaves) for c in items)
    raise VjpsplitError(f"malformed pytree structure {node!r} in the artifact manifest; re-export the artifact")


def structure_keys(prefix: str, node) -> list[str]:
    """The file keys of the leaves of an encoded structure, in leaf order."""
    out: list[str] = []

    def walk(n, path):
        if n is None:
            return
        if n == "*":
            out.append("/".join(path))
            return
        (kind, items), = n.items()
        if kind == "dict":
            for k, c in items:
                walk(c, path + [str(k)])
        else:
            for i, c in enumerate(items):
                walk(c, path + [str(i)])

    walk(node, [prefix] if prefix else [])
    return out


def unflatten_keys(flat: dict[str, Any]) -> Any:
    """A nested pytree from flat keys: dicts, with runs of ``0..n-1`` turned into lists.

    Used where only a file is at hand (``--shapes NAME=file.npz``). A single key
    ``""`` (the whole tree is one leaf) returns that leaf.
    """
    if set(flat) == {""}:
        return flat[""]
    root: dict = {}
    for key, value in flat.items():
        parts = key.split("/")
        node = root
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise VjpsplitError(f"key {key!r} nests under a leaf key {p!r}; the keys do not form a pytree")
            node = child
        if parts[-1] in node:
            raise VjpsplitError(f"key {key!r} is both a leaf and a subtree")
        node[parts[-1]] = value

    def listify(n):
        if not isinstance(n, dict):
            return n
        n = {k: listify(v) for k, v in n.items()}
        if n and sorted(n) == sorted(str(i) for i in range(len(n))):
            return [n[str(i)] for i in range(len(n))]
        return n

    return listify(root)
