"""``stages.json`` as typed, frozen data: what each stage of one function holds, reads, receives and sends.

Versions of the index (``version``):

* 1 (2026-12-01, the first stages directory): the function, how it was cut, the
  parameter and batch leaves (key, dtype, shape with symbolic dims as text), and
  per stage its artifact file and fingerprint, the leaf positions it reads, the
  values it receives and sends, its estimated cost and the equation cut after.
* 2 (2026-12-02): per stage also ``evaluation``, its evaluation program's file
  and SHA-256 (``evaluation``: the forward without residuals that
  ``Trainer.evaluate`` runs). Written only when some stage has one; version 1
  directories still load (for training; ``evaluate`` refuses them).
* 3 (2026-12-02): ``data_parallel``, the number of replicas of every stage the
  export asked for (``export_stages(data_parallel=N)``, ``vjpsplit export --stages
  --data-parallel N``): the ``Trainer``'s default. Written only when N > 1.

A batch leaf whose dtype is a typed PRNG key's name (``key<fry>``) and whose shape is ``()`` is the
function's key argument (``StagesIndex.key_position``, 2026-12-06): no new version, as it adds no field;
a vjpsplit from before reads such an index but cannot train its stages (it has no ``rng=``).

``StagesIndex.to_json`` writes exactly the map its version reads (``from_json``):
an index without evaluation programs is written as version 1, so a signed
directory's canonical bytes do not change with this code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

from ...errors import VjpsplitError
from ...treetypes import JSON, JSONObject
from ...trust import signing

FORMAT = "vjpsplit-stages"
VERSION = 3
READS = (1, 2, 3)  # the versions from_json reads


@dataclass(frozen=True)
class LeafEntry:
    """One array leaf: its file key, dtype name and shape (a symbolic dim as its text)."""

    key: str
    dtype: str
    shape: tuple[int | str, ...]

    def to_json(self) -> JSONObject:
        """The leaf as ``stages.json`` writes it."""
        return {"key": self.key, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, d: Mapping[str, JSON]) -> LeafEntry:
        """The leaf ``to_json`` wrote."""
        return cls(
            str(d["key"]),
            str(d["dtype"]),
            tuple(s if isinstance(s, str) else int(_number(s)) for s in _list(d["shape"])),
        )


@dataclass(frozen=True)
class StageEntry:
    """One stage: its artifact file, the parameter and batch leaves it reads (positions in the index's
    lists), what it receives and sends, its estimated cost and where it was cut."""

    file: str
    params: tuple[int, ...]
    batch: tuple[int, ...]
    receives: tuple[LeafEntry, ...]
    sends: tuple[LeafEntry, ...]
    cost: float
    cost_source: str
    cut_after: str | None
    fingerprint: str | None = None  # the artifact's, recorded when the directory is saved
    evaluation: tuple[str, str] | None = None  # version 2: (file, SHA-256) of the stage's evaluation program

    def to_json(self) -> JSONObject:
        """The entry as ``stages.json`` writes it."""
        out: JSONObject = {
            "file": self.file,
            "params": list(self.params),
            "batch": list(self.batch),
            "receives": [r.to_json() for r in self.receives],
            "sends": [s.to_json() for s in self.sends],
            "cost": self.cost,
            "cost_source": self.cost_source,
            "cut_after": self.cut_after,
        }
        if self.fingerprint is not None:
            out["fingerprint"] = self.fingerprint
        if self.evaluation is not None:
            out["evaluation"] = {"file": self.evaluation[0], "sha256": self.evaluation[1]}
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, JSON]) -> StageEntry:
        """The entry ``to_json`` wrote."""
        evaluation = d.get("evaluation")
        return cls(
            str(d["file"]),
            tuple(int(_number(i)) for i in _list(d["params"])),
            tuple(int(_number(i)) for i in _list(d["batch"])),
            tuple(LeafEntry.from_json(_object(r)) for r in _list(d["receives"])),
            tuple(LeafEntry.from_json(_object(s)) for s in _list(d["sends"])),
            float(_number(d["cost"])),
            str(d["cost_source"]),
            None if d.get("cut_after") is None else str(d["cut_after"]),
            None if d.get("fingerprint") is None else str(d["fingerprint"]),
            None if evaluation is None else (str(_object(evaluation)["file"]), str(_object(evaluation)["sha256"])),
        )


@dataclass(frozen=True)
class StagesIndex:
    """What ``stages.json`` holds: the function, its cut, its parameter and batch leaves, and one entry per stage."""

    function: str
    cut: str  # "marks" or "balanced"
    cost_dim: int  # the size symbolic dims take in the cost estimates
    arg_names: tuple[str, ...]
    wrt: tuple[str, ...]
    params_name: str
    batch_names: tuple[str, ...]
    params: tuple[LeafEntry, ...]
    batch: tuple[LeafEntry, ...]
    per_stage: tuple[StageEntry, ...]
    signature: Mapping[str, JSON | bytes] | None = None  # signing's entry (or its JSON, hex), when signed
    data_parallel: int = 1  # version 3: the replicas of every stage the export asked for (the Trainer's default)

    @property
    def key_position(self) -> int | None:
        """The position in ``batch`` of the batch argument that is one scalar typed PRNG key (dtype ``key<...>``):
        the loss's key, which the ``Trainer``'s ``rng=`` gives each microbatch; None where the function takes none.
        """
        for i, b in enumerate(self.batch):
            if b.key in self.batch_names and not b.shape and b.dtype.startswith("key<"):
                return i
        return None

    @property
    def param_keys(self) -> list[str]:
        """Every parameter leaf's file key, in the parameters' leaf order."""
        return [p.key for p in self.params]

    def stage_param_keys(self) -> list[list[str]]:
        """Per stage, the file keys of the parameter leaves it holds."""
        keys = self.param_keys
        return [[keys[i] for i in st.params] for st in self.per_stage]

    def with_fingerprints(self, fingerprints: Sequence[str]) -> StagesIndex:
        """This index with each stage's artifact fingerprint recorded, unsigned."""
        entries = tuple(dataclasses.replace(st, fingerprint=f) for st, f in zip(self.per_stage, fingerprints))
        return dataclasses.replace(self, per_stage=entries, signature=None)

    def to_json(self) -> JSONObject:
        """The map ``stages.json`` holds (with the signature entry when signed, its bytes as hex)."""
        out: JSONObject = {
            "format": FORMAT,
            "version": self._version(),
            "function": self.function,
            "cut": self.cut,
            "cost_dim": self.cost_dim,
            "arg_names": list(self.arg_names),
            "wrt": list(self.wrt),
            "params_name": self.params_name,
            "batch_names": list(self.batch_names),
            "params": [p.to_json() for p in self.params],
            "batch": [b.to_json() for b in self.batch],
            "stages": [st.to_json() for st in self.per_stage],
        }
        if self.data_parallel > 1:
            out["data_parallel"] = self.data_parallel
        if self.signature is not None:
            out[signing.SIGNATURE] = {k: v.hex() if isinstance(v, bytes) else v for k, v in self.signature.items()}
        return out

    def _version(self) -> int:
        """The oldest version that holds what this index has (an older directory's bytes stay as they were)."""
        if self.data_parallel > 1:
            return 3
        return 2 if any(st.evaluation is not None for st in self.per_stage) else 1

    @classmethod
    def from_json(cls, d: JSON, source: str) -> StagesIndex:
        """The index in a ``stages.json`` map; a map of another format or version is one error naming ``source``."""
        if not isinstance(d, Mapping) or d.get("format") != FORMAT or not isinstance(d.get("stages"), list):
            raise VjpsplitError(f"{source}: not a vjpsplit stages index; pass a directory written by Stages.save")
        if type(d.get("version")) is not int or d.get("version") not in READS:
            raise VjpsplitError(
                f"{source}: stages index version {d.get('version')!r}; this vjpsplit reads "
                f"{', '.join(map(str, READS))}: use a newer vjpsplit, or export the stages again"
            )
        signature = d.get(signing.SIGNATURE)
        try:
            return cls(
                str(d["function"]),
                str(d["cut"]),
                int(_number(d.get("cost_dim", 8))),
                tuple(str(n) for n in _list(d["arg_names"])),
                tuple(str(n) for n in _list(d["wrt"])),
                str(d["params_name"]),
                tuple(str(n) for n in _list(d["batch_names"])),
                tuple(LeafEntry.from_json(_object(p)) for p in _list(d["params"])),
                tuple(LeafEntry.from_json(_object(b)) for b in _list(d["batch"])),
                tuple(StageEntry.from_json(_object(st)) for st in _list(d["stages"])),
                signature if isinstance(signature, dict) else None,  # load_stages refuses any other
                _replicas(d.get("data_parallel", 1), source),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise VjpsplitError(f"{source}: the stages index lacks or garbles {e}; save the stages again") from e


def _replicas(value: JSON, source: str) -> int:
    """``data_parallel`` as the index holds it: an int >= 1, else one error naming ``source``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise VjpsplitError(
            f"{source}: data_parallel is {value!r}, not an int >= 1; export the stages again (--data-parallel N)"
        )
    return value


# json.loads gives any JSON where a list, an object or a number belongs: the wrong kind is the TypeError
# from_json turns into its one error.
def _list(value: JSON) -> list[JSON]:
    if not isinstance(value, list):
        raise TypeError(f"{value!r} where a list belongs")
    return value


def _object(value: JSON) -> JSONObject:
    if not isinstance(value, dict):
        raise TypeError(f"{value!r} where an object belongs")
    return value


def _number(value: JSON) -> str | int | float:
    """``value`` as ``int()`` and ``float()`` take it (a number, or its text)."""
    if not isinstance(value, (str, int, float)):
        raise TypeError(f"{value!r} where a number belongs")
    return value
