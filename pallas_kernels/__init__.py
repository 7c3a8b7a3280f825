"""Pallas kernels (docs/kernels.md): flash attention and the NF4 quantized matmul.

`pallas_kernels.flash_attention` holds FlashAttention-2 with a hand-written VJP, a GPU (Triton)
kernel and a TPU (Mosaic) kernel (interpreted on CPU), its `BlockSizes` and its pure-JAX
`attention_reference`; `lmjax.models.dot_product_attention(impl="flash")` dispatches to it.
`pallas_kernels.nf4_matmul` holds the NF4 quantized matmul (`y = x @ dequant(W)^T`, tiles decoded
on chip, an input-only VJP): a GPU and a TPU kernel, its `BlockSizes` and `nf4_matmul_reference`;
`lmjax.models.project` dispatches a `lmjax.quant.QuantizedWeight` to it. Nothing is re-exported
here: a function named like its module would shadow the module.
"""
