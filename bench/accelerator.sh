#!/usr/bin/env bash
# The accelerator run, prepared to fit <= 8 minutes on a single-GPU machine (16 cores, large RAM):
#   bash bench/accelerator.sh [--layers N]        (extra arguments go to bench/accelerator.py)
# The machine has no network: the project installs against the jax/jaxlib (CUDA) already there, its native library
# built with that jaxlib's FFI header and the system CUDA's cuda.h (--no-build-isolation --no-deps: nothing fetched).
# transformers' side needs a CUDA torch and is skipped, with the reason in the JSON, where torch is absent or a CPU
# build.
# Writes under $OUT (or bench/results/ without $OUT): the host hand-off's cost (bench/stream_calls.py: the stream
# worker's round trip, per-layer overhead of the stream calls against pure_callback), then for each host call
# (stream, callback) accelerator.json: the probe, every backend's forward, LoRA training step and decode at batch 1
# and 16 with the lanes' busy fractions; and the cost model's table (bench/pipeline.py --no-measure).
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
if ! python -c "import moe_jax" 2>/dev/null || [ -n "${REBUILD:-}" ]; then
  CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" timeout 150 pip install -q --no-build-isolation --no-deps -e .
fi
python -m moe_jax.doctor | grep -iE "platform|stream|host experts called" || true
timeout 90 python bench/stream_calls.py --layers 48 --rounds 3 --runs 1000 --threads "$(nproc)"
cp bench/results/stream_calls.json bench/reports/stream_calls.md "$out/" 2>/dev/null || true
for call in stream callback; do
  mkdir -p "$out/$call"
  MOE_JAX_HOST_CALL=$call timeout 150 python bench/accelerator.py --out "$out/$call" "$@"
done
timeout 60 python bench/pipeline.py --no-measure
cp bench/results/pipeline.json "$out/pipeline_model.json" 2>/dev/null || true
