"""Arrays as one buffer of bytes and back, bit for bit: one transfer where there would be one per array.

On an accelerator every array a transfer or a compiled call takes or gives costs
the host a fixed amount of its own time (on a TPU v5e host: a ``jax.device_put``
of one array to ``pinned_host`` ~0.5 ms, a jitted identity over 32 small host
arrays 2.4 ms where the same bytes as one buffer take 0.6 ms). So offload's copies
(``packer``, ``unpacker``: a microbatch's residuals to ``pinned_host`` memory and
back, each one compiled call) and a host batch's move to a stage's device
(``StageWorker._put_host``: the small host arrays as one buffer) carry their arrays packed.
Each array is bit-cast to bytes (``bool`` as one byte of 0 or 1), so NaN payloads,
signed zeros and every integer come back as they left. Complex and sub-byte dtypes
(int4) are not packed: their callers move them one by one.

Reference: JAX's memory kinds, https://docs.jax.dev/en/latest/notebooks/host-offloading.html
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import numpy as np

# (shape, dtype) per array, in order: a packed buffer's layout.
Specs = tuple[tuple[tuple[int, ...], np.dtype], ...]


def whole_bytes(d: np.dtype) -> bool:
    """Whether arrays of dtype ``d`` pack: bool, integers and floats of whole bytes (not complex, not int4)."""
    if d == np.bool_:
        return True
    if not (jax.numpy.issubdtype(d, jax.numpy.integer) or jax.numpy.issubdtype(d, jax.numpy.floating)):
        return False
    bits = getattr(jax.dtypes, "itemsize_bits", None)  # int4 and the like: less than a byte each
    return bool(bits(d) == 8 * d.itemsize) if bits is not None else not d.name.endswith(("int4", "int2", "e2m1fn"))


def packable(arrays: Sequence[jax.Array]) -> bool:
    """Whether device ``arrays`` pack into one buffer (``packer``): all on one device, with one sharding, of
    dtypes of whole bytes."""
    s = arrays[0].sharding
    return len(s.device_set) == 1 and all(a.sharding == s and whole_bytes(np.dtype(a.dtype)) for a in arrays)


def _as_bytes(x: jax.Array) -> jax.Array:
    if x.dtype == np.bool_:
        return x.astype(np.uint8).reshape(-1)
    return jax.lax.bitcast_convert_type(x, np.uint8).reshape(-1)


def _from_bytes(b: jax.Array, shape: tuple[int, ...], dtype: np.dtype) -> jax.Array:
    if dtype == np.bool_:
        return (b != 0).reshape(shape)
    if dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(b, dtype).reshape(shape)
    return jax.lax.bitcast_convert_type(b.reshape(*shape, dtype.itemsize), dtype)


@functools.cache
def packer(specs: Specs, sharding: jax.sharding.Sharding) -> Callable[[Sequence[jax.Array]], jax.Array]:
    """One compiled call: arrays of ``specs`` on ``sharding``'s device, their bytes as one buffer in its
    ``pinned_host`` memory. A program runs in the device's order, where it was dispatched (a ``jax.device_put``
    runs on a stream of its own as soon as its input is ready); one buffer is one transfer.

    Args:
        specs: The arrays' shapes and dtypes, in order (the cache's key: the unpacker needs them).
        sharding: Their sharding, on one device.

    Returns:
        The jitted packing call.
    """
    del specs  # the key: jit traces each signature once anyway
    return jax.jit(
        lambda xs: jax.numpy.concatenate([_as_bytes(x) for x in xs]),
        out_shardings=sharding.with_memory_kind("pinned_host"),
    )


@functools.cache
def unpacker(specs: Specs, sharding: jax.sharding.Sharding) -> Callable[[jax.Array | np.ndarray], list[jax.Array]]:
    """One compiled call: a buffer of bytes (``packer``'s in ``pinned_host`` memory, or ``pack_host``'s NumPy
    one) on ``sharding`` (its device's memory), as the arrays of ``specs``, bit for bit.

    Args:
        specs: The arrays' shapes and dtypes, in the buffer's order.
        sharding: Where the arrays go (one device).

    Returns:
        The jitted unpacking call.
    """
    sizes = [int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for shape, dtype in specs]
    starts = np.cumsum([0, *sizes]).tolist()

    def unpack(buf: jax.Array) -> list[jax.Array]:
        buf = jax.device_put(buf, sharding)  # host memory to the device's, inside the call
        return [
            _from_bytes(buf[a : a + n], shape, np.dtype(dtype)) for a, n, (shape, dtype) in zip(starts, sizes, specs)
        ]

    return jax.jit(unpack, out_shardings=[sharding] * len(specs))


def pack_host(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Host ``arrays``' bytes in one ``uint8`` buffer, in order (``unpacker``'s input; each ``host_packs``).

    Args:
        arrays: NumPy arrays of native byte order and whole-byte dtypes.

    Returns:
        The buffer (a copy).
    """
    return np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays])


def packs_host_to(device: jax.Device) -> bool:
    """Whether host arrays bound for ``device`` go packed: on an accelerator. A CPU device's transfer is a copy
    in the same RAM, cheaper one by one (on the 2-core CI machine a jitted identity over 32 small host arrays took
    94 µs, packed 151 µs; on a TPU v5e host 2.4 ms against 0.6 ms: benchmarks/results/2026-12-07-tpu-host-batch.md)."""
    return bool(device.platform != "cpu")


# A host array packs up to this many bytes; a larger one goes on its own. Chosen, not measured: packing saved about
# 55 µs of a TPU host's time per array (32 arrays: 2.4 ms against 0.6 ms), about what a memcpy of 1 MiB costs.
SMALL = 1 << 20


def host_packs(a: object) -> bool:
    """Whether host array ``a`` goes to a device inside a packed buffer (``pack_host``): a NumPy array of native
    byte order, of a whole-byte dtype JAX keeps as it is, of at most ``SMALL`` bytes."""
    if type(a) is not np.ndarray or a.nbytes > SMALL or not a.dtype.isnative:
        return False
    # A dtype JAX would turn into another (64 bits without x64) goes the unpacked way, which converts it.
    return whole_bytes(a.dtype) and jax.dtypes.canonicalize_dtype(a.dtype) == a.dtype
