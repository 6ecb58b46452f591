"""A timed step's watcher: a ``Lane`` per device, whose thread times its operations in dispatch order.

A worker of a timed step in-process (``timed.Timeline``) hands each operation it
dispatches to its devices' ``Lane``; ``watch_lane`` (the lane's thread) waits for the
operations' results one after another and records each one's ``Event``: it starts at
the latest of its dispatch, the end of the lane's operation before it and its inputs'
existence, and ends when its results exist. A call its dispatch waited for (cold, or
the last stage's B its F ran) comes with its span.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from typing import Callable, Sequence

import jax

from ...files.prng import is_ready
from ..schedules.timeline import Event

Op5 = tuple[int, str, int, int, "int | None"]  # an event's worker, kind, microbatch, stage and replica


class Watched:
    """One operation for its lane's watcher: where its ``Event`` goes and what it is, when its dispatch began,
    the arrays that say its inputs and its results exist; or, where its call was waited for (cold, or the last
    stage's B that its F ran), its ``span``, which the watcher keeps after the operation before it. With ``split``
    (a step's one program, ``program.StepProgram``) the watcher hands it the call's start and end, and it records
    the events of the operations the call ran."""

    __slots__ = ("events", "worker", "kind", "mb", "stage", "replica", "at", "ins", "outs", "span", "own", "split")

    def __init__(
        self,
        events: list[Event],
        op: Op5,
        at: float,
        ins: tuple[jax.Array, ...] = (),
        outs: tuple[jax.Array, ...] = (),
        span: tuple[float, float] | None = None,
        own: float | None = None,
        split: Callable[[float, float], None] | None = None,
    ):
        self.events = events  # the stage's list of this step (a later step's reset makes a new one)
        self.worker, self.kind, self.mb, self.stage, self.replica = op
        self.at, self.ins, self.outs, self.span, self.own, self.split = at, ins, outs, span, own, split


class Lane:
    """One device's (or one sharded stage's devices') operations of a timed step, in dispatch order."""

    __slots__ = ("queue",)

    def __init__(self) -> None:
        # Operations; an event to set once those before it are recorded (``settle``); None ends the step's watch.
        self.queue: queue.SimpleQueue[Watched | threading.Event | None] = queue.SimpleQueue()

    def watch(self, events: list[Event], op: Op5, at: float, args: Sequence[object], out: object) -> None:
        """An operation dispatched, not waited for: its watcher records its event into ``events``.

        Args:
            events: The stage's events of this step.
            op: Its worker, kind, microbatch, stage and replica (None without).
            at: When its dispatch began (``time.monotonic``).
            args: Its call's inputs.
            out: Its call's results.
        """
        self.queue.put(Watched(events, op, at, first_arrays(args), first_arrays((out,))))

    def watch_program(
        self, at: float, args: Sequence[object], out: object, split: Callable[[float, float], None]
    ) -> None:
        """A call that ran many operations (a step's one program), dispatched, not waited for: its watcher calls
        ``split(start, end)`` with the call's span once its results exist, which records their events.

        Args:
            at: When its dispatch began (``time.monotonic``).
            args: Its call's inputs.
            out: Its call's results.
            split: Records the operations' events from the call's span.
        """
        self.queue.put(Watched([], (0, "", 0, 0, None), at, first_arrays(args), first_arrays((out,)), split=split))

    def settle(self) -> None:
        """Wait until the watcher recorded every operation handed to it so far (before a call that is waited for,
        whose span then starts after theirs)."""
        done = threading.Event()
        self.queue.put(done)
        done.wait()

    def waited(self, events: list[Event], op: Op5, span: tuple[float, float], own: float | None) -> None:
        """An operation its dispatch waited for (a cold call; a B its F ran): its ``span``, kept after the lane's
        operations before it; ``own`` as ``Event.own``."""
        self.queue.put(Watched(events, op, span[0], span=span, own=own))


def watch_lane(lane: Lane) -> None:
    """A lane's watcher for one step: each operation's ``Event`` in dispatch order, until ``None``."""
    prev = began = -math.inf  # the end and the start of the lane's operation before
    while (item := lane.queue.get()) is not None:
        if isinstance(item, threading.Event):
            item.set()
            continue
        try:
            if item.span is not None:  # waited for by its dispatch
                start = max(item.span[0], prev)
                end = max(item.span[1], start)
            else:
                start = max(item.at, prev)
                if not all(is_ready(a) for a in item.ins):
                    jax.block_until_ready(item.ins)
                    start = max(start, time.monotonic())
                jax.block_until_ready(item.outs)
                end = max(time.monotonic(), start)
        except Exception:  # noqa: BLE001 - a failed operation: the step's own wait for its results raises it
            prev = time.monotonic()
            continue
        if start <= began:  # after a B of no time (its F ran it), which ended where this one starts
            start = math.nextafter(began, math.inf)  # its events sort by start in dispatch order
            end = max(end, start)
        prev, began = end, start
        if item.split is not None:
            item.split(start, end)
            continue
        item.events.append(Event(item.worker, item.kind, item.mb, start, end, item.stage, item.own, item.replica))


def first_arrays(args: Sequence[object]) -> tuple[jax.Array, ...]:
    """One array of each of ``args`` (each element of a list or tuple among them): what says each exists (the
    outputs of one execution are ready at once)."""
    out: list[jax.Array] = []
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            out.extend(_first(t))
    return tuple(out)


def _first(tree: object) -> list[jax.Array]:
    t = tree
    while not isinstance(t, jax.Array):
        if isinstance(t, dict) and t:
            t = next(iter(t.values()))
        elif isinstance(t, (list, tuple)) and t:
            t = t[0]
        else:
            return [a for a in jax.tree_util.tree_leaves(tree) if isinstance(a, jax.Array)][:1]
    return [t]
