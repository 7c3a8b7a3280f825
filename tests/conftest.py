"""Suite-wide JAX settings.

Implicit rank promotion is an error, so no broadcast in lmjax is silent; float32 matmuls run at
full precision, so the same tolerances hold on GPUs (which default to TF32) as on CPUs.
"""

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")
