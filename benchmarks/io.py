"""Residual file save + load side by side with numpy: np.save/np.load of one buffer, np.savez/np.load.

    python -m benchmarks --only io        # the transformer's residuals (~44 MiB)
    python -m benchmarks.io --gib 1       # also a >= 1 GiB residual set (by hand: ~2 min, 3+ GiB of RAM)

Every candidate writes and reads the same arrays in the same directory, rounds
interleaved, page cache warm. vjpsplit saves without fsync (its default for
residuals; the rename is atomic and the CRC-32s catch a torn file) and checks every
CRC-32 on load, as `run-bwd` does. Peak RSS growth while loading is measured in a
fresh process.

A second table isolates how a finished temp file takes the target's place, on the
same bytes: ``os.replace`` over the old file, ``renameat2(RENAME_EXCHANGE)`` then
unlinking the old file (what ``filesystem.replace_file`` does where it can), and ``np.save``
overwriting the old file in place. Each candidate keeps its own file names: deleting
a file whose writeback is in flight waits for it, so sharing names would charge
one candidate's disk I/O to another.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import jax
import numpy as np

import vjpsplit_cli as vs
from benchmarks.workloads import transformer
from vjpsplit_cli.safeio import checksum, filesystem

# Peak RSS growth while loading, in a fresh process. ru_maxrss cannot be used: its
# high-water mark is set by the imports (jax), far above what a load adds. Writing
# "5" to /proc/self/clear_refs resets VmHWM to the current RSS, so VmHWM after the
# load minus VmRSS before it is exactly what loading added at its peak. A tiny file
# of the same kind is loaded first, so one-time imports and first-use setup (a few
# MiB, whatever the file size) are not counted as the load's.
_RSS_PROBE = """
import sys, json, numpy as np, vjpsplit_cli as vs

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

def load(path):
    if kind == "raw":
        return np.load(path)
    if kind == "savez":
        with np.load(path) as z:
            return [z[k] for k in z.files]
    return vs.load_arrays(path)[0]

