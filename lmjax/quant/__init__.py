"""Quantized weights (docs/fine-tuning.md): NF4 with double quantization.

`lmjax.quant.nf4` holds the format (quantize, dequantize, the `QuantizedWeight` pytree and its
storage formula); `lmjax.quant.params` quantizes the linear weights of a model's parameters.
`pallas_kernels.nf4_matmul` multiplies by a `QuantizedWeight` without dequantizing it in memory,
and `lmjax.models.project` dispatches to it.
"""

from lmjax.quant.nf4 import QuantizedWeight, dequantize, quantize, storage_bytes

__all__ = ["QuantizedWeight", "dequantize", "quantize", "storage_bytes"]
