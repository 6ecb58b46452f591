"""Arrays packed into one buffer of bytes and back (``runtime/packing``): offload's copies and a host batch's move
to an accelerator's device, bit for bit; a Trainer step whose host batch goes packed equals one that does not."""

from __future__ import annotations

import functools

import jax
import ml_dtypes
import numpy as np
import optax
import pytest
from stage_models import gpt, gpt_batch, gpt_params, gpt_specs

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.pipeline.runtime import packing

DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16, np.int32, np.int8, np.uint8, np.bool_, np.uint16]


def _random(dtype, shapes, seed=0):
    """Arrays of ``dtype`` whose bytes are random (every bit pattern: NaN payloads included)."""
    rng = np.random.default_rng(seed)
    size = np.dtype(dtype).itemsize
    raw = [rng.integers(0, 256, size=(*s, size), dtype=np.uint8) for s in shapes]
    return [
        np.asarray(r[..., 0] % 2 == 1) if dtype == np.bool_ else r.view(dtype).reshape(s) for r, s in zip(raw, shapes)
    ]


def _bitwise(got, want):
    assert len(got) == len(want)
    for x, y in zip(got, want):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_host_arrays_arrive_on_the_device_bit_for_bit(dtype):
    host = _random(dtype, [(3, 5), (), (0, 4), (2, 1, 7)])
    host.append(_random(dtype, [(6, 4)], seed=1)[0].T)  # not contiguous: packed from a copy
    host.append(np.array([np.nan, -0.0, np.inf], np.float32))  # NaN payloads and signed zeros are bits too
    assert all(packing.host_packs(h) for h in host)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    specs = tuple((h.shape, h.dtype) for h in host)
    buf = packing.pack_host(host)
    assert buf.dtype == np.uint8 and buf.nbytes == sum(h.nbytes for h in host)
    back = packing.unpacker(specs, sharding)(buf)
    assert [b.sharding for b in back] == [sharding] * len(host)
    _bitwise(back, host)


def _cpu_has_pinned_host() -> bool:
    from vjpsplit_cli.pipeline.runtime import offload

    return offload._has_pinned_host(jax.device_put(np.ones(1), jax.devices()[0]))


@pytest.mark.skipif(not _cpu_has_pinned_host(), reason="this jax's CPU devices have no pinned_host memory")
@pytest.mark.parametrize(
    "dtype", [np.float32, jax.numpy.bfloat16, np.float16, np.int32, np.int8, np.uint8, np.bool_, np.uint32]
)
def test_packed_residuals_come_back_bit_for_bit(dtype):
    """Offload's copies: device arrays packed into one buffer in ``pinned_host`` memory and back on the device."""
    host = _random(dtype, [(3, 5), (), (0, 4), (2, 1, 7)])
    host.append(np.array([np.nan, -0.0, np.inf], np.float32))  # NaN payloads and signed zeros are bits too
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    arrays = [jax.device_put(h, sharding) for h in host]
    assert packing.packable(arrays)
    specs = tuple((tuple(a.shape), np.dtype(a.dtype)) for a in arrays)
    buf = packing.packer(specs, sharding)(arrays)
    assert buf.sharding.memory_kind == "pinned_host" and buf.dtype == np.uint8
    back = packing.unpacker(specs, sharding)(buf)
    assert [b.sharding for b in back] == [sharding] * len(arrays)
    _bitwise(back, arrays)


def test_only_small_native_whole_byte_host_arrays_pack():
    assert packing.host_packs(np.zeros(4, np.int32))
    assert not packing.host_packs(np.zeros(4, ">i4"))  # big-endian: its bytes would be read the other way
    assert not packing.host_packs(np.zeros(4, np.complex64))
    assert not packing.host_packs(np.zeros(packing.SMALL // 4 + 1, np.float32))  # its own transfer is cheaper
    assert not packing.host_packs(jax.numpy.zeros(4))  # already a JAX array
    assert not packing.host_packs(3.0)
    # A dtype JAX turns into another (64 bits without x64) goes the unpacked way, which converts it.
    assert packing.host_packs(np.zeros(4, np.int64)) == jax.config.jax_enable_x64


M = 4


@functools.lru_cache(maxsize=None)
def _stages():
    return vs.export_stages(gpt, *gpt_specs(gpt_params()), wrt="params", platforms="cpu")


def _train(steps=3):
    with P.Trainer(
        _stages(), gpt_params(), optimizer=optax.adamw(1e-2), schedule="1f1b", microbatches=M, runner="inprocess"
    ) as tr:
        losses = [tr.step(gpt_batch(2 * M, seed=70 + i)) for i in range(steps)]
        return losses, tr.params(), tr.state()[1]


@pytest.mark.parametrize("small", [packing.SMALL, 8])
def test_a_host_batch_goes_packed_on_an_accelerator_and_trains_bitwise_as_without(monkeypatch, small):
    """On an accelerator (here: CPU devices told to pack, as ``packs_host_to`` tells a TPU's) a stage's host
    microbatches reach its device in one packed transfer per step (those over ``SMALL`` bytes one by one beside
    it), and the steps train bit for bit as the unpacked ones."""
    ref = _train()
    calls: list[int] = []
    unpacker = packing.unpacker

    def counted(specs, sharding):
        call = unpacker(specs, sharding)
        return lambda buf: (calls.append([(s, str(d)) for s, d in specs]), call(buf))[1]

    monkeypatch.setattr(packing, "packs_host_to", lambda device: True)
    monkeypatch.setattr(packing, "unpacker", counted)
    monkeypatch.setattr(packing, "SMALL", small)
    got = _train()
    assert got[0] == ref[0]
    _bitwise(jax.tree_util.tree_leaves(got[1:]), jax.tree_util.tree_leaves(ref[1:]))
    if small > 8:
        # Per step, each stage that reads the batch has its M microbatches' arrays in one buffer: the first stage
        # its tokens, the second (a middle one) its mask, the last its labels.
        tokens, mask, labels = ("int32", "float32", "int32")
        assert [{d for _, d in c} for c in calls] == [{tokens}, {mask}, {labels}] * 3
        assert [len(c) for c in calls] == [M] * 9
    else:  # every microbatch array is over 8 bytes: none packs, all go by the jitted identity
        assert calls == []
