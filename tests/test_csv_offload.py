"""A CSV schedule of plans that offload: torch's reader reads the same actions as for the plans without offload, and
vjpsplit reads back which pairs they offload (from the file beside it, or an older version's ``# offload:`` line)."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re

import pytest

from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.pipeline.schedules.auto import auto_schedule
from vjpsplit_cli.pipeline.schedules.csvformat import format_schedule
from vjpsplit_cli.pipeline.schedules.offloading import OffloadPlans

UNIT = {"F": 1.0, "B": 1.0, "W": 0.8, "comm": 0.1}

# torch.distributed.pipelining.schedules, re-implemented (torch is not a dependency): its action regex, matched at the
# start of a stripped cell (re.match, not fullmatch), and _load_csv's loop, which makes a rank of every row that
# csv.reader yields; _validate_schedule then needs exactly one row per rank.
_TORCH_ACTION = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")
_TORCH_TYPES = {
    "F",
    "I",
    "W",
    "UNSHARD",
    "RESHARD",
    "SEND_F",
    "RECV_F",
    "SEND_B",
    "RECV_B",
    "B",
    "OVERLAP_F_B",
    "REDUCE_GRAD",
}


def _torch_type(text):
    if text not in _TORCH_TYPES:
        raise RuntimeError(f"Invalid computation type {text}")
    return text


def _torch_action(cell):
    """torch's ``_Action.from_str``, as (stage, type, microbatch, sub_actions) tuples; None for an idle step."""
    cell = cell.strip()
    if cell == "":
        return None
    if cell.startswith("(") and ")" in cell:
        end = cell.find(")")
        inner = cell[1:end]
        subs = []
        if inner.strip():
            for part in inner.split(";"):
                sub = _torch_action(part.strip())
                if sub is not None:
                    subs.append(sub)
        return (-1, _torch_type(cell[end + 1 :]), None, tuple(subs) if subs else None)
    m = _TORCH_ACTION.match(cell)
    if m:
        stage, kind, mb = m.groups()
        return (int(stage), _torch_type(kind), int(mb) if len(mb) else None, None)
    raise RuntimeError(f"Invalid action string: {cell}, should be formatted as [stage][action type][(microbatch)]")


def torch_load_csv(path, ranks):
    """torch's ``PipelineScheduleMulti._load_csv`` (format ``compute_only``) and its rank-count check."""
    order = {}
    with open(path, newline="") as f:
        for rank, row in enumerate(csv.reader(f)):
            order[rank] = [_torch_action(s) for s in row]
    if len(order) != ranks:
        raise AssertionError(f"Schedule has incorrect number of ranks - expected {ranks}, actual {len(order)}")
    return order


def _offloading():
    plans = auto_schedule(4, 8, costs={**UNIT, "transfer": 1000.0}, memory_limit_bytes=250, microbatch_bytes=[100] * 4)
    assert plans.offloaded
    return plans


def test_torch_reads_an_offloading_plans_csv_as_the_same_plans_without_offload(tmp_path):
    plans = _offloading()
    P.write_schedule(tmp_path / "off.csv", plans)
    P.write_schedule(tmp_path / "plain.csv", [list(ops) for ops in plans])
    assert (tmp_path / "off.csv").read_bytes() == (tmp_path / "plain.csv").read_bytes()
    got, want = torch_load_csv(tmp_path / "off.csv", 4), torch_load_csv(tmp_path / "plain.csv", 4)
    assert got == want
    # The actions torch runs are the plans' own, in order (vjpsplit's B is torch's I where a W follows).
    split = {(o.stage, o.mb) for ops in plans for o in ops if o.kind == P.Kind.W}
    for r, ops in enumerate(plans):
        kinds = ["I" if o.kind == P.Kind.B and (o.stage, o.mb) in split else o.kind.value for o in ops]
        assert got[r] == [(o.stage, k, o.mb, None) for o, k in zip(ops, kinds)]
    assert sorted(os.listdir(tmp_path)) == ["off.csv", "off.csv.offload.json", "plain.csv"]


def test_the_older_comment_line_breaks_torchs_reader(tmp_path):
    """Why the pairs left the CSV: torch makes the comment a rank and fails on it."""
    plans = _offloading()
    P.write_schedule(tmp_path / "a.csv", [list(ops) for ops in plans])
    with open(tmp_path / "a.csv", "a") as f:
        f.write("# offload: 0:0\n")
    with pytest.raises(RuntimeError, match="Invalid action string: # offload: 0:0"):
        torch_load_csv(tmp_path / "a.csv", 4)


