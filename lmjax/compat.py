"""What differs between the jax lines lmjax supports, in one place.

The pins admit jax 0.10.2 (the last release for Python 3.11) through 0.12.x (Python 3.12 and
3.13). Where the lines behave differently, the one way that works on all of them lives here,
so the rest of the code (and the tests) never branch on a version.

Lowering for a GPU on a host without one. Up to 0.10.2, `.lower(lowering_platforms=("cuda",))`
emitted a Pallas Triton kernel with no device at hand. From 0.11, the Triton lowering asks the
target GPU for its compute capability (`jax._src.pallas.triton.gpu_info.get_gpu_info`), reading
it from the abstract device of the mesh in context when there is one, else from the default
device, which on a CPU host is no GPU: "No supported GPU devices found, please specify an
abstract GPU device using AbstractDevice". `lowering_for` then traces and lowers again under a
one-device abstract mesh of a named GPU (`abstract_gpu`), so one call lowers on every line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
from jax.sharding import AbstractDevice, AbstractMesh

# The GPU a CUDA program is lowered for on a host without one: the kind of the project's GPU
# machines (H100 and H200 are both compute capability 9.0, which is what the lowering reads).
DEFAULT_GPU_KIND = "NVIDIA H100 80GB HBM3"
GPU_PLATFORMS = ("cuda", "rocm")


@contextlib.contextmanager
def abstract_gpu(gpu_kind: str = DEFAULT_GPU_KIND) -> Iterator[None]:
    """A one-device abstract mesh of `gpu_kind` in context: where jax >= 0.11's Triton lowering
    reads the target GPU from. One device, so lmjax's mesh-aware code
    (`lmjax.models.sharding.context_mesh_shape`) sees no mesh and splits nothing."""
    device = AbstractDevice(device_kind=gpu_kind, num_cores=None, platform="gpu")
    mesh = AbstractMesh((1,), ("lowering_target",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def lowering_for(
    jitted,
    *args,
    platform: str,
    trace_device: str | jax.Device | None = None,
    gpu_kind: str = DEFAULT_GPU_KIND,
    **kwargs,
) -> tuple[jax.stages.Traced, jax.stages.Lowered]:
    """`jitted(*args, **kwargs)` traced and lowered for `platform` ("cuda", "rocm", "tpu",
    "cpu") on this host, whatever devices it has: (traced, lowered).

    `trace_device` is the default device while tracing only: lmjax's kernels and `auto`
    attention follow its platform (`jax.default_device("gpu")` selects the GPU kernels without
    a GPU). It is not in force while lowering: jax 0.12 then looks for a real device of that
    platform.

    A program with a Pallas Triton kernel lowered for a GPU is traced and lowered again under
    `abstract_gpu(gpu_kind)` when this jax asks for the target GPU (>= 0.11: its RuntimeError
    names AbstractDevice; the mesh must be in context while tracing, which records it, as well
    as while lowering). Only then: cuDNN's fused attention is a primitive that needs devices
    while lowering, and jax refuses it under a mesh that is only abstract ("AbstractMesh cannot
    be used when jaxpr contains primitives that require devices"), so a program holding both a
    Triton kernel and cuDNN attention does not lower for a GPU on a CPU host from jax 0.11.
    """

    def trace_and_lower():
        with jax.default_device(trace_device) if trace_device else contextlib.nullcontext():
            traced = jitted.trace(*args, **kwargs)
        return traced, traced.lower(lowering_platforms=(platform,))

    try:
        return trace_and_lower()
    except RuntimeError as err:
        if platform not in GPU_PLATFORMS or "AbstractDevice" not in str(err):
            raise
    with abstract_gpu(gpu_kind):
        return trace_and_lower()