kind, path, warm = sys.argv[1:4]
load(warm)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
data = load(path)
print(json.dumps({"peak_kib": status("VmHWM") - before}))
"""

RAW = "np.save + np.load, one buffer"
SAVEZ = "np.savez + np.load, same arrays"


def _peak_load_bytes(kind: str, path: Path) -> float:
    warm = path.with_name("warm" + path.suffix)
    if kind == "raw":
        np.save(warm, np.zeros(4, np.float32))
    elif kind == "savez":
        np.savez(warm, x=np.zeros(4, np.float32))
    else:
        vs.save_arrays(warm, {"r/0": np.zeros(4, np.float32)}, {"kind": "warm-up"})
    probe = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE, kind, str(path), str(warm)], capture_output=True, text=True
    )
    if probe.returncode != 0:  # no /proc (not Linux), or clear_refs not writable here
        return float("nan")
    return json.loads(probe.stdout)["peak_kib"] * 1024


def _candidates(d: Path, arrays: dict[str, np.ndarray], meta: dict) -> dict:
    """name -> (save + load once, what the RSS probe loads)."""
    blob = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays.values()])

    def raw():
        np.save(d / "raw.npy", blob)
        np.load(d / "raw.npy")

    def savez():
        np.savez(d / "savez.npz", **arrays)
        with np.load(d / "savez.npz") as z:
            [z[k] for k in z.files]

    cands = {RAW: (raw, ("raw", d / "raw.npy")), SAVEZ: (savez, ("savez", d / "savez.npz"))}
    for ext in ("npz", "msgpack"):

        def ours(ext=ext):
            # What save_residuals / load_residuals do underneath (verify on, no fsync).
            vs.save_arrays(d / f"r.{ext}", arrays, meta)
            vs.load_arrays(d / f"r.{ext}", verify=True)

        cands[f"vjpsplit .{ext}"] = (ours, ("v", d / f"r.{ext}"))
    if checksum.BACKEND != "zlib":

        def zlib_crc():
            # The same with zlib's CRC-32, as where no faster one is installed: same bytes.
            with _crc32_of(zlib.crc32):
                vs.save_arrays(d / "z.npz", arrays, meta)
                vs.load_arrays(d / "z.npz", verify=True)

        cands["vjpsplit .npz, zlib's CRC-32"] = (zlib_crc, ("v", d / "z.npz"))
    if filesystem.renameat2() is not None:

        def plain_rename():
            # The same, replacing the old file by os.replace as before renameat2 was used.
            with _plain_rename():
                vs.save_arrays(d / "p.npz", arrays, meta)
            vs.load_arrays(d / "p.npz", verify=True)

        cands["vjpsplit .npz, os.replace"] = (plain_rename, ("v", d / "p.npz"))
    return cands


@contextlib.contextmanager
def _crc32_of(fn):
    """Inside, every CRC-32 is computed by ``fn``."""
    saved = checksum.crc32
    checksum.crc32 = fn
    try:
        yield
    finally:
        checksum.crc32 = saved


@contextlib.contextmanager
def _plain_rename():
    """Inside, atomic_write replaces files with os.replace, as where renameat2 is missing."""
    saved = filesystem.renameat2
    filesystem.renameat2 = lambda: None
    try:
        yield
    finally:
        filesystem.renameat2 = saved


def measure(arrays: dict[str, np.ndarray], meta: dict, rounds: int, rss: bool = True) -> list[dict]:
    """Median save+load seconds of each candidate, interleaved round by round, with ratios."""
    nbytes = sum(a.nbytes for a in arrays.values())
    with tempfile.TemporaryDirectory() as d:
        cands = _candidates(Path(d), arrays, meta)
        samples = {k: [] for k in cands}
        for fn, _ in cands.values():
            fn()
        for _ in range(rounds):
            for k, (fn, _) in cands.items():
                t0 = time.perf_counter()
                fn()
                samples[k].append(time.perf_counter() - t0)
        times = {k: float(np.median(v)) for k, v in samples.items()}
        return [
            {
                "what": k,
                "s": t,
                "gib_s": nbytes / t / 2**30,
                "vs_raw": times[RAW] / t,
                "vs_savez": times[SAVEZ] / t,
                "peak_load_bytes": _peak_load_bytes(*cands[k][1]) if rss else float("nan"),
            }
            for k, t in times.items()
        ]


def table(title: str, rows: list[dict], nbytes: int) -> list[str]:
    lines = [
        title,
        "",
        "| format | save+load (median) | throughput | vs np.save+np.load (target ≥ 0.9×) "
        "| vs np.savez+np.load (target ≥ 1×) | peak RSS growth while loading |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['what']} | {r['s'] * 1e3:.1f} ms | {r['gib_s']:.2f} GiB/s | {r['vs_raw']:.2f}× "
            f"| {r['vs_savez']:.2f}× | {r['peak_load_bytes'] / nbytes:.2f}× the data |"
        )
    return lines


def replace_costs(nbytes: int, rounds: int) -> list[dict]:
    """Median seconds to write ``nbytes`` and put them in place of the previous file, three ways, interleaved."""
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    exchange = filesystem.renameat2()

    def write(p: Path) -> None:
        with open(p, "wb") as f:
            f.write(memoryview(data))

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)

        def by_rename():
            write(d / "r.tmp")
            os.replace(d / "r.tmp", d / "r.bin")

        def by_exchange():
            write(d / "x.tmp")
            if not exchange(str(d / "x.tmp"), str(d / "x.bin")):
                raise OSError("renameat2(RENAME_EXCHANGE) failed on this file system")
            os.unlink(d / "x.tmp")

        def np_save():
            np.save(d / "o.npy", data)

        cands = {"write + os.replace over the old file": by_rename, "np.save over the old file": np_save}
        if exchange is not None:
            write(d / "x.bin")
            cands["write + renameat2(RENAME_EXCHANGE) + unlink the old file"] = by_exchange
        for k, fn in list(cands.items()):
            try:
                fn()
            except OSError:  # renameat2 exists but this file system refuses the exchange: not a way here
                del cands[k]
        samples = {k: [] for k in cands}
        for _ in range(rounds):
            for k, fn in cands.items():
                t0 = time.perf_counter()
                fn()
                samples[k].append(time.perf_counter() - t0)
    times = {k: float(np.median(v)) for k, v in samples.items()}
    base = times["np.save over the old file"]
    return [{"what": k, "s": t, "vs_np_save": base / t, "nbytes": nbytes} for k, t in times.items()]


def replace_table(rows: list[dict]) -> list[str]:
    nbytes = rows[0]["nbytes"]
    size = f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"
    lines = [
        f"Replacing a {size} file (write the bytes, then put them in place; page cache warm, no fsync).",
        "",
        "| how | median | vs np.save over the old file |",
        "|---|---:|---:|",
    ]
    lines += [f"| {r['what']} | {r['s'] * 1e3:.1f} ms | {r['vs_np_save']:.2f}× |" for r in rows]
    return lines


def residual_set(gib: float | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """The transformer block's residuals; with ``gib``, copies of them (perturbed) up to that size."""
    w = transformer()
    fwd, _ = vs.split(w.fn)
    _, res = fwd(*jax.device_put(w.args))
    stored = [np.asarray(a) for a in res.stored.values()]
    arrays = {f"r/{i}": a for i, a in enumerate(stored)}
    if gib:
        copies = int(np.ceil(gib * 2**30 / sum(a.nbytes for a in stored)))
        arrays = {
            f"r/{c}/{i}": (a + c if a.dtype.kind == "f" else a) for c in range(copies) for i, a in enumerate(stored)
        }
    meta = {"kind": "vjpsplit-residuals", "fingerprint": "0" * 64, "dims": {}, "needs_inputs": []}
    return arrays, meta


def run(quick: bool, gib: float | None = None) -> tuple[str, list[dict]]:
    arrays, meta = residual_set()
    nbytes = sum(a.nbytes for a in arrays.values())
    rows = measure(arrays, meta, 3 if quick else 15)
    lines = table(
        f"Residuals of the transformer block: {len(arrays)} arrays, {nbytes / 2**20:.1f} MiB; save + "
        "load, page cache warm, vjpsplit with CRC-32s checked and no fsync (its residual default); "
        f"CRC-32 by {checksum.BACKEND}.",
        rows,
        nbytes,
    )
    lines += [""] + replace_table(replace_costs(40 * 2**20, 3 if quick else 15))
    if gib:
        lines += [""] + replace_table(replace_costs(int(gib * 2**30), 3 if quick else 7))
        big, meta = residual_set(gib)
        nbig = sum(a.nbytes for a in big.values())
        big_rows = measure(big, meta, 3 if quick else 5)
        lines += [""] + table(
            f"The same residuals ×{len(big) // len(arrays)}: {len(big)} arrays, {nbig / 2**30:.2f} GiB.", big_rows, nbig
        )
        rows += [dict(r, size="large") for r in big_rows]
    return "\n".join(lines), rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="size of the large set (default 1 GiB)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print(run(args.quick, args.gib)[0])
