"""lmjax.compat, the one place where the supported jax lines (0.10.2, 0.11.x, 0.12.x) differ.

The CUDA and TPU lowering tests (test_gpu_lowering, test_flash_attention, test_nf4_matmul,
test_flash_gpu_defaults, test_gpu_structure, test_attention_cudnn) use `lowering_for` on every
line; here, what they do not show: an error that is not the missing GPU propagates as it was,
the abstract GPU is in context only while it is needed, and jax's interpreter for Mosaic GPU
kernels (docs/kernels.md: the path after Triton) runs on this CPU where this jax has it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lmjax import compat
from pallas_kernels.flash_attention import flash_attention

X = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)


def test_a_triton_kernel_lowers_for_cuda_and_the_mesh_is_gone_after():
    def attend(q):
        return flash_attention(q, q, q, causal=True)

    traced, lowered = compat.lowering_for(jax.jit(attend), X, platform="cuda", trace_device="gpu")
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1
    assert traced.out_info.shape == X.shape
    assert jax.sharding.get_abstract_mesh().empty


def test_other_errors_are_not_retried_or_changed():
    calls = []

    def fails(x):
        calls.append(1)
        raise RuntimeError("not a lowering problem")

    with pytest.raises(RuntimeError, match="not a lowering problem"):
        compat.lowering_for(jax.jit(fails), X, platform="cuda")
    assert len(calls) == 1


def test_the_abstract_gpu_is_one_device_so_nothing_is_split():
    from lmjax.models.sharding import context_mesh_shape

    with compat.abstract_gpu("NVIDIA H200"):
        mesh = jax.sharding.get_abstract_mesh()
        assert mesh.abstract_device.device_kind == "NVIDIA H200"
        assert context_mesh_shape() is None


@pytest.mark.skipif(
    not hasattr(plgpu, "InterpretGPUParams"),
    reason=f"jax {jax.__version__} has no Mosaic GPU interpreter (it came in 0.11)",
)
def test_a_mosaic_gpu_kernel_runs_in_jax_gpu_interpreter_on_this_cpu():
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0 + 1.0

    x = jnp.arange(256, dtype=jnp.float32).reshape(16, 16)
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=plgpu.CompilerParams(),
        interpret=plgpu.InterpretGPUParams(),
    )
    np.testing.assert_array_equal(np.asarray(call(x)), np.asarray(x) * 2 + 1)
