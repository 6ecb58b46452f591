"""The fast paths of array file I/O give the same results as the plain ones.

Big files are read several arrays at once (``workers``), their blocks reserved before
writing (``filesystem.preallocated``), the replaced file deleted on an I/O thread, and
numpy's own ``.npy`` headers parsed without ``ast``. Each is checked here against the
plain path, with the thresholds lowered so small test files take the fast one.
"""

from __future__ import annotations

import io
import itertools
import os
import signal
import subprocess
import sys
import threading
import time

import ml_dtypes
import numpy as np
import pytest

import vjpsplit_cli as vs
from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.files import common
from vjpsplit_cli.files import npz as npz_codec
from vjpsplit_cli.safeio import filesystem, outputs, workers

FORMATS = ["npz", "msgpack"]


def arrays(n: int = 12) -> dict:
    r = np.random.default_rng(3)
    out = {f"a{i}": r.standard_normal((i + 1, 33)).astype(np.float32) for i in range(n)}
    out.update(
        bf=r.standard_normal(7).astype(ml_dtypes.bfloat16),
        half=np.float16(1.5),
        ints=np.arange(10, dtype=np.int32),
        mask=np.array([True, False, True]),
        empty=np.zeros((0, 4), np.float32),
    )
    return out


@pytest.fixture
def threaded(monkeypatch):
    """Every job takes the threaded path, on two threads even on a one-CPU runner."""
    monkeypatch.setattr(workers, "MIN_PARALLEL_BYTES", 1)
    monkeypatch.setattr(workers, "count", lambda: 2)
    monkeypatch.setattr(workers, "_pool", None)
    yield
    filesystem.finish_removals()


@pytest.mark.parametrize("fmt", FORMATS)
def test_threaded_reads_give_the_same_arrays(tmp_path, threaded, fmt):
    p = tmp_path / f"a.{fmt}"
    want = arrays()
    vs.save_arrays(p, want, {"k": 1})
    got, meta = vs.load_arrays(p)
    assert meta == {"k": 1} and list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == np.asarray(v).dtype and np.array_equal(got[k], v), k
        assert got[k].ctypes.data % 64 == 0 or got[k].size == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_threaded_reads_name_the_first_bad_array_in_file_order(tmp_path, threaded, fmt):
    p = tmp_path / f"a.{fmt}"
    want = arrays()
    vs.save_arrays(p, want, {})
    data = bytearray(p.read_bytes())
    for key in ("a9", "a3", "a7"):  # three damaged arrays: the error names the first in the file
        data[data.index(want[key][-1].tobytes())] ^= 1
    p.write_bytes(bytes(data))
    for _ in range(5):  # whichever thread finishes first
        with pytest.raises(VjpsplitError, match=r"array 'a3' fails its CRC-32 check"):
            vs.load_arrays(p)
    got, _ = vs.load_arrays(p, verify=False)
    assert not np.array_equal(got["a3"], want["a3"]) and np.array_equal(got["a4"], want["a4"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_file_that_shrinks_while_read_by_threads_is_one_line(tmp_path, threaded, monkeypatch, fmt):
    p = tmp_path / f"a.{fmt}"
    vs.save_arrays(p, arrays(), {})
    real = os.preadv

    def short(fd, buffers, offset):  # the file lost its tail after its size was read
        return 0 if offset > 2000 else real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", short)
    with pytest.raises(VjpsplitError, match=rf"a\.{fmt}: .*shrank while it was being read"):
        vs.load_arrays(p)


def test_workers_use_the_callers_thread_for_small_jobs(monkeypatch):
    monkeypatch.setattr(workers, "count", lambda: 2)
    seen = []
    workers.run_all(lambda: seen.append(threading.get_ident()), [(), ()], workers.MIN_PARALLEL_BYTES - 1)
    assert seen == [threading.get_ident()] * 2
    seen.clear()
    workers.run_all(lambda: seen.append(threading.get_ident()), [(), ()], workers.MIN_PARALLEL_BYTES)
    assert threading.get_ident() not in seen
    monkeypatch.setattr(workers, "count", lambda: 1)  # one CPU: threads would only take turns
    assert not workers.parallel(2**40)


def test_workers_raise_the_first_error_in_job_order_after_all_finish(monkeypatch):
    monkeypatch.setattr(workers, "count", lambda: 2)
    done = []

    def job(i):
        done.append(i)
        if i in (1, 3):
            raise ValueError(f"job {i}")

    with pytest.raises(ValueError, match="job 1"):
        workers.run_all(job, [(i,) for i in range(5)], 2**30)
    assert sorted(done) == [0, 1, 2, 3, 4]


def test_a_forked_child_gets_its_own_pool(monkeypatch):
    stale = object()
    monkeypatch.setattr(workers, "_pool", (os.getpid() + 1, stale))  # made by another process
    pool = workers._executor()
    assert pool is not stale and workers._executor() is pool
    assert pool.submit(lambda: 7).result() == 7


# ---------------------------------------------------------------- numpy's .npy headers, parsed without ast


@pytest.mark.parametrize(
    "dtype", [np.float32, np.float16, np.float64, np.int8, np.int32, np.int64, np.uint8, np.bool_, np.complex64, ">f4"]
)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (5,), (3, 4), (0, 3), (2, 1, 7), (1,) * 20, (10**12,)])
@pytest.mark.parametrize("fortran", [False, True])
def test_plain_headers_parse_as_numpy_parses_them(dtype, shape, fortran):
    d = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": fortran, "shape": shape}
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, d)
    f.seek(0)
    fast = npz_codec._plain_npy_header(f)
    assert f.tell() == len(f.getvalue())  # left where the array's bytes begin
    f.seek(0)
    np.lib.format.read_magic(f)
    assert fast == np.lib.format.read_array_header_1_0(f)


