"""The actors' socket transport without Ray: ``wire`` frames round trip every dtype and tree a step sends, refuse
what they do not carry, reject frames ``encode`` did not write, ``peers`` opens only to the token, and the ``inbox`` reads the connections
from the thread that waits."""

from __future__ import annotations

import collections
import queue
import socket
import threading

import ml_dtypes
import numpy as np
import pytest

from vjpsplit_cli import config
from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.pipeline.runtime.ray import peers, wire
from vjpsplit_cli.pipeline.runtime.ray.inbox import Inbox

DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16, np.int32, np.bool_]
SHAPES = [(3, 5), (), (0, 4)]


def _stream(bufs):
    data = b"".join(bytes(b) for b in bufs)
    pos = [0]

    def read_exactly(n):
        if pos[0] + n > len(data):
            raise EOFError
        out = data[pos[0] : pos[0] + n]
        pos[0] += n
        return out

    def read_into(view):
        view[:] = read_exactly(len(view))

    return read_exactly, read_into


def _roundtrip(step, items):
    return wire.decode(*_stream(wire.encode(step, items)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_an_array_of_every_dtype_and_shape_comes_back_bitwise(dtype, shape):
    a = (np.arange(int(np.prod(shape))).reshape(shape) % 3).astype(dtype)
    step, items = _roundtrip(7, [(("F", 2, 1), a)])
    assert step == 7 and items[0][0] == ("F", 2, 1)
    got = items[0][1]
    assert got.dtype == a.dtype and got.shape == a.shape
    assert got.tobytes() == a.tobytes()


@pytest.mark.parametrize("shape", [(2, 64, 256), (3, 5), (7,)])
def test_received_arrays_are_aligned_and_a_cpu_device_takes_them_without_a_copy(shape):
    """What a frame brings starts on a 64-byte boundary, so the receiving stage's device_put onto its CPU device
    uses the bytes as they are (whatever the allocator gave; NumPy's own left 128 KiB arrays 32 bytes off)."""
    import jax

    arrays = [np.full(shape, i, np.float32) for i in range(4)]
    _, items = _roundtrip(3, [(("F", i, 0), a) for i, a in enumerate(arrays)])
    for (_, got), want in zip(items, arrays):
        assert got.ctypes.data % 64 == 0 and got.flags.writeable
        np.testing.assert_array_equal(got, want)
        on_device = jax.device_put(got, jax.local_devices()[0])
        assert on_device.unsafe_buffer_pointer() == got.ctypes.data  # zero-copy
        np.testing.assert_array_equal(np.asarray(on_device), want)


def test_trees_of_tuples_lists_dicts_and_none_keep_their_types_and_order():
    x = np.ones((2, 3), np.float32)
    value = (x, [x * 2, None], {"b": x, 3: (x,)})
    _, items = _roundtrip(1, [(("B", 0, 1), value), (("tied", 0, 2), None)])
    (k1, v), (k2, none) = items
    assert k1 == ("B", 0, 1) and k2 == ("tied", 0, 2) and none is None
    assert type(v) is tuple and type(v[1]) is list and v[1][1] is None
    assert list(v[2]) == ["b", 3] and type(v[2][3]) is tuple
    np.testing.assert_array_equal(v[1][0], x * 2)


def test_a_noncontiguous_array_is_sent_as_its_values():
    a = np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2]
    _, [(_, got)] = _roundtrip(0, [(("F", 0, 0), a)])
    np.testing.assert_array_equal(got, a)


@pytest.mark.parametrize(
    "value",
    [collections.namedtuple("P", "a b")(np.ones(2), np.ones(2)), np.array(["s"]), {(1, 2): np.ones(1)}, object()],
    ids=["namedtuple", "str array", "tuple key", "object"],
)
def test_a_node_a_frame_does_not_carry_is_unencodable(value):
    with pytest.raises(wire.Unencodable):
        wire.encode(0, [(("F", 0, 0), value)])


def _header(obj) -> bytes:
    import msgpack

    h = msgpack.packb(obj, use_bin_type=True)
    return wire.HEADER.pack(len(h)) + h


@pytest.mark.parametrize(
    "frame",
    [
        wire.HEADER.pack(wire.MAX_HEADER + 1),
        _header([0, [["F", 0, 0, ["a", 1]]], [["float32", [2]]]]) + b"\0" * 8,  # array 1 of one
        _header([0, [["F", 0, 0, None]], [["object", [2]]]]),  # a dtype files refuse
        _header([0, [["F", 0, 0, None]], [["float32", [-1]]]]),
        _header([0, [["F", "0", 0, None]], []]),
        _header([0, [["F", 0, 0, ["x", 0]]], []]),
        _header(["step", [], []]),
        wire.HEADER.pack(3) + b"\xc1\xc1\xc1",  # not msgpack
    ],
    ids=["huge header", "array index", "dtype", "shape", "microbatch", "tag", "step", "garbage"],
)
def test_a_frame_encode_did_not_write_is_a_bad_frame(frame):
    with pytest.raises(wire.BadFrame):
        wire.decode(*_stream([frame]))


def test_a_stream_that_ends_between_frames_is_eof_not_a_bad_frame():
    with pytest.raises(EOFError):
        wire.decode(*_stream([b""]))


def _listener(token=b"t" * peers.TOKEN_BYTES):
    """A listener whose authenticated connections an inbox reads; what it attached and the errors reported."""
    inbox, attached, errors = Inbox(), [], queue.Queue()

    def on_connection(conn):
        attached.append(conn)
        inbox.attach(conn, errors.put)

    return peers.Listener(token, on_connection, "127.0.0.1"), inbox, attached, errors


def _taking(inbox, step, key):
    """``inbox.take(step, key)`` in a thread of its own: the thread, and a queue that gets what it returns."""
    out: queue.Queue = queue.Queue()
    t = threading.Thread(target=lambda: out.put(inbox.take(step, key)), daemon=True)
    t.start()
    return t, out


def test_links_deliver_to_the_listener_that_holds_their_token():
    token = b"k" * peers.TOKEN_BYTES
    lis, inbox, _, errors = _listener(token)
    links = peers.Links([None, lis.address], token, me=0)
    try:
        big = np.arange(300_000, dtype=np.float32)  # many sendmsg calls and recv_into chunks
        links.send(1, 4, [(("F", 0, 0), (big, None))])
        links.send(1, 5, [(("B", 1, 1), big[:3])])
        _, got = _taking(inbox, 5, ("B", 1, 1))  # reads both frames: the first one's value waits in the inbox
        np.testing.assert_array_equal(got.get(timeout=10), big[:3])
        arr, none = inbox.take(4, ("F", 0, 0))
        assert none is None
        np.testing.assert_array_equal(arr, big)
        assert errors.empty()
    finally:
        links.close()
        lis.close()
        inbox.close()


def test_a_connection_without_the_token_is_closed_before_any_frame_is_read():
    lis, inbox, attached, errors = _listener(b"a" * peers.TOKEN_BYTES)
    try:
        links = peers.Links([lis.address], b"b" * peers.TOKEN_BYTES, me=1)
        with pytest.raises(OSError):
            for _ in range(200):  # the listener closes its end: a later send fails
                links.send(0, 0, [(("F", 0, 0), np.ones(1 << 16, np.float32))])
        assert attached == [] and errors.empty()
        links.close()
    finally:
        lis.close()


def test_a_bad_frame_from_an_authenticated_peer_is_reported_and_its_connection_dropped():
    token = b"z" * peers.TOKEN_BYTES
    lis, inbox, _, errors = _listener(token)
    try:
        with socket.create_connection(lis.address) as s:
            s.sendall(peers.MAGIC + token + _header([0, [["F", 0, 0, ["x", 0]]], []]))
            waiting, got = _taking(inbox, 0, ("F", 0, 0))  # the waiting thread reads the frame
            assert isinstance(errors.get(timeout=10), wire.BadFrame)
            assert s.recv(1) == b""  # dropped
        inbox.abort(0)
        assert got.get(timeout=10) is None
    finally:
        lis.close()
        inbox.close()


def test_a_value_from_a_ray_call_or_an_abort_wakes_a_take_reading_the_sockets():
    token = b"w" * peers.TOKEN_BYTES
    lis, inbox, attached, _ = _listener(token)
    links = peers.Links([lis.address], token, me=1)
    try:
        for _ in range(1000):  # the connection is attached: the take below waits reading it
            if attached:
                break
            threading.Event().wait(0.01)
        _, got = _taking(inbox, 2, ("B", 0, 1))
        inbox.put(2, [(("B", 0, 1), "by Ray")])  # as StageActor.deliver puts it
        assert got.get(timeout=10) == "by Ray"
        _, got = _taking(inbox, 2, ("B", 1, 1))
        inbox.abort(2)
        assert got.get(timeout=10) is None
    finally:
        links.close()
        lis.close()
        inbox.close()


def test_a_sender_blocked_on_a_full_connection_is_released_by_the_next_take():
    """Nothing reads a connection while no thread waits: frames larger than the socket's buffers block their
    sender until the receiver takes, and every value still arrives, in order, to two threads taking."""
    token = b"f" * peers.TOKEN_BYTES
    lis, inbox, _, errors = _listener(token)
    links = peers.Links([lis.address], token, me=1)
    values = [np.full(4 << 20, i, np.float32) for i in range(3)]  # 16 MiB each
    sending = threading.Thread(
        target=lambda: [links.send(0, 7, [(("F", i, 0), v)]) for i, v in enumerate(values)], daemon=True
    )
    try:
        sending.start()
        sending.join(0.5)
        assert sending.is_alive()  # blocked: nobody reads
        first, got_first = _taking(inbox, 7, ("F", 0, 0))
        last, got_last = _taking(inbox, 7, ("F", 2, 0))
        np.testing.assert_array_equal(got_last.get(timeout=30), values[2])
        np.testing.assert_array_equal(got_first.get(timeout=30), values[0])
        np.testing.assert_array_equal(inbox.take(7, ("F", 1, 0)), values[1])
        sending.join(10)
        assert not sending.is_alive() and errors.empty()
    finally:
        links.close()
        lis.close()
        inbox.close()


def test_the_transport_variable_takes_socket_or_ray_and_names_anything_else(monkeypatch):
    monkeypatch.delenv(config.RAY_TRANSPORT, raising=False)
    assert config.ray_transport() == "socket"
    monkeypatch.setenv(config.RAY_TRANSPORT, " Ray ")
    assert config.ray_transport() == "ray"
    monkeypatch.setenv(config.RAY_TRANSPORT, "grpc")
    with pytest.raises(VjpsplitError, match="VJPSPLIT_RAY_TRANSPORT='grpc' is not one of socket, ray"):
        config.ray_transport()


def test_a_report_of_numbers_reaches_the_drivers_desk_and_others_stay_with_ray():
    """``reports``: a step's losses, aux leaves and squared norms go as one frame to the driver's socket and come back as
    the report Ray would have returned (no events, phases or error); a report with an error, timings or a
    failed stage's None is not framed; frames of earlier steps are dropped; a peer without the token is not
    read."""
    from vjpsplit_cli.pipeline.runtime.ray import reports

    token = b"k" * peers.TOKEN_BYTES
    desk = reports.ReportDesk(token, "127.0.0.1")
    aux = {0: [np.float32(0.5), np.arange(3, dtype=np.int32)], 1: [np.float32(0.25), np.zeros(3, np.int32)]}
    report = {
        "losses": {0: 1.5, 1: np.float32(2.25)},
        "aux": aux,
        "sums": {3: 4.0},
        "events": [],
        "phases": [],
        "error": None,
    }
    assert reports.as_frame(1, {**report, "error": ValueError("x")}) is None
    assert reports.as_frame(1, {**report, "events": ["an event"]}) is None
    assert reports.as_frame(1, {**report, "sums": {3: None}}) is None
    stranger = socket.create_connection(desk.address)
    stranger.sendall(peers.MAGIC + b"x" * peers.TOKEN_BYTES + wire_frame(7, reports.as_frame(0, report)))
    links = peers.Links([desk.address], token, -1)
    try:
        links.send(0, 6, reports.as_frame(1, report))  # an earlier step's, left over
        links.send(0, 7, reports.as_frame(1, report))
        got = None
        for _ in range(500):
            got = desk.take(7, 1)
            if got is not None:
                break
            desk.wait(7, (1,), 0.01)
        got_aux = got.pop("aux")
        assert got == {"losses": {0: 1.5, 1: 2.25}, "sums": {3: 4.0}, "events": [], "phases": [], "error": None}
        assert type(got["losses"][1]) is float and desk.received == 1
        assert list(got_aux) == [0, 1] and all(len(got_aux[m]) == 2 for m in aux)
        for m in aux:
            for g, w in zip(got_aux[m], aux[m]):
                assert g.dtype == np.asarray(w).dtype and np.array_equal(g, w)
        assert desk.take(6, 1) is None and desk.take(7, 0) is None  # dropped; the stranger's never read
        links.send(0, 8, reports.as_frame(1, report))
        desk.wait(8, (0, 1), 30.0)  # returns once worker 1's frame is here (the condition, not the timeout)
        assert desk.take(8, 1) is not None and desk.received == 2
    finally:
        links.close()
        stranger.close()
        desk.close()


def wire_frame(step, items):
    return b"".join(bytes(b) for b in wire.encode(step, items))


class _Calls:
    """A stand-in for the ``ray`` module over calls that all returned ``SENT`` (the driver's side of a step)."""

    class exceptions:
        RayError = RuntimeError

    def wait(self, refs, num_returns, timeout, fetch_local):
        return list(refs[:num_returns]), list(refs[num_returns:])

    def get(self, refs):
        from vjpsplit_cli.pipeline.runtime.ray import reports

        return [reports.SENT] * len(refs)


class _Desk:
    """A ``ReportDesk`` whose frame for worker 1 comes on its ``arrives``-th look (never: None)."""

    def __init__(self, arrives):
        self.arrives, self.looks = arrives, 0

    def take(self, step, worker):
        if worker == 0:
            return {"losses": {}, "sums": {0: 1.0}}
        self.looks += 1
        return {"losses": {0: 2.0}, "sums": {1: 3.0}} if self.arrives and self.looks >= self.arrives else None

    def wait(self, step, workers, timeout):
        pass


def _runner(desk):
    from vjpsplit_cli.pipeline.runtime.ray import reports
    from vjpsplit_cli.pipeline.runtime.ray.pipeline import RayPipeline
    from vjpsplit_cli.pipeline.schedules.layout import Layout

    g = object.__new__(RayPipeline)
    g.reports, g.steps, g.step_timeout, g.ray = desk, 1, 600.0, _Calls()
    g.layout = Layout.of("stage", 2)
    g.fetch = lambda refs, owners, t0, hint="", watch=(): [reports.SENT] * len(refs)
    return g


def test_a_report_frame_late_after_its_call_is_taken_and_one_lost_is_named_within_the_grace(monkeypatch):
    """``fetch_reports``: every call said SENT; a frame still on its way is waited for, and one that never comes
    is one error naming its stage once ``REPORT_GRACE`` has passed, not the step's timeout (600 s here)."""
    import time

    from vjpsplit_cli.pipeline.runtime.ray import pipeline

    monkeypatch.setattr(pipeline, "REPORT_GRACE", 0.2)
    late = _Desk(arrives=5)
    got = _runner(late).fetch_reports(["ref 0", "ref 1"], [0, 1], time.monotonic())
    assert got == [{"losses": {}, "sums": {0: 1.0}}, {"losses": {0: 2.0}, "sums": {1: 3.0}}] and late.looks == 5
    t0 = time.monotonic()
    with pytest.raises(VjpsplitError, match=r"^stage 1: its report was lost on the way$"):
        _runner(_Desk(arrives=None)).fetch_reports(["ref 0", "ref 1"], [0, 1], t0)
    assert time.monotonic() - t0 < 60  # the grace (0.2 s here), far from the step's 600 s
