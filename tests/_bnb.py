"""bitsandbytes as the outside witness of lmjax's NF4 weights (tests only)."""

from __future__ import annotations

import bitsandbytes.functional as bnbf
import numpy as np
import torch

from lmjax.quant import nf4


def bnb_dequantized(qw) -> np.ndarray:
    """bitsandbytes' dequantize_4bit of our codes and statistics (float32 [O, I]): the outside
    witness, bit-equal to lmjax.quant.dequantize in tests/test_quant_nf4.py.

    bitsandbytes 0.50's CPU path reads weights narrower than one 64-weight block wrongly (a
    [16, 32] weight: every block after the first is off, by up to 0.2): keep I >= 64."""
    o, i = qw.shape
    _, state = bnbf.quantize_4bit(
        torch.zeros(o, i), quant_type="nf4", compress_statistics=True, blocksize=64
    )
    state.absmax = torch.from_numpy(np.array(qw.qabsmax))
    state.offset = torch.tensor(float(qw.offset))
    state.state2.absmax = torch.from_numpy(np.array(qw.absmax2))
    state.state2.code = torch.from_numpy(nf4.dynamic_map_signed())
    packed = torch.from_numpy(np.array(qw.packed)[:, None])
    with torch.compiler.set_stance("force_eager"):  # no torch.compile per odd shape
        return bnbf.dequantize_4bit(packed, state).numpy()