@pytest.mark.parametrize(
    "header",
    [
        b"{'descr': '<f4', 'fortran_order': False, 'shape': (3,4), }",  # numpy never writes this spacing
        b"{'shape': (3,), 'descr': '<f4', 'fortran_order': False, }",  # nor this order
        b"{'descr': '|O', 'fortran_order': False, 'shape': (3,), }",  # objects: numpy's parser, then refused
        b"{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (3,), }",  # structured
        b"{'descr': '<M8[ns]', 'fortran_order': False, 'shape': (3,), }",
        b"{'descr': '<f4', 'fortran_order': False, 'shape': (03,), }",
        b"{'descr': '<f4', 'fortran_order': 0, 'shape': (3,), }",
    ],
)
def test_other_headers_go_to_numpys_parser(header):
    f = io.BytesIO(b"\x93NUMPY\x01\x00" + len(header + b"\n").to_bytes(2, "little") + header + b"\n")
    assert npz_codec._plain_npy_header(f) is None
    f = io.BytesIO(b"\x93NUMPY\x02\x00" + (10).to_bytes(4, "little") + b"{}" + b" " * 7 + b"\n")
    assert npz_codec._plain_npy_header(f) is None  # version 2.0


def test_numpys_own_archives_load_through_both_header_paths(tmp_path):
    p = tmp_path / "np.npz"
    want = {"x": np.arange(6.0).reshape(2, 3), "f": np.asfortranarray(np.arange(6).reshape(2, 3)), "s": np.int8(3)}
    np.savez(p, **want)
    got, meta = vs.load_arrays(p)
    assert meta == {} and all(np.array_equal(got[k], v) for k, v in want.items())
    assert got["f"].flags.f_contiguous


# ---------------------------------------------------------------- blocks reserved before writing


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("estimate", [0.5, 1.0, 3.0])
def test_a_size_estimate_never_changes_the_file(tmp_path, monkeypatch, fmt, estimate):
    # Too small or too large, the estimate only reserves blocks: the file is the same bytes.
    monkeypatch.setattr(filesystem, "MIN_PREALLOCATE", 1)
    big = {"w": np.arange(300_000, dtype=np.float32), "b": np.ones(3, np.int8)}
    plain, reserved = tmp_path / f"plain.{fmt}", tmp_path / f"reserved.{fmt}"
    with monkeypatch.context() as m:
        m.setattr(filesystem, "_libc_fallocate", lambda: None)
        vs.save_arrays(plain, big, {"k": 1})
    calls = []
    real = outputs.atomic_write

    def scaled(path, write, *, fsync=False, size=None):
        calls.append(size)
        return real(path, write, fsync=fsync, size=int(size * estimate))

    monkeypatch.setattr("vjpsplit_cli.files.atomic_write", scaled)
    vs.save_arrays(reserved, big, {"k": 1})
    assert calls and calls[0] >= 1_200_000
    assert reserved.read_bytes() == plain.read_bytes()


