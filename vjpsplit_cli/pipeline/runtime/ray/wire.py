"""What a delivery between two actors' sockets is: one frame of a msgpack header and the arrays' raw bytes.

A frame is a 4-byte little-endian header length, the header, then every array's
bytes in order. The header is msgpack of ``[step, items, arrays]``: ``items`` one
``[kind, mb, stage, tree]`` per delivered value, ``arrays`` one ``[dtype name,
shape]`` per array the trees refer to. A tree is ``None``, ``["a", i]`` (array
``i``), or ``["t"|"l", [trees]]`` / ``["d", [[key, tree], ...]]`` for a tuple,
list or dict (keys str or int). Nothing else is encoded: a value holding any other
node (a namedtuple, a custom pytree) raises ``Unencodable`` and its sender hands it
to Ray instead. Decoding is data only (no pickle): dtypes come from the files'
allowed list, shapes and sizes are checked against the bytes that follow, and
nesting is bounded.
"""

from __future__ import annotations

import struct
from typing import Callable, Sequence

import msgpack
import numpy as np

from ....errors import VjpsplitError
from ....files.buffers import aligned_empty
from ....files.dtypes import dtype_from_name, dtype_name

Item = tuple[tuple[str, int, int], object]  # a delivered value keyed by its operation (kind, mb, stage)
HEADER = struct.Struct("<I")
MAX_HEADER = 64 << 20  # a header past this is not a frame this code wrote
MAX_DEPTH = 64  # a tree nested deeper is not a value a stage sends


class Unencodable(Exception):
    """A value with a node this format does not carry (its sender hands it to Ray instead)."""


class BadFrame(VjpsplitError):
    """A frame that is not one ``encode`` wrote: the connection it came on is dropped."""


def encode(step: int, items: Sequence[Item]) -> list[memoryview]:
    """The frame for step ``step``'s ``items`` (values of host arrays, or None), as buffers to send in order.

    Raises:
        Unencodable: If a value holds anything but tuples, lists, dicts, None and numpy arrays.
    """
    arrays: list[np.ndarray] = []
    meta: list[list[object]] = []

    def tree(x: object, depth: int) -> object:
        if depth > MAX_DEPTH:
            raise Unencodable(f"nested deeper than {MAX_DEPTH}")
        if x is None:
            return None
        if isinstance(x, np.generic):  # a 0-d array's element: sent as the 0-d array
            x = np.asarray(x)
        if isinstance(x, np.ndarray):
            try:
                name = dtype_name(x.dtype)
            except VjpsplitError as e:
                raise Unencodable(str(e)) from e
            arrays.append(np.ascontiguousarray(x))
            meta.append([name, list(x.shape)])
            return ["a", len(arrays) - 1]
        if type(x) is tuple or type(x) is list:  # exactly: a subclass (namedtuple) would come back as its base
            return ["t" if type(x) is tuple else "l", [tree(c, depth + 1) for c in x]]
        if type(x) is dict and all(type(k) in (str, int) for k in x):
            return ["d", [[k, tree(v, depth + 1)] for k, v in x.items()]]
        raise Unencodable(f"a {type(x).__name__} node")

    body = [[str(kind), int(mb), int(stage), tree(value, 0)] for (kind, mb, stage), value in items]
    header = msgpack.packb([int(step), body, meta], use_bin_type=True)
    bufs = [memoryview(HEADER.pack(len(header)) + header)]
    bufs += [memoryview(a.reshape(-1).view(np.uint8).data) for a in arrays if a.nbytes]
    return bufs


def decode(read_exactly: Callable[[int], bytes], read_into: Callable[[memoryview], None]) -> tuple[int, list[Item]]:
    """One frame from a stream: ``read_exactly(n)`` gives its next ``n`` bytes, ``read_into(view)`` fills
    ``view`` from it (each raising ``EOFError`` at the stream's end). Step and items, as ``encode`` took them.

    Raises:
        BadFrame: If the header is not one ``encode`` writes.
        EOFError: If the stream ends (between frames: the peer closed it).
    """
    (size,) = HEADER.unpack(read_exactly(HEADER.size))
    if size > MAX_HEADER:
        raise BadFrame(f"a frame header of {size} bytes (at most {MAX_HEADER})")
    try:
        step, body, meta = msgpack.unpackb(read_exactly(size), raw=False, strict_map_key=True, use_list=True)
        arrays = [_empty(name, shape) for name, shape in meta]
    except (
        ValueError,
        TypeError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
        MemoryError,
        VjpsplitError,
    ) as e:
        raise BadFrame(f"a frame header that does not parse: {e}") from e
    for a in arrays:
        if a.nbytes:
            read_into(memoryview(a.reshape(-1).view(np.uint8).data))
    if type(step) is not int or not isinstance(body, list):
        raise BadFrame("a frame header without a step and items")
    items: list[Item] = []
    for item in body:
        if not (isinstance(item, list) and len(item) == 4 and type(item[0]) is str):
            raise BadFrame("an item that is not [kind, mb, stage, tree]")
        kind, mb, stage, t = item
        if type(mb) is not int or type(stage) is not int:
            raise BadFrame("an item whose microbatch or stage is not an int")
        items.append(((kind, mb, stage), _tree(t, arrays, 0)))
    return step, items


def _empty(name: object, shape: object) -> np.ndarray:
    if type(name) is not str or not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise BadFrame("an array entry that is not [dtype name, shape]")
    if len(shape) > 64 or int(np.prod(shape, dtype=np.float64)) > 1 << 40:
        raise BadFrame(f"an array of shape {shape}")
    # Aligned: a jax.device_put onto a CPU device takes the bytes as they are, no copy. (A stage's own
    # to_device now moves host arrays with a jitted identity instead, which copies on the device.)
    return aligned_empty(shape, dtype_from_name(name))


def _tree(t: object, arrays: list[np.ndarray], depth: int) -> object:
    if t is None:
        return None
    if depth > MAX_DEPTH or not (isinstance(t, list) and len(t) == 2):
        raise BadFrame("a tree node that encode does not write")
    tag, payload = t
    if tag == "a" and type(payload) is int and 0 <= payload < len(arrays):
        return arrays[payload]
    if tag in ("t", "l") and isinstance(payload, list):
        kids = [_tree(c, arrays, depth + 1) for c in payload]
        return tuple(kids) if tag == "t" else kids
    if tag == "d" and isinstance(payload, list):
        out: dict[object, object] = {}
        for pair in payload:
            if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) in (str, int)):
                raise BadFrame("a dict entry that is not [key, tree]")
            out[pair[0]] = _tree(pair[1], arrays, depth + 1)
        return out
    raise BadFrame(f"a tree node tagged {tag!r}")
