#!/usr/bin/env bash
# The accelerator run, prepared to fit <= 8 minutes on a single-GPU machine (16 cores, large RAM):
#   bash bench/accelerator.sh [--layers N]        (extra arguments go to bench/accelerator.py)
# The machine has no network: the project installs against the jax/jaxlib (CUDA) already there, its native library
# built with that jaxlib's FFI header and the system CUDA's cuda.h (--no-build-isolation --no-deps: nothing fetched).
# Its image lacks gguf (pure Python): carry it as a wheel in .whl/ (`pip download --no-deps --only-binary=:all:
# --python-version 3.12 -d .whl gguf==0.19.0`, .whl in the run's carry); wheels found there are installed first.
# $PYTHON (default python3: the image's interpreter with its CUDA jax and torch) runs everything.
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
py="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$py" -c "import gguf" 2>/dev/null; then
  echo "gguf is not installed here: carry its wheel in .whl/ (see the top of this script)" >&2
  exit 2
fi
"$py" -c "import jax; print('jax', jax.__version__, jax.devices())"
if ! "$py" -c "import jax, sys; sys.exit(jax.default_backend() == 'cpu')"; then
  echo "note: jax runs on the CPU here: every figure below is this CPU's, not an accelerator's" >&2
fi
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv || true
lscpu | grep -E "Model name|^CPU\(s\)" || true
if ! "$py" -c "import moe_jax" 2>/dev/null || [ -n "${REBUILD:-}" ]; then
  CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" timeout 120 "$py" -m pip install -q --no-build-isolation --no-deps -e .
fi
"$py" -m moe_jax.doctor | grep -iE "platform|stream|host experts called" || true
timeout 60 "$py" bench/stream_calls.py --layers 48 --rounds 3 --runs 1000 --threads "$(nproc)"
cp bench/results/stream_calls.json bench/reports/stream_calls.md "$out/" 2>/dev/null || true
for call in stream callback; do
  mkdir -p "$out/$call"
  MOE_JAX_HOST_CALL=$call timeout 130 "$py" bench/accelerator.py --out "$out/$call" "$@"
done
timeout 40 "$py" bench/pipeline.py --no-measure
cp bench/results/pipeline.json "$out/pipeline_model.json" 2>/dev/null || true