def test_reserving_blocks_where_the_system_refuses_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(filesystem, "MIN_PREALLOCATE", 1)
    monkeypatch.setattr(filesystem, "_libc_fallocate", lambda: lambda fd, mode, off, n: -1)  # EOPNOTSUPP
    p = tmp_path / "a.npz"
    vs.save_arrays(p, {"w": np.arange(1000.0)})
    assert vs.load_arrays(p)[0]["w"].tolist() == list(np.arange(1000.0))


def test_staged_outputs_reserve_blocks_too(tmp_path, monkeypatch):
    monkeypatch.setattr(filesystem, "MIN_PREALLOCATE", 1)
    reserved = []
    real = filesystem._fallocate
    monkeypatch.setattr(filesystem, "_fallocate", lambda f, n: reserved.append(n) or real(f, n))
    with outputs.StagedOutputs({"--out": tmp_path / "o.npz"}) as out:
        out.write("--out", lambda p: vs.save_arrays(p, {"w": np.arange(5000.0)}))
    assert reserved and vs.load_arrays(tmp_path / "o.npz")[0]["w"].shape == (5000,)
    assert os.listdir(tmp_path) == ["o.npz"]


# ---------------------------------------------------------------- the replaced file, deleted on an I/O thread


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_big_replaced_file_is_deleted_on_an_io_thread(tmp_path, threaded, monkeypatch, fmt):
    if filesystem.renameat2() is None:
        pytest.skip("no renameat2(RENAME_EXCHANGE) here: os.replace deletes the old file itself")
    where = []
    real = filesystem._unlink_quietly
    monkeypatch.setattr(filesystem, "_unlink_quietly", lambda p: where.append(threading.get_ident()) or real(p))
    p = tmp_path / f"r.{fmt}"
    for i in range(3):
        vs.save_arrays(p, {"w": np.full(1000, i, np.float32)})
    filesystem.finish_removals()
    assert os.listdir(tmp_path) == [p.name]
    assert vs.load_arrays(p)[0]["w"][0] == 2
    assert len(where) == 2 and threading.get_ident() not in where


@pytest.mark.parametrize("staged", [False, True])
def test_the_next_write_waits_for_the_last_removal(tmp_path, threaded, monkeypatch, staged):
    # Deletion off the caller's thread must not let old files pile up: each new temp file
    # is made only once the file it replaced last time is gone.
    if filesystem.renameat2() is None:
        pytest.skip("no renameat2(RENAME_EXCHANGE) here: os.replace deletes the old file itself")
    real_unlink, real_new_temp = filesystem._unlink_quietly, outputs.new_temp
    monkeypatch.setattr(filesystem, "_unlink_quietly", lambda p: time.sleep(0.2) or real_unlink(p))
    seen = []
    monkeypatch.setattr(outputs, "new_temp", lambda *a: seen.append(sorted(os.listdir(tmp_path))) or real_new_temp(*a))
    p = tmp_path / "r.npz"
    for i in range(3):
        if staged:
            with outputs.StagedOutputs({"--r": p}) as out:
                out.write("--r", lambda t: vs.save_arrays(t, {"w": np.full(1000, i, np.float32)}))
        else:
            vs.save_arrays(p, {"w": np.full(1000, i, np.float32)})
    assert seen == [[], ["r.npz"], ["r.npz"]]


def test_small_replaced_files_are_deleted_before_the_save_returns(tmp_path, monkeypatch):
    monkeypatch.setattr(workers, "count", lambda: 2)
    p = tmp_path / "r.npz"
    for i in range(3):
        vs.save_arrays(p, {"w": np.full(10, i, np.float32)})
        assert os.listdir(tmp_path) == ["r.npz"]  # no waiting: nothing was handed to a thread


def test_threads_and_files_together(tmp_path, threaded):
    # Save and load many files on the I/O threads' path, interleaved: every load sees a whole file.
    want = arrays(4)
    for fmt, i in itertools.product(FORMATS, range(4)):
        p = tmp_path / f"x.{fmt}"
        vs.save_arrays(p, {**want, "i": np.int32(i)}, {"i": i})
        got, meta = vs.load_arrays(p)
        assert meta == {"i": i} and int(got["i"]) == i and np.array_equal(got["a3"], want["a3"])
    filesystem.finish_removals()
    assert sorted(os.listdir(tmp_path)) == ["x.msgpack", "x.npz"]


# ---------------------------------------------------------------- one writev for a whole file


