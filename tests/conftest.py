"""Settings for the whole suite.

On an accelerator, XLA's float32 products default to TF32 (GPU): float32 logits then differ from transformers'
float32 on the CPU by ~5e-3 (seen on an H200), outside the reference tolerances. The comparisons need full float32
there; on the CPU (CI) float32 products are full precision already and this changes nothing.

The suite compiles the same small programs again and again (each test loads its own model; every xdist worker
compiles its own): JAX's persistent compilation cache, in one directory for the run's workers, turns the repeats
into reads. A cached executable is the compilation of the same program, so results cannot change; programs with
host callbacks are never cached (JAX's rule). MOE_JAX_TEST_JAX_CACHE=0 turns it off.
"""

import os
import tempfile
from pathlib import Path

import jax
import pytest

if os.environ.get("MOE_JAX_TEST_JAX_CACHE", "1") != "0":
    cache = os.path.join(tempfile.gettempdir(), f"moe_jax-test-jax-cache-{os.getuid()}")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

if jax.default_backend() != "cpu":
    jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def bundled_server(tmp_path_factory):
    """`python -m moe_jax.serve` on the bundled model with default settings, shared by the modules that only
    send it requests (one per xdist worker that runs any of them: it takes ~30 s to start)."""
    from moe_jax.serving.process import running_server

    model = Path(__file__).resolve().parent.parent / "models" / "tiny-moe"
    with running_server(["--model", str(model)], tmp_path_factory.mktemp("serve") / "server.log") as s:
        yield s


@pytest.fixture(scope="session")
def bundled_adapters(tmp_path_factory):
    """{name: directory} of two LoRA adapters on the bundled model with random weights (bench.models.random_adapter),
    of different targets (overlapping on o_proj) and ranks: for the per-request adapter tests."""
    from bench.models import random_adapter

    model = Path(__file__).resolve().parent.parent / "models" / "tiny-moe"
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": random_adapter(model, root / "a", 1, ("q_proj", "v_proj", "o_proj"), 4),
        "b": random_adapter(model, root / "b", 2, ("k_proj", "o_proj"), 8),
    }
