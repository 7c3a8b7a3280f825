"""A stand-in cuDNN for tests on a CPU host: the one fixture that lets jax trace its cuDNN path.

`jax.nn.dot_product_attention(implementation="cudnn")` asks, while tracing, for the installed
cuDNN's version (`check_cudnn_version`, which raises "cuDNN is not detected" without one) and
the GPU's compute capability (`check_compute_capability`, `is_cuda_compute_capability_equal`,
both False off a CUDA GPU), all in `jax._src.cudnn.fused_attention_stablehlo`. `fake_cudnn`
answers them as an H100 with cuDNN 9.8 would, so a program can be traced and lowered for CUDA
(`.trace(...).lower(lowering_platforms=("cuda",))`); nothing runs on it. jax's private module
may move: the fixture then fails by name (monkeypatch's `raising=True`), not silently.
"""

from __future__ import annotations

import pytest
from jax._src.cudnn import fused_attention_stablehlo as cudnn_stablehlo

CUDNN_VERSION = 90800  # cuDNN 9.8.0, as cudnnGetVersion() reports it
CAPABILITY = (9, 0)  # Hopper: head sizes up to 256
# The custom calls of cuDNN's fused attention (forward and backward), as jax names them.
FMHA_CALL = "__cudnn$fmha"


def _capability(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


@pytest.fixture
def fake_cudnn(monkeypatch):
    """cuDNN `CUDNN_VERSION` on compute capability `CAPABILITY`, for this test only."""
    monkeypatch.setattr(cudnn_stablehlo, "check_cudnn_version", lambda: CUDNN_VERSION)
    monkeypatch.setattr(
        cudnn_stablehlo, "check_compute_capability", lambda c: CAPABILITY >= _capability(c)
    )
    monkeypatch.setattr(
        cudnn_stablehlo, "is_cuda_compute_capability_equal", lambda c: CAPABILITY == _capability(c)
    )