@pytest.mark.parametrize("fmt", FORMATS)
def test_short_writev_calls_still_write_every_byte(tmp_path, monkeypatch, fmt):
    # writev may take fewer bytes than asked (a signal, a full pipe); more buffers than
    # IOV_MAX take several calls. Either way the file is the same bytes.
    many = {f"k{i}": np.full(i % 5, i, np.int16) for i in range(1500)}
    plain = tmp_path / f"plain.{fmt}"
    with monkeypatch.context() as m:
        m.delattr(os, "writev")
        vs.save_arrays(plain, many, {"k": 1})
    real, calls = os.writev, []

    def short(fd, buffers):
        calls.append(len(buffers))
        assert len(buffers) <= 1024
        return real(fd, [bytes(memoryview(buffers[0])[:7])]) if len(buffers[0]) else real(fd, buffers[:2])

    monkeypatch.setattr(os, "writev", short)
    p = tmp_path / f"a.{fmt}"
    vs.save_arrays(p, many, {"k": 1})
    assert p.read_bytes() == plain.read_bytes() and len(calls) > 1500
    got, meta = vs.load_arrays(p)
    assert meta == {"k": 1} and all(np.array_equal(got[k], v) for k, v in many.items())


@pytest.mark.parametrize("fmt", FORMATS)
def test_crcs_computed_beside_the_writes_give_the_same_file(tmp_path, monkeypatch, fmt):
    # On a big file the CRC-32s are computed on an I/O thread while the bytes go out
    # (.npz: local headers written with zeros, then filled in): the same bytes as inline.
    want = arrays()
    plain, threaded = tmp_path / f"plain.{fmt}", tmp_path / f"threaded.{fmt}"
    vs.save_arrays(plain, want, {"k": 1})
    where = []
    real = common._crc32s
    monkeypatch.setattr(common, "_crc32s", lambda groups: where.append(threading.get_ident()) or real(groups))
    monkeypatch.setattr(workers, "MIN_PARALLEL_BYTES", 1)
    monkeypatch.setattr(workers, "count", lambda: 2)
    vs.save_arrays(threaded, want, {"k": 1})
    assert where and threading.get_ident() not in where
    assert threaded.read_bytes() == plain.read_bytes()


def test_writers_on_several_threads_share_the_io_threads(tmp_path, threaded):
    # An in-process pipeline's stages save and load on their own threads at once.
    errors = []

    def stage(s):
        try:
            for i in range(6):
                p = tmp_path / f"s{s}.{FORMATS[i % 2]}"
                vs.save_arrays(p, {"w": np.full(2000, 10 * s + i, np.float32)}, {"i": i})
                got, meta = vs.load_arrays(p)
                assert meta == {"i": i} and got["w"][0] == 10 * s + i
        except BaseException as e:  # handed to the main thread, which asserts
            errors.append(e)

    threads = [threading.Thread(target=stage, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    filesystem.finish_removals()
    assert sorted(os.listdir(tmp_path)) == sorted(f"s{s}.{f}" for s in range(4) for f in FORMATS)


# ---------------------------------------------------------------- exit never waits on an idle I/O thread

_EXIT_CHILD = """
import os, sys, numpy as np
import vjpsplit_cli as vs
from vjpsplit_cli.safeio import filesystem, workers
workers.MIN_PARALLEL_BYTES = 1
workers.count = lambda: 2
calls = []
real = filesystem._unlink_quietly
filesystem._unlink_quietly = lambda p: (__import__("time").sleep(0.3), real(p))
d = sys.argv[1]
for i in range(2):  # the second save hands the first file's deletion to an I/O thread
    vs.save_arrays(os.path.join(d, "r.npz"), {"w": np.full(1000, i, np.float32)})
assert all(t.daemon for t in __import__("threading").enumerate() if t.name.startswith("vjpsplit-io"))
if sys.argv[2] == "interrupt":
    raise KeyboardInterrupt
"""


@pytest.mark.parametrize("how", ["return", "interrupt"])
def test_a_process_exits_with_io_threads_and_finishes_their_deletions(tmp_path, how):
    # The I/O threads are daemons (exit does not join them: a signal that cut a thread's
    # start short once left an exit waiting for ever); the deletions handed to them are
    # finished at exit all the same.
    r = subprocess.run(
        [sys.executable, "-c", _EXIT_CHILD, str(tmp_path), how], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == (0 if how == "return" else -signal.SIGINT), r.stderr[-2000:]  # Python ends by SIGINT
    assert os.listdir(tmp_path) == ["r.npz"]
