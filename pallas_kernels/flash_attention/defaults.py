"""The GPU kernel's default `BlockSizes`: a table keyed by GPU generation and head size.

    generation(device_kind)   "hopper" (H100, H200, H800, H20, GH200), "ampere" (A100, A800,
                              A10/A10G, A30, A40, A16, A2, RTX A*, RTX 30*) or "other"
    head_key(d)               64 for a head size up to 64, else 128 (the padded head dims the
                              benchmark measures; wider heads take the 128 entry)
    lookup(device_kind, d)    the `Entry` for that pair

Each entry carries the measurement that chose it (`Measurement`: machine, jax version, date,
forward+backward TFLOP/s and the cuDNN/flash time ratio at a sequence length T) or None, which
reads "not yet measured", and a `note` on where an unmeasured choice came from.
`benchmarks/attention_gpu.py` writes its search's winners as `entry_to_dict` dicts ("winners"
in its JSON); `entry_from_dict` reads one back, so updating the table from a GPU run is
replacing an entry below with the printed one (docs/kernels.md).

Only the compiled GPU kernel uses this table: the TPU kernel and interpret mode keep
`BlockSizes.default(kernel)`. Nothing here imports Triton: the launch settings are ints.
"""

from __future__ import annotations

import dataclasses
import re

from pallas_kernels.flash_attention.plan import BlockSizes

GENERATIONS = ("hopper", "ampere", "other")
HEAD_KEYS = (64, 128)

_HOPPER = re.compile(r"\b(GH|H)(100|200|800|20)\b")
_AMPERE = re.compile(r"\bA(100|800|10G?|30|40|16|2)\b|\bRTX A\d+|\bRTX 30\d0")


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What chose an entry: forward+backward, bf16, causal, B*T = 16384 tokens, H*Dh = 2048.

    `fwd_bwd_tflops` and `cudnn_ratio` (t_cudnn / t_flash, forward+backward) at sequence length
    `t`; None where the run did not record it."""

    machine: str
    jax: str
    date: str | None
    t: int | None
    fwd_bwd_tflops: float | None
    cudnn_ratio: float | None
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Entry:
    generation: str
    head_dim: int  # a HEAD_KEYS key
    sizes: BlockSizes
    measured: Measurement | None  # None: not yet measured
    note: str = ""  # where the sizes came from when no measurement chose them; history

    @property
    def status(self) -> str:
        return "not yet measured" if self.measured is None else "measured"


def _launch(warps: int) -> dict[str, int]:
    """Today's launch settings spelled out: `warps` for both passes, 3 stages forward, 2
    backward (what `gpu.launch` picks for None)."""
    return dict(num_warps=warps, num_stages=3, num_warps_bwd=warps, num_stages_bwd=2)


# Today's defaults, spelled out: forward 128 x 64, backward 64 x 64 (dk/dv and dq alike); 4
# warps up to a 64-wide head, else 8.
_CURRENT = {
    64: BlockSizes(128, 64, 64, 64, **_launch(4), block_q_dq=64, block_k_dq=64),
    128: BlockSizes(128, 64, 64, 64, **_launch(8), block_q_dq=64, block_k_dq=64),
}

# Hopper, head 128 (issue 33 item 2): the forward stays today's; the backward takes the tiles
# and stages of Triton's tutorial 06 "Fused Attention" (python/tutorials/06-fused-attention.py,
# `_attention.backward`: BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2 = 32, 128, 128, 32 and
# NUM_WARPS, NUM_STAGES = 4, 5, one setting for every GPU and head size it runs): dk/dv 32
# queries x 128 keys, dq 128 queries x 32 keys, 5 stages (gpu.py's dk/dv kernel says why). Its
# 4 warps are not taken: at head 128 the dk/dv program holds two f32 [128, 128] accumulators,
# 32,768 values, which are 256 registers a thread over 4 warps (128 threads), past the 255 a
# thread may have, so they would spill; over 8 warps they are 128, as today's head-128 launch
# (8 warps) has them. 5 stages of the streamed q and dO tiles (2 x [32, 128] bf16, 16 KiB a
# stage) beside k and v (64 KiB) are 144 KiB of shared memory, within Hopper's 227 KiB.
# Unmeasured: the search also tries 4 warps and other stages.
_FA2_LAUNCH = _launch(8) | {"num_stages_bwd": 5}  # today's head-128 launch, 5 backward stages
_FA2_BACKWARD_128 = BlockSizes(128, 64, 32, 128, **_FA2_LAUNCH, block_q_dq=128, block_k_dq=32)

# Issue 33: one H200, jax 0.11.2, bf16, causal, forward+backward, with `_CURRENT`'s sizes (at
# head 128 that measured the 64 x 64 backward, which `_FA2_BACKWARD_128` has since replaced).
_H200_ISSUE_33 = {
    64: Measurement(
        machine="NVIDIA H200",
        jax="0.11.2",
        date=None,
        t=None,
        fwd_bwd_tflops=None,
        cudnn_ratio=0.79,
        note="issue 33; T, TFLOP/s and date not recorded there",
    ),
    128: Measurement(
        machine="NVIDIA H200",
        jax="0.11.2",
        date=None,
        t=4096,
        fwd_bwd_tflops=None,
        cudnn_ratio=0.43,
        note="issue 33: 0.56x at T=1024, 0.43x at 4096, 0.41x at 8192; forward alone "
        "0.66-0.78x; TFLOP/s and date not recorded there",
    ),
}


def _history(former: Measurement) -> str:
    """The Hopper head-128 entry's note: unmeasured, and what its former backward measured."""
    return (
        "backward from Triton's tutorial 06 (FlashAttention-2 layout): not yet measured. The "
        f"64 x 64 backward it replaced: {former.cudnn_ratio}x of cuDNN at T={former.t} on an "
        f"{former.machine}, jax {former.jax} ({former.note})"
    )


TABLE: tuple[Entry, ...] = (
    Entry("hopper", 64, _CURRENT[64], _H200_ISSUE_33[64]),
    Entry(
        "hopper",
        128,
        _FA2_BACKWARD_128,
        None,
        note=_history(_H200_ISSUE_33[128]),
    ),
    Entry("ampere", 64, _CURRENT[64], None),
    Entry("ampere", 128, _CURRENT[128], None),
    Entry("other", 64, _CURRENT[64], None),
    Entry("other", 128, _CURRENT[128], None),
)


def generation(device_kind: str) -> str:
    """ "hopper", "ampere" or "other" from a `jax.Device.device_kind` ("NVIDIA H200",
    "NVIDIA A100-SXM4-80GB", ...)."""
    if _HOPPER.search(device_kind):
        return "hopper"
    if _AMPERE.search(device_kind):
        return "ampere"
    return "other"


def head_key(d: int) -> int:
    """The table's head-size key for head size d: the smallest key >= d, else the largest."""
    return next((key for key in HEAD_KEYS if d <= key), HEAD_KEYS[-1])


def lookup(device_kind: str, d: int) -> Entry:
    gen, key = generation(device_kind), head_key(d)
    return next(e for e in TABLE if e.generation == gen and e.head_dim == key)


def entry_to_dict(entry: Entry) -> dict:
    """JSON form: {"generation", "head_dim", "sizes": {BlockSizes fields}, "measured": {...} or
    None, "note"}."""
    return dataclasses.asdict(entry)


def entry_from_dict(data: dict) -> Entry:
    measured = data["measured"]
    return Entry(
        generation=data["generation"],
        head_dim=int(data["head_dim"]),
        sizes=BlockSizes(**data["sizes"]),
        measured=None if measured is None else Measurement(**measured),
        note=data.get("note", ""),
    )
