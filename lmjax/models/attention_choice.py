"""Which implementation `model.attention` runs: `choose`, a pure table over the machine and the
inputs, and `resolve`, which applies it here and says once what `auto` picked.

    auto on a CUDA GPU   cudnn (jax.nn.dot_product_attention, cuDNN's fused attention) where
                         `cudnn_refusal` finds nothing, else flash, saying why
    auto on a TPU        flash (the Pallas kernel, Mosaic)
    auto on a CPU        materialized (the custom VJP, by query blocks when causal: for
                         GPT-2 124M at T = 1024 it keeps 906 MiB for the backward where
                         jax.nn.dot_product_attention's XLA form keeps 2.4 GiB, `lmjax
                         inspect`; float16 too, which XLA's CPU attention lacks)
    auto, other GPUs     flash (cuDNN is NVIDIA's)
    auto on a GPU whose  xla where it would pick flash: the GPU kernel lowers through
    jax lacks Triton     jax.experimental.pallas.triton, saying why
    auto choosing flash  xla when the kernel cannot take the call (a traced offset, a mask
                         that varies over heads or queries), saying why
    cudnn                cuDNN, or a ConfigError naming what it cannot express
    flash                the kernel, or on a GPU whose jax lacks the Pallas Triton backend
                         a ConfigError pointing to cudnn or xla
    materialized, xla: as named

cuDNN's limits are the ones jax checks when it traces the call (jax._src.cudnn.
fused_attention_stablehlo): bfloat16 or float16 inputs; a head size that is a multiple of 8
and at most 128, or 256 on compute capability 9.0 (Hopper) and later. Masks, offsets, windows
and segment ids it always takes (`lmjax.ops.attention_cudnn` turns what its own masks cannot
say into a bias). The machine is not checked for an explicit `cudnn`: lowering for CUDA from a
CPU host is allowed, and on a machine without cuDNN jax itself refuses at trace time.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax.extend import backend as jax_backend

from lmjax.errors import ConfigError
from pallas_kernels import flash_attention

CUDNN_DTYPES = ("bfloat16", "float16")
HOPPER = (9, 0)

_log = logging.getLogger("lmjax")


@dataclasses.dataclass(frozen=True)
class Machine:
    """What `auto` looks at: jax's default platform ("cpu", "gpu", "tpu"), whether the GPU
    is NVIDIA's (CUDA), its compute capability (None when unknown or not a CUDA GPU), and
    whether this jax has the Pallas Triton backend the flash kernel needs on a GPU."""

    platform: str
    cuda: bool = False
    capability: tuple[int, int] | None = None
    triton: bool = True


def this_machine() -> Machine:
    """The machine jax runs on now (its default backend and first device)."""
    platform = jax.default_backend()
    if platform != "gpu":
        return Machine(platform)
    cuda = "cuda" in jax_backend.get_backend().platform_version.lower()
    text = getattr(jax.devices()[0], "compute_capability", None) if cuda else None
    capability = tuple(int(x) for x in text.split(".")[:2]) if text else None
    return Machine(platform, cuda, capability, flash_attention.triton_available())


def cudnn_refusal(dtype, d_head: int, capability: tuple[int, int] | None) -> str | None:
    """Why cuDNN's fused attention cannot run inputs of `dtype` and head size `d_head` on a GPU
    of `capability` (None: unknown, taken as before Hopper, as jax does), or None if it can."""
    name = jnp.dtype(dtype).name
    if name not in CUDNN_DTYPES:
        return f"cuDNN attention takes bfloat16 or float16 inputs, not {name}"
    hopper = capability is not None and tuple(capability) >= HOPPER
    limit = 256 if hopper else 128
    if d_head % 8 or d_head > limit:
        where = "on compute capability 9.0 and later" if hopper else "before Hopper (9.0)"
        return (
            f"cuDNN attention takes a head size that is a multiple of 8 and at most {limit} "
            f"{where}, not {d_head}"
        )
    return None


def choose(
    impl: str, machine: Machine, dtype, d_head: int, flash_refusal: str | None = None
) -> tuple[str, str | None]:
    """(the implementation to run, the line `auto` says about it, None for an explicit one).

    `flash_refusal`: why the flash kernel cannot take this call, or None. An explicit "cudnn"
    that cuDNN cannot run is a `ConfigError`, and so is an explicit "flash" on a GPU whose jax
    lacks the Triton backend (`machine.triton`)."""
    if impl == "cudnn":
        why = cudnn_refusal(dtype, d_head, machine.capability)
        if why is not None:
            expected = f"inputs cuDNN can run ({why})"
            fix = "use model.attention=auto (or flash)"
            raise ConfigError.describe("model.attention", "cudnn", expected, fix)
    no_triton = machine.platform == "gpu" and not machine.triton
    if impl == "flash" and no_triton:
        expected = "a jax with the Pallas Triton backend, which this jax lacks"
        fix = "use model.attention=cudnn or model.attention=xla"
        raise ConfigError.describe("model.attention on a gpu", "flash", expected, fix)
    if impl != "auto":
        return impl, None
    said = f"model.attention=auto runs {{}} on this {machine.platform}"
    if machine.platform == "cpu":
        return "materialized", said.format("materialized")
    why = "cuDNN is on NVIDIA (CUDA) GPUs only"
    if machine.platform == "gpu" and machine.cuda:
        why = cudnn_refusal(dtype, d_head, machine.capability)
        if why is None:
            return "cudnn", said.format("cudnn")
    if machine.platform not in ("gpu", "tpu"):
        return "materialized", said.format("materialized")
    if no_triton:
        no_flash = "this jax has no Pallas Triton backend"
        return "xla", said.format("xla") + f", not cudnn: {why}, not flash: {no_flash}"
    if flash_refusal is not None:
        return "xla", said.format("xla") + f", not flash: {flash_refusal}"
    if machine.platform == "tpu":
        return "flash", said.format("flash")
    return "flash", said.format("flash") + f", not cudnn: {why}"


_SAID: list[str] = []


@functools.cache
def say_once(line: str) -> None:
    """Say `line` once per process: kept for `said()` (`lmjax train` and `finetune` print them
    with the run's files) and logged on the "lmjax" logger, at WARNING when `auto` fell back
    from its first choice (the line gives the reason: Python prints it on stderr with no logging
    set up), else at INFO, so a plain choice never adds a line to an error's stderr."""
    _SAID.append(line)
    _log.log(logging.WARNING if ", not " in line else logging.INFO, "lmjax: %s", line)


def said() -> list[str]:
    """What `auto` has said in this process, in order."""
    return list(_SAID)


def resolve(impl: str, dtype, d_head: int, flash_refusal: str | None = None) -> str:
    """`choose` on this machine, saying `auto`'s choice once."""
    chosen, line = choose(impl, this_machine(), dtype, d_head, flash_refusal)
    if line is not None:
        say_once(line)
    return chosen