def test_offloaded_pairs_round_trip_through_the_file_beside_the_csv(tmp_path):
    plans = _offloading()
    P.write_schedule(tmp_path / "a.csv", plans)
    record = json.loads((tmp_path / "a.csv.offload.json").read_text())
    assert record["offload"] == [list(p) for p in sorted(plans.offloaded)] and record["schedule"] == "a.csv"
    back = P.read_schedule(tmp_path / "a.csv")
    assert back == plans and isinstance(back, OffloadPlans) and back.offloaded == plans.offloaded
    P.write_schedule(tmp_path / "b.csv", back)
    assert (tmp_path / "b.csv").read_bytes() == (tmp_path / "a.csv").read_bytes()
    side = json.loads((tmp_path / "b.csv.offload.json").read_text())
    assert {**side, "schedule": "a.csv"} == record
    # The CSV alone (torch's file, copied without its companion) is the plans without offload.
    (tmp_path / "c.csv").write_bytes((tmp_path / "a.csv").read_bytes())
    plain = P.read_schedule(tmp_path / "c.csv")
    assert plain == plans and not hasattr(plain, "offloaded")


def test_writing_plans_without_offload_removes_the_old_offload_file(tmp_path):
    path = tmp_path / "a.csv"
    P.write_schedule(path, _offloading())
    assert (tmp_path / "a.csv.offload.json").exists()
    P.write_schedule(path, P.schedule("1f1b", 4, 8))
    assert not (tmp_path / "a.csv.offload.json").exists()
    back = P.read_schedule(path)
    assert back == P.schedule("1f1b", 4, 8) and not hasattr(back, "offloaded")


def test_an_older_csv_with_the_offload_comment_line_is_still_read(tmp_path):
    plans = _offloading()
    rows = format_schedule(plans)
    marks = " ".join(f"{s}:{m}" for s, m in sorted(plans.offloaded))
    (tmp_path / "old.csv").write_text(rows + f"# offload: {marks}\n")
    back = P.read_schedule(tmp_path / "old.csv")
    assert back == plans and back.offloaded == plans.offloaded
    # Written again, it is torch's CSV and the file beside it.
    P.write_schedule(tmp_path / "new.csv", back)
    assert (tmp_path / "new.csv").read_text() == rows
    assert P.read_schedule(tmp_path / "new.csv").offloaded == plans.offloaded


def _edit(path, **changes):
    record = json.loads(path.read_text())
    record.update(changes)
    path.write_text(json.dumps(record))


@pytest.mark.parametrize(
    "damage,match",
    [
        ("csv", r"a\.csv\.offload\.json: written for another CSV \(the CSV's SHA-256 differs"),
        ("json", r"a\.csv\.offload\.json: not an offload file \(not JSON"),
        ("format", r"a\.csv\.offload\.json: not an offload file \(no \"format\""),
        ("version", r"a\.csv\.offload\.json: offload file version 2; this vjpsplit reads version 1"),
        ("pairs", r"a\.csv\.offload\.json: \"offload\" must be a list of \[stage, microbatch\] pairs"),
        ("unknown", r"a\.csv\.offload\.json: offloads stage 9 microbatch 0, which the plans have no forward of"),
        ("both", r"a\.csv\.offload\.json: names other pairs than the '# offload:' line"),
    ],
)
def test_a_damaged_or_foreign_offload_file_is_one_clear_error(tmp_path, damage, match):
    path, side = tmp_path / "a.csv", tmp_path / "a.csv.offload.json"
    P.write_schedule(path, _offloading())
    if damage == "csv":
        P.write_schedule(tmp_path / "other.csv", P.schedule("1f1b", 4, 8))
        path.write_bytes((tmp_path / "other.csv").read_bytes())
    elif damage == "json":
        side.write_text(side.read_text()[:-5])
    elif damage == "format":
        _edit(side, format="something else")
    elif damage == "version":
        _edit(side, version=2)
    elif damage == "pairs":
        _edit(side, offload=[[0, -1]])
    elif damage == "unknown":
        text = path.read_bytes()
        _edit(side, offload=[[9, 0]])
        assert path.read_bytes() == text
    else:
        with open(path, "a") as f:
            f.write("# offload: 0:0\n")
        _edit(side, schedule_sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    with pytest.raises(VjpsplitError, match=match):
        P.read_schedule(path)


def test_an_offload_line_naming_a_pair_the_plans_lack_is_one_clear_error(tmp_path):
    (tmp_path / "a.csv").write_text("0F0,0B0\n# offload: 0:3\n")
    with pytest.raises(
        VjpsplitError, match=r"the offload line: offloads stage 0 microbatch 3, which the plans have no"
    ):
        P.read_schedule(tmp_path / "a.csv")
