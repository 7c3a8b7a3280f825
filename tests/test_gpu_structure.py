"""benchmarks/gpu_structure.py: the bfloat16 train step's GPU program, read on this CPU host.

A GPT-2-shaped model cut down to test size, lowered for CUDA with cuDNN attention (the one
stand-in cuDNN of tests/_cudnn.py) and with the flash kernel (Triton). What it pins: every matmul
of the step takes bfloat16 operands; the step holds no optimization barrier (they are the CPU's
weight-gradient layout, chosen when lowering, not by the host); the fused head runs as few
chunks as its tile allows (one here; 32 of 512 rows for GPT-2 before); the blocks run as one
scanned layer (model.scan_layers, the default); attention is cuDNN's fused call, forward and
backward in the scanned bodies, or the Triton kernels.
"""

from __future__ import annotations

import pytest
from _benchmarks import load_benchmark
from _cudnn import fake_cudnn  # noqa: F401  (the fixture)

from lmjax.config import RunConfig, load_run_config

LAYERS = 2


def _config(tmp_path, attention: str) -> RunConfig:
    (tmp_path / "c.yaml").write_text(
        f"""
model: {{preset: gpt2-124m, vocab_size: 512, context_length: 128, d_model: 64, n_heads: 2,
        n_layers: {LAYERS}, d_ff: 256, attention: {attention}, dtype: bfloat16,
        param_dtype: float32}}
train: {{batch_size: 8, seq_len: 128, grad_accum: 2}}
"""
    )
    return load_run_config(tmp_path / "c.yaml")


@pytest.mark.parametrize("attention", ["cudnn", "flash"])
def test_the_bf16_step_lowered_for_cuda(tmp_path, fake_cudnn, attention):  # noqa: F811
    report = load_benchmark("gpu_structure").audit(_config(tmp_path, attention))
    by_dtype = report["matmul_tflops_by_operand_dtypes"]
    assert by_dtype and all(k.startswith("bfloat16xbfloat16->") for k in by_dtype), by_dtype
    lowered = report["cuda_lowering"]
    assert lowered["optimization_barriers"] == 0, lowered
    # The head's chunk loop: 4 x 128 rows a micro-batch, one chunk (the CPU's would be 512 rows
    # too here; GPT-2's 16 x 1024 rows are 4 chunks of 4096 on a GPU, 32 of 512 on a CPU).
    inside = [loop for loop in report["loops"] if loop["inside"] == "scan[2]"]
    head = [loop for loop in inside if loop["trips"] == 1]
    assert len(head) == 1, report["loops"]
    # The blocks: one scan over the LAYERS layers in the forward and one in the backward, each
    # micro-batch; the backward's products are twice the forward's (dx and dW of each).
    layers = [loop for loop in inside if loop["trips"] == LAYERS]
    assert len(layers) == 2, report["loops"]
    forward, backward = sorted(loop["matmul_gflops_per_trip"] for loop in layers)
    assert 1.9 <= backward / forward <= 2.1, layers
    calls = lowered["custom_calls"]
    if attention == "cudnn":
        # The scanned block calls cuDNN's fused attention once in the forward loop's body, and
        # in the backward's its backward (with the forward again: the default remat of a
        # scanned model, dots_no_batch, recomputes what is not a plain product).
        fmha = {k: v for k, v in calls.items() if k.startswith("__cudnn$fmha")}
        assert sorted(fmha.values()) == [1, 2], calls
    else:
        assert "__gpu$xla.gpu.triton" in calls and report["primitives"]["pallas_call"] > 0
