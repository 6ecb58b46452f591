"""A trace file held to the Chrome trace-event format, field by field: what a viewer needs to draw it."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

PHASES = {"X", "M", "s", "f"}  # complete slices, metadata, flow starts and ends: all a vjpsplit trace uses


def check_trace_file(path):
    """Parse ``path`` and check every event; returns the document. Fails (AssertionError) naming the event."""
    doc = json.loads(open(path, "rb").read())
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list), "a JSON object with a traceEvents list"
    assert doc.get("displayTimeUnit") in ("ms", "ns")
    slices = defaultdict(list)  # by (pid, tid)
    flows = defaultdict(list)
    for i, ev in enumerate(doc["traceEvents"]):
        where = f"traceEvents[{i}] {ev}"
        assert ev["ph"] in PHASES, where
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int), where
        assert isinstance(ev["name"], str) and ev["name"], where
        if ev["ph"] == "M":
            assert ev["name"] in ("process_name", "thread_name", "thread_sort_index"), where
            assert isinstance(ev["args"], dict), where
            continue
        # Microsecond timestamps: numbers from the step's start, a step of seconds at most (not ns, not s).
        assert isinstance(ev["ts"], (int, float)) and not isinstance(ev["ts"], bool), where
        assert 0 <= ev["ts"] < 3600e6, where
        if ev["ph"] == "X":
            assert isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0, where
            assert isinstance(ev.get("cat", ""), str), where
            start = round(ev["ts"] * 1e3)  # whole ns: a 1 ns overlap is one, as strict validators see it
            slices[(ev["pid"], ev["tid"])].append((start, start + round(ev["dur"] * 1e3), ev))
        else:
            assert isinstance(ev["id"], int), where
            if ev["ph"] == "f":
                assert ev.get("bp") == "e", where  # binds to the enclosing slice
            flows[ev["id"]].append(ev)
    for track, spans in slices.items():
        stack = []  # slices on one track are disjoint or nested, to the nanosecond
        for a, b, ev in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= a:
                stack.pop()
            if stack:
                assert b <= stack[-1][1], f"track {track}: {ev} overlaps {stack[-1][2]} without nesting in it"
            stack.append((a, b, ev))
    for fid, pair in flows.items():
        kinds = Counter(e["ph"] for e in pair)
        assert kinds == {"s": 1, "f": 1}, f"flow {fid}: {pair}"
        for e in pair:  # each end lies in a slice of its track
            on, at = slices[(e["pid"], e["tid"])], round(e["ts"] * 1e3)
            assert any(a <= at <= b for a, b, _ in on), f"flow {fid}'s {e['ph']} is in no slice"
    return doc


def op_slices(doc):
    """The operations' slices of the workers' tracks (not the per-device copies): ``{name: event}``."""
    return {
        ev["name"]: ev
        for ev in doc["traceEvents"]
        if ev["ph"] == "X" and ev.get("cat") in ("F", "B", "I", "W") and 0 < ev["tid"] < 1000
    }


def flow_pairs(doc):
    """Each flow as (producing slice's name, consuming slice's name)."""
    by_track = defaultdict(list)
    for ev in doc["traceEvents"]:
        if ev["ph"] == "X" and ev.get("cat") in ("F", "B", "I", "W"):
            by_track[ev["tid"]].append(ev)
    ends = defaultdict(dict)
    for ev in doc["traceEvents"]:
        if ev["ph"] in ("s", "f"):
            if ev["ph"] == "f":  # at the start of the slice it flows into (never the B of no time its F ran,
                # which may end where the next operation starts: it reads no value)
                (hit,) = [x for x in by_track[ev["tid"]] if abs(x["ts"] - ev["ts"]) <= 1e-3 and x["dur"] > 0]
            else:  # in the middle of the slice it flows from (a worker's track holds its replicas' side by side)
                inside = [x for x in by_track[ev["tid"]] if x["ts"] < ev["ts"] < x["ts"] + x["dur"]]
                middle = [x for x in inside if abs(x["ts"] + x["dur"] / 2 - ev["ts"]) <= 1e-3]
                (hit,) = middle if len(inside) > 1 else inside
            ends[ev["id"]][ev["ph"]] = hit["name"]
    return sorted((e["s"], e["f"]) for e in ends.values())
