#!/usr/bin/env bash
# Export one library sample, run its forward and backward as separate CLI processes,
# and check the gradients against jax.grad.
#   bash samples/models/run.sh flax_cnn|equinox_mlp|haiku_mlp [OUTDIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
name="${1:?usage: samples/models/run.sh flax_cnn|equinox_mlp|haiku_mlp [OUTDIR]}"
out="${2:-out/models/$name}"
src="samples/models/$name.py"
mkdir -p "$out"
run() { echo "+ $*" >&2; "$@"; }

case "$name" in
  flax_cnn)    data=(--shapes 'x=f32[b,28,28,1]' --shapes 'labels=i32[b]') ;;
  equinox_mlp) data=(--shapes 'x=f32[b,32]' --shapes 'y=f32[b,4]') ;;
  haiku_mlp)   data=(--shapes 'x=f32[b,32]' --shapes 'labels=i32[b]') ;;
  *) echo "unknown sample $name" >&2; exit 2 ;;
esac
run vjpsplit export "$src:loss" --shapes "params=@$src:param_shapes" "${data[@]}" --wrt params \
    --platforms cpu,cuda,tpu -o "$out/model.vjps"
run python "$src" make-inputs "$out/inputs.npz" --batch 16
run vjpsplit run-fwd "$out/model.vjps" --inputs "$out/inputs.npz" --residuals "$out/residuals.npz" --outputs "$out/outputs.npz"
run vjpsplit run-bwd "$out/model.vjps" --residuals "$out/residuals.npz" --inputs "$out/inputs.npz" --grads "$out/grads.npz"
run python "$src" check "$out/inputs.npz" "$out/grads.npz"
