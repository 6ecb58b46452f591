#!/usr/bin/env bash
# Export the sample MLP, run its forward and backward as separate processes, and
# check the gradients against jax.grad.  Usage: bash samples/quickstart.sh [OUTDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-out/quickstart}"
mkdir -p "$out"
run() { echo "+ $*" >&2; "$@"; }

run python samples/mlp.py make-inputs "$out/inputs.npz" --batch 32
run vjpsplit export samples/mlp.py:loss \
    --shapes params=@samples/mlp.py:param_shapes --shapes 'x=f32[b,784]' --shapes 'labels=i32[b]' \
    -o "$out/mlp.vjps"
run vjpsplit inspect "$out/mlp.vjps"
run vjpsplit run-fwd "$out/mlp.vjps" --inputs "$out/inputs.npz" --residuals "$out/residuals.npz" --outputs "$out/outputs.npz"
run vjpsplit run-bwd "$out/mlp.vjps" --residuals "$out/residuals.npz" --inputs "$out/inputs.npz" --grads "$out/grads.npz"
run python samples/mlp.py check "$out/inputs.npz" "$out/grads.npz"
