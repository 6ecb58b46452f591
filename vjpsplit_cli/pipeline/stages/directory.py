"""``Stages``: one function's pipeline stages (artifacts plus what each takes and sends), and its directory.

A stages directory holds ``stage0.vjp`` ... one artifact per stage and
``stages.json`` (``index.StagesIndex``): the parameter leaves (keys, dtypes,
shapes), the batch leaves, and per stage the leaves it reads, the values it
receives and sends, its estimated cost and each artifact's fingerprint. ``save`` writes every file to
a temp file and renames them all at the end (``StagedOutputs``); with
``sign_key`` each artifact and the index are signed, and ``load_stages(trust=)``
refuses a directory any of whose files another key (or no key) signed. Each stage's
evaluation program (``evaluation``) is ``stage<k>.eval``, recorded with its SHA-256 in
the index (so the index's signature covers it).
``stage_params``, ``stage_batch`` and ``gather_grads`` translate between the
user's ``params`` and batch tuple and the runners' per-stage form.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np

from ...artifact.loading import load
from ...errors import VjpsplitError
from ...files.dims import refuse_size
from ...files.shapes import bind_dims, format_shape
from ...files.trees import flatten_with_keys
from ...safeio.outputs import StagedOutputs
from ...safeio.reading import read_bytes
from ...treetypes import Leaf, PyTree
from ...trust import signing
from .evalprograms import EvalProgram, check_loaded, read_eval
from .index import LeafEntry, StagesIndex
from .microbatches import Microbatches

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from ...artifact.artifact import Artifact

INDEX = "stages.json"


class StageInputs(dict[int, list[tuple[Leaf, ...]]]):
    """A microbatch's side inputs for several stages (stage index -> its inputs), not only the last's."""


class Stages:
    """A model's pipeline stages: one artifact per stage, the ``stages.json`` index, and evaluation programs.

    ``artifacts`` (one per stage), ``index`` (``stages.json``, a ``StagesIndex``) and
    ``evaluation``: per stage its evaluation program, or None (a directory saved
    before there were any, a sharded stage). Made by ``export_stages`` and
    ``load_stages``; indexing and iterating give the artifacts.

    Args:
        artifacts: One artifact per stage, in order.
        index: The stages' index: what each stage reads, receives and sends.
        evaluation: Per stage its evaluation program or ``None``; ``None`` means none for any.

    Attributes:
        artifacts: The stages' artifacts, in order.
        index: The ``StagesIndex``.
        evaluation: Per stage its evaluation program, or ``None``.
    """

    def __init__(
        self,
        artifacts: Sequence[Artifact],
        index: StagesIndex,
        evaluation: Sequence[EvalProgram | None] | None = None,
    ):
        self.artifacts = list(artifacts)
        self.index = index
        self.evaluation: list[EvalProgram | None] = (
            [None] * len(self.artifacts) if evaluation is None else list(evaluation)
        )

    def __len__(self) -> int:
        return len(self.artifacts)

    def __getitem__(self, i: int) -> Artifact:
        return self.artifacts[i]

    def __iter__(self) -> Iterator[Artifact]:
        return iter(self.artifacts)

    def __repr__(self) -> str:
        return f"Stages({self.index.function}, {len(self)} stages)"

    def save(
        self,
        directory: str | os.PathLike[str],
        *,
        sign_key: Ed25519PrivateKey | str | os.PathLike[str] | None = None,
        fsync: bool = True,
    ) -> None:
        """Write ``directory``: each stage's artifact and evaluation program and ``stages.json``, together or none.

        All files are replaced together or none.

        Args:
            directory: The directory to write (made if missing).
            sign_key: An Ed25519 private key (or its file) to sign each artifact and the
                index with; ``None`` leaves them unsigned.
            fsync: Whether to flush the files to disk before renaming them into place.

        Raises:
            VjpsplitError: If the directory cannot be made or written, the key cannot be
                read, or the index names an evaluation program this ``Stages`` lacks.
        """
        directory = os.fspath(directory)
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise VjpsplitError(f"{directory}: cannot create the stages directory ({e.strerror})") from e
        key = None
        if sign_key is not None:
            key = signing.load_private_key(sign_key) if isinstance(sign_key, (str, os.PathLike)) else sign_key
            for a in self.artifacts:
                a.sign(key)
        index = self.index.with_fingerprints([a.manifest.fingerprint for a in self.artifacts])
        if key is not None:
            index = dataclasses.replace(index, signature=signing.sign(_pack(index.to_json()), key))
        self.index = index
        files = {f"stage{i}": os.path.join(directory, st.file) for i, st in enumerate(index.per_stage)}
        evals = {f"eval{i}": st.evaluation[0] for i, st in enumerate(index.per_stage) if st.evaluation is not None}
        lacking = [i for i, st in enumerate(index.per_stage) if st.evaluation is not None and not self.evaluation[i]]
        if lacking:
            raise VjpsplitError(
                f"{directory}: the index names stage {lacking[0]}'s evaluation program and this Stages lacks it; "
                "save the Stages that export_stages or load_stages gave"
            )
        files.update({label: os.path.join(directory, name) for label, name in evals.items()})
        files[INDEX] = os.path.join(directory, INDEX)
        packed = _pack(index.to_json())
        with StagedOutputs(files, fsync=fsync) as out:
            for i, a in enumerate(self.artifacts):
                data = a.to_bytes()
                out.write(f"stage{i}", functools.partial(_write, data=data))
            for i, program in enumerate(self.evaluation):
                if program is not None and f"eval{i}" in evals:  # one the index names (it holds its digest)
                    out.write(f"eval{i}", functools.partial(_write, data=program.data))
            out.write(INDEX, functools.partial(_write, data=packed))

    def stage_params(self, params: PyTree) -> list[tuple[Leaf, ...]]:
        """Each stage's parameter tuple from the user's whole ``params`` (checked against the export).

        Args:
            params: The whole model's parameter pytree, as exported.

        Returns:
            One tuple per stage: the parameter leaves that stage reads.

        Raises:
            VjpsplitError: If the leaves' keys, dtypes or shapes differ from the export's, naming them.
        """
        idx = self.index
        leaves = _check_leaves("params", idx.params, flatten_with_keys(idx.params_name, params))
        return [tuple(leaves[i] for i in st.params) for st in idx.per_stage]

    def stage_batch(
        self,
        batch: tuple[PyTree, ...],
        microbatches: int,
        replicas: int = 1,
        keys: Sequence[Leaf] | None = None,
    ) -> list[tuple[tuple[Leaf, ...], StageInputs]]:
        """The batch tuple as the runners' microbatches: stage 0's inputs as ``x``, the others' as per-stage sides.

        Args:
            batch: The batch inputs, a tuple in the function's argument order (a 1-tuple for one input), without the
                PRNG key argument where the function takes one (``index.StagesIndex.key_position``).
            microbatches: How many microbatches to split the first dim into.
            replicas: How many replicas each microbatch is split into after (``data_parallel``): each stage call gets
                ``rows / (microbatches * replicas)`` rows, which the export's first dims must take.
            keys: Where the function takes a PRNG key: one typed key per microbatch, handed to every stage that reads
                the key argument; None where it takes none.

        Returns:
            One pair per microbatch: stage 0's batch leaves (a tuple) and the later stages' by stage index
            (a ``StageInputs``).

        Raises:
            VjpsplitError: If ``batch`` is not a tuple of the right length, its leaves differ from the export's, their
                first dims differ or do not split into the microbatches and replicas the export takes (saying the
                fix), or ``keys`` is given without a key argument (or the other way round).
        """
        pos = self.index.key_position
        key_name = None if pos is None else self.index.batch[pos].key
        _check_keys(key_name, keys, microbatches)
        names = tuple(n for n in self.index.batch_names if n != key_name)
        if not isinstance(batch, tuple) or len(batch) != len(names):
            raise VjpsplitError(
                f"the batch must be a tuple of {len(names)} inputs ({', '.join(names)}) in the function's argument "
                f"order (a 1-tuple for one input); got {type(batch).__name__}"
                + (f" of {len(batch)}" if isinstance(batch, tuple) else "")
                + (
                    f"; leave out the PRNG key '{key_name}': the Trainer's rng= gives each microbatch its own"
                    if key_name
                    else ""
                )
            )
        recorded = [b for i, b in enumerate(self.index.batch) if i != pos]
        entries = [kv for n, b in zip(names, batch) for kv in flatten_with_keys(n, b)]
        leaves = _check_leaves("batch", recorded, entries, per_microbatch=True)
        n = np.shape(leaves[0])[0] if leaves else 0
        if any(np.shape(x)[0] != n for x in leaves) or n % microbatches:
            raise VjpsplitError(
                f"the batch inputs must share their first dim, a multiple of microbatches={microbatches}; "
                f"got {sorted({np.shape(x)[0] for x in leaves})}"
            )
        k = n // microbatches
        if k % replicas == 0:  # else the replicas' own check names the split
            self._check_call_rows(n, microbatches, replicas)
            _check_dims(recorded, leaves, k // replicas)
        rows = _microbatch_rows(leaves, microbatches)
        if pos is not None and keys is not None:
            rows.insert(pos, list(keys))
        out = []
        for m in range(microbatches):
            mb = [r[m] for r in rows]
            reads = [tuple(mb[i] for i in st.batch) for st in self.index.per_stage]
            out.append((reads[0], StageInputs({c: [r] for c, r in enumerate(reads) if c and r})))
        return out

    def stage_microbatches(
        self, given: Microbatches, replicas: int = 1, keys: Sequence[Leaf] | None = None
    ) -> list[tuple[tuple[Leaf, ...], StageInputs]]:
        """``Microbatches`` as the runners' microbatches: each batch tuple one microbatch, checked as ``stage_batch``
        checks a batch (its leaves against the export, each stage call's rows, its symbolic dims consistent).

        Args:
            given: the step's microbatches, one batch tuple each, their shapes free within the symbolic dims.
            replicas: how many replicas each microbatch is split into (``data_parallel``).
            keys: one typed PRNG key per microbatch where the function takes one; None where it takes none.

        Returns:
            One pair per microbatch, as ``stage_batch`` gives them.

        Raises:
            VjpsplitError: what ``stage_batch`` refuses, naming the microbatch (``Microbatches batch i``).
        """
        out = []
        for i, batch in enumerate(given.batches):
            try:
                (mb,) = self.stage_batch(batch, 1, replicas, None if keys is None else [keys[i]])
                leaves = jax.tree_util.tree_leaves(batch)
                rows = np.shape(leaves[0])[0] if leaves else 0
                if rows % replicas:
                    raise VjpsplitError(
                        f"data_parallel={replicas}: its {rows} rows do not split into {replicas} equal replica "
                        f"batches; give each microbatch rows that divide by {replicas}"
                    )
            except VjpsplitError as e:
                raise VjpsplitError(f"Microbatches batch {i}: {e}") from e
            out.append(mb)
        return out

    def _check_call_rows(self, n: int, microbatches: int, replicas: int) -> None:
        """Refuse a batch of ``n`` rows whose stage calls (``n / (microbatches * replicas)`` rows each) do not fit
        the export's first dims: before any stage runs, with the fix."""
        rows = n // (microbatches * replicas)
        split = f"microbatches={microbatches} x data_parallel={replicas}"
        for entry in self.index.batch:
            if not entry.shape:
                continue
            first = entry.shape[0]
            if isinstance(first, int) and first != rows:
                raise VjpsplitError(
                    f"batch leaf {entry.key!r}: the stages were exported for {first} rows per stage call "
                    f"({format_shape(entry.dtype, entry.shape)}), but a batch of {n} rows with {split} gives each call "
                    f"{n} / {microbatches * replicas} = {rows}: pass a batch of {first * microbatches * replicas} "
                    f"rows, or export the stages with a symbolic batch dim (jax.export.symbolic_shape('b')), "
                    f"which takes any batch that splits"
                )
            if isinstance(first, str):
                try:
                    refuse_size(f"batch leaf {entry.key!r} dim 0", first, rows)
                except VjpsplitError as e:
                    raise VjpsplitError(f"{e} (each stage call gets the batch's {n} rows / ({split}) = {rows})") from e

    def gather_grads(self, stage_grads: Sequence[Sequence[Leaf]], params: PyTree) -> PyTree:
        """Per-stage gradients as one pytree like ``params``: a tied leaf's gradient summed over its stages.

        Args:
            stage_grads: Per stage, the gradients of its parameter tuple.
            params: The whole model's parameter pytree (its structure, dtypes and shapes).

        Returns:
            A pytree like ``params``; leaves no stage reads get zeros.
        """
        leaves, tree = jax.tree_util.tree_flatten(params)
        total: list[Leaf | None] = [None] * len(leaves)
        for st, g in zip(self.index.per_stage, stage_grads):
            for i, gi in zip(st.params, g):
                t = total[i]
                total[i] = gi if t is None else t + _beside(t, gi)
        out = [np.zeros(np.shape(x), np.asarray(x).dtype) if t is None else t for x, t in zip(leaves, total)]
        return jax.tree_util.tree_unflatten(tree, out)


def _beside(a: Leaf, b: Leaf) -> Leaf:
    """``b`` where ``a`` lives: stages on devices of their own hold a tied leaf's parts on different ones."""
    if isinstance(a, jax.Array) and isinstance(b, jax.Array) and a.sharding != b.sharding:
        return jax.device_put(b, a.sharding)
    return b


def _write(tmp: str, data: bytes) -> None:
    with open(tmp, "wb") as f:
        f.write(data)


def _hexed(value: object) -> object:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {k: _hexed(v) for k, v in value.items()}
    return value


def _pack(index: Mapping[str, object]) -> bytes:
    """``stages.json``'s canonical bytes (what its signature covers, without the signature)."""
    return (json.dumps(_hexed(index), sort_keys=True, indent=1) + "\n").encode()


def _check_leaves(
    what: str, recorded: Sequence[LeafEntry], entries: Sequence[tuple[str, Leaf]], per_microbatch: bool = False
) -> list[Leaf]:
    """The arrays of ``entries`` (key, value), refused unless keys, dtypes and ranks match the export."""
    keys = [k for k, _ in entries]
    want = [r.key for r in recorded]
    if keys != want:
        raise VjpsplitError(f"{what} do not match the stages' export: {_leaves_differ(keys, want)}")
    out = []
    for (k, v), r in zip(entries, recorded):
        shape, dtype = np.shape(v), str(np.asarray(v).dtype) if not hasattr(v, "dtype") else str(v.dtype)
        fixed = list(r.shape)
        ok = dtype == r.dtype and len(shape) == len(fixed)
        ok = ok and all(
            isinstance(d, str) or d == s or (per_microbatch and j == 0) for j, (d, s) in enumerate(zip(fixed, shape))
        )
        if not ok:
            raise VjpsplitError(
                f"{what} leaf {k!r} is {dtype}{list(shape)}, the stages were exported for {r.dtype}{list(r.shape)}"
                f"{' per microbatch' if per_microbatch else ''}; pass matching arrays or export again"
            )
        out.append(v)
    return out


def _check_dims(recorded: Sequence[LeafEntry], leaves: Sequence[Leaf], rows: int) -> None:
    """Refuse batch leaves that size one symbolic name two ways (``s`` 8 in one leaf, 16 in another), before any
    stage runs; ``rows``: what each stage call's first dims get. Dims written as expressions are left to the
    stages' own checks."""
    dims: dict[str, int] = {}
    for entry, leaf in zip(recorded, leaves):
        shape = list(np.shape(leaf))
        if shape:
            shape[0] = rows
        if not bind_dims(f"batch leaf {entry.key!r}", entry.shape, shape, dims):
            bound = ", ".join(f"{k}={v}" for k, v in dims.items())
            raise VjpsplitError(
                f"batch leaf {entry.key!r} is {list(np.shape(leaf))} ({rows} rows per stage call), the stages were "
                f"exported for {format_shape(entry.dtype, entry.shape)} and the leaves before it give {bound}: "
                "give every leaf of a microbatch the same size in each symbolic dim"
            )


def _check_keys(key_name: str | None, keys: Sequence[Leaf] | None, microbatches: int) -> None:
    """Refuse a batch of a function that takes a PRNG key (``key_name``) without ``keys``, or keys for one that
    takes none; ``keys`` are one per microbatch."""
    if key_name is not None and keys is None:
        raise VjpsplitError(
            f"the stages' function takes a PRNG key ('{key_name}'); give Trainer(..., rng=jax.random.key(seed)), "
            "which hands each microbatch its key"
        )
    if key_name is None and keys is not None:
        raise VjpsplitError("the stages' function takes no PRNG key argument; give no rng=")
    if keys is not None and len(keys) != microbatches:
        raise VjpsplitError(f"{len(keys)} PRNG keys for {microbatches} microbatches; give one per microbatch")


def _leaves_differ(keys: Sequence[str], want: Sequence[str]) -> str:
    """What differs between the given leaf keys and the exported ones, each side named from its own list.

    Only the leaves one side lacks are named (never a leaf both have), so dropping the last layer says
    which leaves are missing and nothing unexpected. A flax ``{"params": p}`` wrapper (every given key
    one ``params`` segment deeper than the export's) and its reverse are said as such, with the fix.
    """
    for outer, inner, fix in ((keys, want, "pass variables['params']"), (want, keys, "pass {'params': params}")):
        if outer and len(outer) == len(inner) and all(_unwrapped(k) == w for k, w in zip(outer, inner)):
            side = "every leaf given is" if outer is keys else "the stages were exported with every leaf"
            return f"{side} under 'params' ({outer[0]!r} for {inner[0]!r}; flax's variables dict); {fix}"
    have, wanted = set(keys), set(want)
    missing = [k for k in want if k not in have]
    extra = [k for k in keys if k not in wanted]
    parts = []
    if missing:
        parts.append(f"missing {_few(missing)}")
    if extra:
        parts.append(f"unexpected {_few(extra)}")
    if not parts:
        return f"the same leaves in another order (expected {_few(want)})"
    return f"{'; '.join(parts)} (expected {len(want)} leaves: {_few(want)})"


def _unwrapped(key: str) -> str:
    """``key`` without a ``params`` segment right after the argument's name (flax's wrapper), else ``''``."""
    head, _, rest = key.partition("/")
    return f"{head}/{rest[len('params/') :]}" if rest.startswith("params/") else ""


def _few(keys: Sequence[str], n: int = 4) -> str:
    shown = ", ".join(repr(k) for k in keys[:n])
    return shown + (f" and {len(keys) - n} more" if len(keys) > n else "")


def load_stages(
    directory: str | os.PathLike[str], *, trust: signing.TrustKeys | None = None, allow_kernels: bool = False
) -> Stages:
    """Read a stages directory (``Stages.save``): ``stages.json`` and each stage's artifact, all checked.

    ``trust``: as for ``load``: every artifact and the index must be signed by a trusted key.

    Args:
        directory: The stages directory.
        trust: Trusted Ed25519 public keys, as ``load`` takes them; ``None`` reads
            ``VJPSPLIT_TRUST_KEYS``, and with none there, signatures are not required.
        allow_kernels: Whether to accept the artifacts' kernel custom calls without a signature.

    Returns:
        The ``Stages``.

    Raises:
        VjpsplitError: If ``stages.json`` cannot be read or is malformed, a signature
            is malformed or not by a trusted key, a stage names no file in the
            directory or a file whose fingerprint differs from the index's, or a
            stage's artifact or evaluation program is refused (as ``load`` raises).
    """
    directory = os.fspath(directory)
    path = os.path.join(directory, INDEX)
    raw = read_bytes(path, "stages index")
    try:
        index = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise VjpsplitError(f"{path}: not a stages index ({e}); save the stages again") from e
    typed = StagesIndex.from_json(index, path)  # the format and version first, before any signature or artifact
    trusted = signing.trusted_keys(trust)
    entry = index.get(signing.SIGNATURE)
    if entry is not None or trusted is not None:
        top = dict(index)
        if isinstance(entry, dict):
            try:
                top[signing.SIGNATURE] = {k: bytes.fromhex(v) if k != "alg" else v for k, v in entry.items()}
            except (TypeError, ValueError, AttributeError):
                raise VjpsplitError(f"{path}: the index's signature is malformed; save the stages again") from None
        signing.verify(top, _pack({k: v for k, v in index.items()}), path, trusted, lambda m: _pack(m))
    arts: list[Artifact] = []
    programs: list[EvalProgram | None] = []
    signed = trusted is not None and signing.SIGNATURE in index  # verified above: a key the caller trusts
    for i, st in enumerate(typed.per_stage):
        name = st.file
        if os.path.basename(name) != name or not name:
            raise VjpsplitError(f"{path}: stage {i} names no artifact file in this directory; save the stages again")
        a = load(os.path.join(directory, name), trust=trust, allow_kernels=allow_kernels)
        if a.manifest.fingerprint != st.fingerprint:
            raise VjpsplitError(
                f"{path}: {name} is not the artifact this index was saved with (fingerprint differs); save again"
            )
        arts.append(a)
        programs.append(None if st.evaluation is None else read_eval(directory, *st.evaluation))
    named = {
        os.path.join(directory, st.evaluation[0]): (p, a)
        for st, p, a in zip(typed.per_stage, programs, arts)
        if st.evaluation is not None and p is not None
    }
    check_loaded(named, trusted_signer=signed, allow_kernels=allow_kernels)  # every module in one child
    return Stages(arts, typed, programs)


def _microbatch_rows(leaves: Sequence[Leaf], microbatches: int) -> list[list[Leaf]]:
    """Each batch leaf's first dim cut into ``microbatches`` equal parts: host arrays by NumPy views, the JAX
    arrays among them in one jitted call (a device batch stays where it is; one dispatch, not one slice each)."""
    if microbatches == 1:  # a microbatch given as it is (``Microbatches``): nothing to cut
        return [[x] for x in leaves]
    k = np.shape(leaves[0])[0] // microbatches if leaves else 0
    on_device = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    rows: list[list[Leaf]] = [
        [] if isinstance(x, jax.Array) else [x[m * k : (m + 1) * k] for m in range(microbatches)] for x in leaves
    ]
    if on_device:
        for i, parts in zip(on_device, _split_rows(microbatches)([leaves[i] for i in on_device])):
            rows[i] = list(parts)
    return rows


@functools.lru_cache(maxsize=None)
def _split_rows(microbatches: int) -> Callable[[list[Leaf]], list[list[jax.Array]]]:
    """A jitted call cutting each array's first dim into ``microbatches`` equal parts (compiled per signature)."""
    import jax.numpy as jnp

    return jax.jit(lambda xs: [jnp.split(x, microbatches) for x in xs])
