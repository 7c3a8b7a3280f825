"""lmjax primitives (docs/models.md).

Each public op is a `jax.custom_vjp` whose backward is written by hand from the equations in
its docstring; each has a `*_reference` in plain `jax.numpy` that `jax.grad`
differentiates. `lmjax.testing` and the test suite compare the two, and both against float64
finite differences. `python -m lmjax gradcheck` prints that comparison.
"""

from lmjax.ops.activations import (
    gelu,
    gelu_reference,
    gelu_tanh,
    gelu_tanh_reference,
    leaky_relu,
    leaky_relu_reference,
    relu,
    relu_reference,
    sigmoid,
    sigmoid_reference,
    silu,
    silu_reference,
    swiglu,
    swiglu_reference,
    tanh,
    tanh_reference,
)
from lmjax.ops.attention import attention, attention_reference
from lmjax.ops.dropout import dropout, dropout_reference
from lmjax.ops.embedding import embedding, embedding_reference
from lmjax.ops.fused_head import linear_cross_entropy, linear_cross_entropy_reference
from lmjax.ops.linear import init_linear, linear, linear_reference, xavier_uniform
from lmjax.ops.losses import (
    binary_cross_entropy_with_logits,
    binary_cross_entropy_with_logits_reference,
    cross_entropy,
    cross_entropy_reference,
    mse,
    mse_reference,
    softmax_cross_entropy,
    softmax_cross_entropy_reference,
)
from lmjax.ops.norms import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from lmjax.ops.positions import sinusoidal_positions, sinusoidal_positions_reference
from lmjax.ops.rope import rope, rope_reference
from lmjax.ops.softmax import softmax, softmax_reference

__all__ = [
    "attention",
    "attention_reference",
    "binary_cross_entropy_with_logits",
    "binary_cross_entropy_with_logits_reference",
    "cross_entropy",
    "cross_entropy_reference",
    "dropout",
    "dropout_reference",
    "embedding",
    "embedding_reference",
    "gelu",
    "gelu_reference",
    "gelu_tanh",
    "gelu_tanh_reference",
    "init_linear",
    "layer_norm",
    "layer_norm_reference",
    "leaky_relu",
    "leaky_relu_reference",
    "linear",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "linear_reference",
    "mse",
    "mse_reference",
    "relu",
    "relu_reference",
    "rms_norm",
    "rms_norm_reference",
    "rope",
    "rope_reference",
    "sigmoid",
    "sigmoid_reference",
    "silu",
    "silu_reference",
    "sinusoidal_positions",
    "sinusoidal_positions_reference",
    "softmax",
    "softmax_cross_entropy",
    "softmax_cross_entropy_reference",
    "softmax_reference",
    "swiglu",
    "swiglu_reference",
    "tanh",
    "tanh_reference",
    "xavier_uniform",
]
