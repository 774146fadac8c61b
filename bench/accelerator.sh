#!/usr/bin/env bash
# The accelerator run, prepared to fit <= 8 minutes on a single-GPU machine (16 cores, large RAM):
#   bash bench/accelerator.sh [--layers N]        (extra arguments go to bench/accelerator.py)
# Needs the project installed with a CUDA build of jaxlib 0.10.2 (the machine has no internet: install it there
# beforehand, e.g. pip install "jax[cuda12]==0.10.2"); transformers' side needs a CUDA torch and is skipped,
# with the reason in the JSON, where torch is the CPU build this project pins for its tests.
# Writes $OUT/accelerator.json (or bench/results/ without $OUT): the probe, then every backend's forward,
# LoRA training step and decode at batch 1 and 16 with the lanes' busy fractions, and the cost model's
# table for the same machine (bench/pipeline.py --no-measure).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results}"
mkdir -p "$out"
python -c "import jax; print('jax', jax.__version__, jax.devices())"
if ! python -c "import jax, sys; sys.exit(jax.default_backend() == 'cpu')"; then
  echo "note: jax runs on the CPU here: every figure below is this CPU's, not an accelerator's" >&2
fi
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv || true
lscpu | grep -E "Model name|^CPU\(s\)" || true
timeout 420 python bench/accelerator.py --out "$out" "$@"
timeout 60 python bench/pipeline.py --no-measure
cp bench/results/pipeline.json "$out/pipeline_model.json" 2>/dev/null || true
