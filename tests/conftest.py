"""Suite-wide JAX settings: implicit rank promotion is an error, so no broadcast is silent."""

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
