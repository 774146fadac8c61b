"""Settings for the whole suite.

On an accelerator, XLA's float32 products default to TF32 (GPU): float32 logits then differ from transformers'
float32 on the CPU by ~5e-3 (seen on an H200), outside the reference tolerances. The comparisons need full float32
there; on the CPU (CI) float32 products are full precision already and this changes nothing.
"""

import jax

if jax.default_backend() != "cpu":
    jax.config.update("jax_default_matmul_precision", "highest")
