#!/usr/bin/env bash
# The one prepared command for a machine with a GPU or TPU (it runs on a CPU-only machine too):
#
#   bash benchmarks/accelerator.sh [OUTDIR] [ARGS...]   # default OUTDIR: accelerator-report/; ARGS: --full
#
# 1. Installs what is missing, from PyPI only: this package (pip install -e .) when it cannot be
#    imported, and jax's plugin for the device, pinned to the installed jax, only when such a
#    device is present and jax does not see it yet: jax[cuda12] for an NVIDIA GPU
#    (JAX_CUDA_EXTRA=cuda13 for CUDA 13 drivers), jax[tpu] for a TPU.
# 2. Runs `python -m benchmarks --accelerator --out OUTDIR ARGS...`: a correctness pass of the
#    artifacts on the device, then training (a GPT's Trainer steps against one process), residuals
#    offloaded to the device's pinned_host memory, fwd+bwd, residual I/O and pipeline benchmarks
#    (benchmarks/accelerator.py).
# 3. Leaves OUTDIR/accelerator.json and OUTDIR/accelerator.md (rewritten with every row measured, so
#    a run cut short keeps what it measured; a run that could not start or that died says why, with
#    the last lines of its log), OUTDIR/install.log and OUTDIR/run.log.
#
# All within BUDGET_S seconds (default 600, 10 minutes): installs are time-boxed and the run gets
# what is left. Exit status 0 when correctness passed and every step ran; 1 otherwise.
# PYTHON picks the interpreter (default: python3).
set -uo pipefail
start=$SECONDS
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-accelerator-report}"
shift $(($# > 0 ? 1 : 0))
budget="${BUDGET_S:-600}"
py="${PYTHON:-python3}"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
log="$out/install.log"
: >"$log"

say() { echo "[accelerator.sh $((SECONDS - start)) s] $*" >&2; }

pip_install() {  # pip_install SECONDS ARGS...: time-boxed, quiet, logged; never fatal
  local limit=$1
  shift
  say "pip install $*"
  if ! timeout "$limit" "$py" -m pip install --quiet --disable-pip-version-check --retries 2 --timeout 20 "$@" >>"$log" 2>&1; then
    say "warning: pip install $* failed or timed out (see $log); going on with what is installed"
  fi
}

if ! "$py" -c "import vjpsplit_cli, jax, click, msgpack, ml_dtypes, flatbuffers" 2>/dev/null; then
  pip_install 150 -e "$root"
fi
# Each probe of the backend opens the device, and a TPU just let go of can refuse the next program for
# seconds (the run asks again): probe once, and again only after installing a plugin.
backend() { "$py" -c "import jax; print(jax.default_backend())" 2>>"$log" || echo none; }
jax_version=$("$py" -c "import jax; print(jax.__version__)" 2>>"$log")
have=$(backend)
installed=
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  say "GPU: $(nvidia-smi -L | head -1); jax backend: $have"
  if [ "$have" != gpu ] && [ -n "$jax_version" ]; then
    pip_install 200 "jax[${JAX_CUDA_EXTRA:-cuda12}]==$jax_version"
    installed=1
  fi
elif [ -e /dev/accel0 ] || [ -e /dev/vfio/0 ]; then
  say "TPU device files present; jax backend: $have"
  if [ "$have" != tpu ] && [ -n "$jax_version" ]; then
    pip_install 200 "jax[tpu]==$jax_version"
    installed=1
  fi
else
  say "no GPU or TPU found: running on the CPU (a smoke test of this command)"
fi
[ -n "$installed" ] && say "jax backend now: $(backend)"

left=$((budget - (SECONDS - start) - 10))
if [ "$left" -lt 60 ]; then
  say "only $left s left after installing; running the quick variant"
  quick=--quick
else
  quick=
fi
# SIGINT first: the run catches it and writes what it has; SIGKILL 8 s later if it does not stop.
rm -f "$out/accelerator.json" "$out/accelerator.md"
# Its stderr through tee into run.log, in a pipeline (so run.log is whole when it ends), its stdout as it is.
exec 3>&1
timeout -s INT -k 8 "$left" "$py" -m benchmarks --accelerator $quick "$@" --budget "$((left - 15))" --out "$out" \
  2>&1 1>&3 3>&- | tee "$out/run.log" >&2
status=${PIPESTATUS[0]}
exec 3>&-
if [ ! -s "$out/accelerator.json" ]; then  # it never got going (jax or a dependency missing): say so anyway
  status=1
  printf '{"passed": false, "error": "the run did not start; see run.log and install.log"}\n' >"$out/accelerator.json"
  { echo "# vjpsplit accelerator run: did not start"; echo; echo "Exit $status. Last lines of run.log:"; echo
    echo '```'; tail -n 30 "$out/run.log"; echo '```'; } >"$out/accelerator.md"
elif [ "$status" -gt 1 ]; then  # it died (a signal, a crash in XLA): the report says so, with the log's end
  { echo; echo "## The run ended with exit status $status"; echo; echo "Last lines of run.log:"; echo
    echo '```'; tail -n 30 "$out/run.log"; echo '```'; } >>"$out/accelerator.md"
  "$py" - "$out/accelerator.json" "$status" "$out/run.log" <<'PY' 2>>"$log" || true
import json, sys
path, status, run_log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
report = json.load(open(path))
tail = open(run_log, errors="replace").read().splitlines()[-30:]
report.update(exit_status=status, passed=False, log_tail=tail)
open(path, "w").write(json.dumps(report, indent=1) + "\n")
PY
  status=1
fi
say "done (exit $status); report: $out/accelerator.md, $out/accelerator.json"
exit "$status"
