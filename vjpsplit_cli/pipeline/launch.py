"""Start N local processes of one JAX script, as a multi-controller job: ``python -m vjpsplit_cli.pipeline.launch``.

``python -m vjpsplit_cli.pipeline.launch -n 2 train.py --steps 10`` runs ``train.py
--steps 10`` in 2 processes of this Python, each with ``JAX_COORDINATOR_ADDRESS``
(which ``jax.distributed.initialize()`` reads), ``JAX_NUM_PROCESSES`` and
``JAX_PROCESS_ID`` and ``JAX_CROSS_HOST_TRANSFER_SOCKET_ADDRESS`` (a port of its
own, for ``jax.device_put`` between processes) set, which ``initialize()`` here
passes to JAX (JAX reads none of these three itself). ``--devices K`` gives each process K
CPU devices (``XLA_FLAGS``). The launcher waits for every process; once one
fails, it ends the others (``--grace`` seconds after) and exits with the first
failure's code. The script calls ``initialize()`` (or
``jax.distributed.initialize`` with those values) before the Trainer.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from typing import Sequence

COORDINATOR = "JAX_COORDINATOR_ADDRESS"
NUM_PROCESSES = "JAX_NUM_PROCESSES"
PROCESS_ID = "JAX_PROCESS_ID"
TRANSFER = "JAX_CROSS_HOST_TRANSFER_SOCKET_ADDRESS"
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def initialize(timeout: int = 60) -> None:
    """``jax.distributed.initialize`` from what the launcher set (``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``, the
    transfer address; JAX reads ``JAX_COORDINATOR_ADDRESS`` itself); ``timeout``: seconds to wait for every
    process to join.

    Raises:
        VjpsplitError: the launcher did not start this process (its variables are missing).
    """
    import jax

    from ..errors import VjpsplitError

    missing = [k for k in (COORDINATOR, NUM_PROCESSES, PROCESS_ID) if k not in os.environ]
    if missing:
        raise VjpsplitError(
            f"{', '.join(missing)} not set: start this script with python -m vjpsplit_cli.pipeline.launch -n N "
            "script.py, or call jax.distributed.initialize(...) with the job's values"
        )
    if os.environ.get(TRANSFER) and TRANSFER.lower() in jax.config.values:  # an older jax has no such flag
        jax.config.update(TRANSFER.lower(), os.environ[TRANSFER])  # read from no variable: set before the backend
    jax.distributed.initialize(
        num_processes=int(os.environ[NUM_PROCESSES]),
        process_id=int(os.environ[PROCESS_ID]),
        initialization_timeout=timeout,
    )


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports of 127.0.0.1 free now (each bound, read, released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def environments(n: int, devices: int | None = None, base: dict[str, str] | None = None) -> list[dict[str, str]]:
    """The environment of each of ``n`` local processes of one job: ``base`` (default: this one's) with the
    coordinator's address, the process count and id and a transfer port each; ``devices``: CPU devices each."""
    ports = free_ports(n + 1)
    out = []
    for i in range(n):
        env = dict(os.environ if base is None else base)
        env[COORDINATOR] = f"127.0.0.1:{ports[0]}"
        env[NUM_PROCESSES], env[PROCESS_ID] = str(n), str(i)
        env[TRANSFER] = f"127.0.0.1:{ports[i + 1]}"
        if devices is not None:
            kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
            # First: XLA reads no flag after a token that is not one (``intra_op_parallelism_threads=1``).
            env["XLA_FLAGS"] = " ".join([f"{DEVICE_COUNT_FLAG}={devices}", *kept])
        out.append(env)
    return out


def wait_all(procs: Sequence[subprocess.Popen[bytes]], grace: float) -> int:
    """Wait for every process; once one fails, end the others ``grace`` seconds later. The first failure's
    exit code, else 0."""
    failed: int | None = None
    ending_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        for c in codes:
            if c not in (None, 0) and failed is None:
                failed, ending_at = c, time.monotonic() + grace
        if all(c is not None for c in codes):
            return failed or 0
        if ending_at is not None and time.monotonic() > ending_at:
            for p, c in zip(procs, codes):
                if c is None:
                    p.kill()
        time.sleep(0.05)


def main(argv: Sequence[str] | None = None) -> int:
    """The launcher's command line (see the module docstring); its exit code."""
    ap = argparse.ArgumentParser(prog="python -m vjpsplit_cli.pipeline.launch", description=__doc__.split("\n")[0])
    ap.add_argument("-n", "--processes", type=int, required=True, help="how many processes to start")
    ap.add_argument("--devices", type=int, default=None, help="CPU devices per process (XLA_FLAGS)")
    ap.add_argument("--grace", type=float, default=10.0, help="seconds the others get once one process failed")
    ap.add_argument("script", help="the Python script every process runs")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    a = ap.parse_args(argv)
    if a.processes < 1:
        ap.error(f"-n {a.processes}: give an int >= 1")
    if a.devices is not None and a.devices < 1:
        ap.error(f"--devices {a.devices}: give an int >= 1")
    procs = [
        subprocess.Popen([sys.executable, a.script, *a.args], env=env) for env in environments(a.processes, a.devices)
    ]
    try:
        return wait_all(procs, a.grace)
    except KeyboardInterrupt:
        for p in procs:
            p.kill()
        return 130


if __name__ == "__main__":
    sys.exit(main())
