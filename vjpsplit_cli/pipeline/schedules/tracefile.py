"""A timed step as a trace file in the Chrome/Perfetto trace-event JSON format, and the file read back.

The file (``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``)
opens in Perfetto's UI (ui.perfetto.dev), ``chrome://tracing`` and XProf's
(TensorBoard's) trace viewer. One process, one track (``tid``) per worker
(``tid`` = worker + 1) and the driver's own (``tid`` 0); a sharded stage's
operations are drawn again on a track per device of its mesh, and on a stage with
replicas (``data_parallel``) each replica's on its device's track; replica r >= 1 of
a worker has a worker-level track of its own (``REPLICA_TRACKS``), as its copies run
at the same time as replica 0's, which are on the worker's. Each operation is
a complete slice (``ph: "X"``) named ``I s1 mb3`` (kind, stage, microbatch, as
``timeline.op_name`` and each operation's ``jax.profiler.TraceAnnotation`` name
it; replica 1's copy ``I s1 mb3 r1``), its category its kind (``F``, ``B``, ``I`` or
``W``: ``ops.Kind``); each value one worker sends another (F's activation to the
next stage, a B's or I's cotangent to the one before; replica r's to replica r)
is a flow (``ph: "s"`` in the
producing slice, ``ph: "f"`` with ``bp: "e"`` at the start of the consuming one,
one ``id`` per pair); the driver's phases and each worker's reductions and
optimizer update are slices of category ``driver``, ``reduce`` (a stage's
cross-replica reduction among them, ``reduce replicas``) and ``update``.
Timestamps and durations are microseconds since the step's first one, to the
nanosecond (each span's two ends rounded to whole nanoseconds, its duration their
difference, so spans that touch never overlap), on the driver's clock (``time.monotonic``; the Ray runner moves each actor's onto it by
the offset it measured); ``otherData.origin_s`` is that first time.

``read_trace`` gives back the events and phases, so ``plots.plot_timeline`` draws
a step from its file. Reading parses JSON and checks each field; nothing is evaluated.
Files written before ``Kind.I`` named a split backward's input part ``B``: read, a
``B`` with a ``W`` of the same stage and microbatch is that ``I``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import BinaryIO, Mapping, Sequence, TypeVar

from ...errors import VjpsplitError
from ...safeio.outputs import atomic_write
from ...treetypes import JSON, JSONObject
from .ops import BACKWARDS, Kind
from .timeline import Event, Phase, op_name

T = TypeVar("T")

PID = 1
DRIVER = 0  # the driver's track; worker w's is w + 1
DEVICE_TRACKS = 1000  # a sharded stage's per-device tracks: DEVICE_TRACKS + 100 * worker + i
# Replica r >= 1 of a worker's stages (data_parallel): a worker-level track of its own, numbered from REPLICA_TRACKS
# in (worker, replica) order (replica 0's is the worker's): the replicas run at once on their devices, and one
# track's slices must nest.
REPLICA_TRACKS = 500
Tracks = Mapping[tuple[int, int], int]  # (worker, replica) -> its track, for replicas >= 1


def _replica_tracks(events: Sequence[Event]) -> dict[tuple[int, int], int]:
    """The track of each replica >= 1 of a worker that ran in ``events``."""
    held = sorted({(e.worker, e.replica) for e in events if e.replica})
    return {wr: REPLICA_TRACKS + i for i, wr in enumerate(held)}


def _track(e: Event, replicas: Tracks) -> int:
    """The worker-level track of operation ``e`` (of its replica's, ``_replica_tracks``)."""
    return replicas.get((e.worker, e.replica), e.worker + 1) if e.replica else e.worker + 1


_KINDS = {str(k) for k in Kind}


@dataclass(frozen=True)
class Trace:
    """A trace file read back: its operations as ``Event``s and its other slices as ``Phase``s (seconds on the
    step's clock), and how many workers it draws."""

    events: list[Event]
    phases: list[Phase]
    num_workers: int


def _phase_category(p: Phase) -> str:
    if p.worker is None:
        return "driver"
    return "reduce" if p.name.startswith("reduce") else "update"


def _consumer(e: Event, num_stages: int) -> tuple[bool, int, int, int | None] | None:
    """The operation that takes ``e``'s result from another stage: (is a backward, stage, mb, replica), or None."""
    if e.kind == Kind.F and e.stage < num_stages - 1:
        return (False, e.stage + 1, e.mb, e.replica)
    if e.kind in BACKWARDS and e.stage > 0:
        return (True, e.stage - 1, e.mb, e.replica)
    return None


def _nanos(t: float, origin: float) -> int:
    """``t`` as whole nanoseconds since ``origin``."""
    return round((t - origin) * 1e9)


def _micros(t: float, origin: float) -> float:
    """``t`` as microseconds since ``origin``, to the nanosecond."""
    return _nanos(t, origin) / 1e3


def _span(start: float, end: float, origin: float) -> tuple[float, float]:
    """A span's ``ts`` and ``dur`` in microseconds, to the nanosecond: both ends rounded to whole nanoseconds
    on the one clock, then the length is their difference, so a span that ends where the next begins does
    not overlap it (rounding start and length apart put one end a nanosecond past the other's start)."""
    a, b = _nanos(start, origin), _nanos(end, origin)
    return a / 1e3, (b - a) / 1e3


def _thread(tid: int, name: str, sort_index: int) -> list[dict[str, object]]:
    """The metadata that names track ``tid`` and places it in the viewer's order."""
    return [
        {"ph": "M", "name": "thread_name", "pid": PID, "tid": tid, "args": {"name": name}},
        {"ph": "M", "name": "thread_sort_index", "pid": PID, "tid": tid, "args": {"sort_index": sort_index}},
    ]


def _worker_tracks(events: Sequence[Event], num_workers: int, replicas: Tracks) -> list[dict[str, object]]:
    """Each worker's track's metadata, named by the stages it ran."""
    held: dict[int, set[int]] = {}
    for e in events:
        held.setdefault(e.worker, set()).add(e.stage)
    out: list[dict[str, object]] = []
    for w in range(num_workers):
        stages = ", ".join(map(str, sorted(held.get(w, ())))) or "none"
        out += _thread(w + 1, f"worker {w} (stages {stages})", w + 1)
    for (w, r), tid in replicas.items():
        out += _thread(tid, f"worker {w} replica {r}", tid)
    return out


def _device_tracks(
    events: Sequence[Event], devices: Mapping[int, Sequence[str]]
) -> tuple[dict[int, list[int]], list[dict[str, object]]]:
    """A sharded stage's, or a stage with replicas', per-device tracks (by stage, their ``tid``s; a stage with
    replicas: in replica order) and their metadata."""
    tracks: dict[int, list[int]] = {}
    out: list[dict[str, object]] = []
    for s, names in sorted(devices.items()):
        if len(names) < 2:
            continue
        on = [e for e in events if e.stage == s]
        if not on:
            continue
        w, replicas = on[0].worker, on[0].replica is not None
        tids = [DEVICE_TRACKS + 100 * w + len(tracks) * 10 + i for i in range(len(names))]
        tracks[s] = tids
        for i, (tid, name) in enumerate(zip(tids, names)):
            out += _thread(tid, f"worker {w} stage {s}{f' replica {i}' if replicas else ''} {name}", tid)
    return tracks, out


def _op_slices(
    events: Sequence[Event], device_tracks: Mapping[int, Sequence[int]], replicas: Tracks, origin: float
) -> list[dict[str, object]]:
    """Each operation's slice on its worker's track (replica r >= 1's: its own, ``replicas``) and again on its
    stage's device tracks (a replica's copy: on its own device's)."""
    out: list[dict[str, object]] = []
    for e in events:
        args: dict[str, object] = {"kind": str(e.kind), "stage": e.stage, "mb": e.mb, "worker": e.worker}
        on = device_tracks.get(e.stage, [])
        if e.replica is not None:
            args["replica"] = e.replica
            on = on[e.replica : e.replica + 1]
        ts, dur = _span(e.start, e.end, origin)
        for tid in [_track(e, replicas), *on]:
            out.append(
                {
                    "ph": "X",
                    "name": op_name(e.kind, e.stage, e.mb, e.replica),
                    "cat": str(e.kind),
                    "pid": PID,
                    "tid": tid,
                    "ts": ts,
                    "dur": dur,
                    "args": args,
                }
            )
    return out


def _phase_slices(phases: Sequence[Phase], events: Sequence[Event], origin: float) -> list[dict[str, object]]:
    """Each driver phase's, reduction's and update's slice on its track. A worker's phase is marked by the step's
    thread, which may hand out a stage's update while the worker's last operation still runs on its device (a
    timed step's operations end when their results exist): it starts once the worker's operations that began
    before it ended, as it runs on the device, so that the slices of a track nest or are apart."""
    spans: dict[int, list[tuple[float, float]]] = {}  # each worker's operations' (start, end)
    for e in events:
        spans.setdefault(e.worker, []).append((e.start, e.end))
    out: list[dict[str, object]] = []
    for p in phases:
        start = p.start
        if p.worker is not None:
            start = max([start, *(b for a, b in spans.get(p.worker, []) if a < p.start)])
        ts, dur = _span(start, max(p.end, start), origin)
        out.append(
            {
                "ph": "X",
                "name": p.name,
                "cat": _phase_category(p),
                "pid": PID,
                "tid": DRIVER if p.worker is None else p.worker + 1,
                "ts": ts,
                "dur": dur,
                "args": {"worker": p.worker},
            }
        )
    return out


def _flows(events: Sequence[Event], num_stages: int, replicas: Tracks, origin: float) -> list[dict[str, object]]:
    """A flow (start and finish) for each value one worker sends another, one ``id`` per pair."""
    by_op = {(e.kind in BACKWARDS, e.stage, e.mb, e.replica): e for e in events if e.kind != Kind.W}
    forwards = {(e.stage, e.mb, e.replica): e for e in events if e.kind == Kind.F}
    out: list[dict[str, object]] = []
    flow = 0
    for e in events:
        key = _consumer(e, num_stages)
        c = by_op.get(key) if key is not None else None
        if c is None or c.worker == e.worker:  # a V's two stages on one worker: nothing is sent
            continue
        flow += 1
        name = "activation" if e.kind == Kind.F else "cotangent"
        if e.kind in (Kind.B, Kind.I) and e.own == 0.0 and e.end == e.start:  # a B or I its F ran: from that F
            e = forwards.get((e.stage, e.mb, e.replica), e)
        out.append(
            {
                "ph": "s",
                "id": flow,
                "name": name,
                "cat": "send",
                "pid": PID,
                "tid": _track(e, replicas),
                "ts": (_nanos(e.start, origin) + _nanos(e.end, origin)) // 2 / 1e3,  # the middle of its slice
            }
        )
        out.append(
            {
                "ph": "f",
                "bp": "e",
                "id": flow,
                "name": name,
                "cat": "send",
                "pid": PID,
                "tid": _track(c, replicas),
                "ts": _micros(c.start, origin),
            }
        )
    return out


def trace_events(
    events: Sequence[Event],
    phases: Sequence[Phase],
    num_workers: int,
    num_stages: int,
    *,
    title: str = "vjpsplit step",
    devices: Mapping[int, Sequence[str]] | None = None,
    meta: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """The trace document of one timed step (see the module).

    Args:
        events: the step's operations (``PipelineResult.events``).
        phases: its other spans (``PipelineResult.phases``).
        num_workers: how many workers ran it (one track each).
        num_stages: the pipeline's stages (what tells a send from a loss).
        title: the process's name in the viewer.
        devices: per stage, its devices' names; a stage with more than one (sharded) gets a track per device.
        meta: more entries for ``otherData`` (schedule, runner, ...).

    Returns:
        The JSON-ready document.
    """
    times = [e.start for e in events] + [p.start for p in phases]
    origin = min(times) if times else 0.0
    device_tracks, device_names = _device_tracks(events, devices or {})
    replicas = _replica_tracks(events)
    out: list[dict[str, object]] = [
        {"ph": "M", "name": "process_name", "pid": PID, "tid": DRIVER, "args": {"name": title}},
        *_thread(DRIVER, "driver", 0),
        *_worker_tracks(events, num_workers, replicas),
        *device_names,
        *_op_slices(events, device_tracks, replicas, origin),
        *_phase_slices(phases, events, origin),
        *_flows(events, num_stages, replicas, origin),
    ]
    other = {
        "origin_s": origin,
        "clock": "the driver's time.monotonic",
        "num_workers": num_workers,
        "num_stages": num_stages,
    }
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {**other, **dict(meta or {})}}


def write_trace(path: str | os.PathLike[str], document: Mapping[str, object]) -> None:
    """Write ``document`` (``trace_events``) to ``path`` as JSON, whole or not at all.

    Args:
        path: the file to write (``.json``; Perfetto and ``chrome://tracing`` open it as it is).
        document: the trace document.

    Raises:
        VjpsplitError: the file could not be written (naming it).
    """
    body = json.dumps(document, separators=(",", ":")).encode()

    def write(f: BinaryIO) -> None:
        f.write(body)

    atomic_write(path, write)


def _field(ev: Mapping[str, JSON], name: str, kind: type[T] | tuple[type[T], ...], where: str) -> T:
    value = ev.get(name)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise VjpsplitError(f"{where}: field {name!r} is {value!r}; a vjpsplit trace file has a number or name there")
    return value


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """A trace file ``write_trace`` wrote, as events and phases (seconds on the step's clock).

    Args:
        path: the trace file.

    Returns:
        Its ``Trace``: the operations (slices of category F, B, I or W on a worker's track, with their replica;
        a sharded stage's per-device copies are read once; an older file's B with a W is read as I), the other
        slices, and the number of workers.

    Raises:
        VjpsplitError: the file is missing, not JSON, or not a trace of a vjpsplit step (naming what is wrong).
    """
    text = os.fspath(path)
    try:
        with open(text, "rb") as f:
            doc = json.loads(f.read())
    except OSError as e:
        raise VjpsplitError(f"{text}: cannot read the trace file ({e.strerror or e})") from e
    except ValueError as e:
        raise VjpsplitError(f"{text}: not a JSON trace file ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise VjpsplitError(f"{text}: not a trace-event file (no traceEvents list)")
    found = doc.get("otherData")
    other: JSONObject = found if isinstance(found, dict) else {}
    origin = other.get("origin_s", 0.0)
    if isinstance(origin, bool) or not isinstance(origin, (int, float)):
        raise VjpsplitError(f"{text}: otherData.origin_s is {origin!r}; expected seconds")
    events, phases, workers = [], [], 0
    for i, ev in enumerate(doc["traceEvents"]):
        where = f"{text}: traceEvents[{i}]"
        if not isinstance(ev, dict):
            raise VjpsplitError(f"{where}: not an object")
        tid = ev.get("tid")
        if (
            ev.get("ph") == "M"
            and ev.get("name") == "thread_name"
            and isinstance(tid, int)
            and 0 < tid < REPLICA_TRACKS
        ):
            workers = max(workers, tid)
        if ev.get("ph") != "X":
            continue
        tid = _field(ev, "tid", int, where)
        start = origin + _field(ev, "ts", (int, float), where) / 1e6
        end = start + _field(ev, "dur", (int, float), where) / 1e6
        if tid >= DEVICE_TRACKS:
            continue  # a sharded stage's copy on one of its devices
        if ev.get("cat") in _KINDS:
            args = ev.get("args")
            if not isinstance(args, dict):
                raise VjpsplitError(f"{where}: an operation's slice without args")
            stage, mb = _field(args, "stage", int, where), _field(args, "mb", int, where)
            replica = _field(args, "replica", int, where) if "replica" in args else None
            worker = _field(args, "worker", int, where) if "worker" in args else tid - 1  # a replica's own track
            events.append(Event(worker, str(ev["cat"]), mb, start, end, stage, replica=replica))
        else:
            name = _field(ev, "name", str, where)
            phases.append(Phase(None if tid == DRIVER else tid - 1, name, start, end))
    # Before Kind.I a split backward's input part was a "B" with a "W" of its stage and microbatch: it is that I.
    split = {(e.stage, e.mb) for e in events if e.kind == Kind.W}
    events = [
        dataclasses.replace(e, kind=str(Kind.I)) if e.kind == Kind.B and (e.stage, e.mb) in split else e for e in events
    ]
    n = other.get("num_workers", workers)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise VjpsplitError(f"{text}: otherData.num_workers is {n!r}; expected a count")
    return Trace(sorted(events, key=lambda e: e.start), sorted(phases, key=lambda p: p.start), n)
