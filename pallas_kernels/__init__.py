"""Pallas kernels (SPEC section 7): flash attention and the NF4 quantized matmul.

Empty for now; the kernels, their pure-JAX references and interpret-mode tests arrive with
their issues.
"""
