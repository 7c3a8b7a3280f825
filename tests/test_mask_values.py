"""SPEC section 2: a mask is boolean or 0/1, and 1 keeps. Every public entry point that takes a
mask refuses any other value in a concrete mask, since an additive mask (0 keeps, -inf drops,
the Hugging Face / PyTorch convention) read as "nonzero keeps" would silently invert it.

Each refusal happens on the host before anything compiles, so the bad-value cases are cheap;
the agreement cases compile one small attention per impl.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmjax import ops
from lmjax.errors import ShapeError
from lmjax.models import dot_product_attention as attention  # every impl, flash included
from pallas_kernels import flash_attention as fa

S = 3
IMPLS = ["materialized", "xla", "flash"]

# Every mask has S = 3 entries, one per key (a rank-1 mask broadcasts from the right).
BAD_MASKS = {
    "additive_-inf": [0.0, 0.0, -np.inf],
    "additive_-1e9": [0.0, -1e9, 0.0],
    "half": [1.0, 1.0, 0.5],
    "two": [1, 0, 2],
    "nan": [1.0, np.nan, 1.0],
}
MESSAGE = r"keep where 1.*keep = additive == 0"


def _qkv(t=2, s=S, b=2, h=2, d=4, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((b, n, h, d)), jnp.float32) for n in (t, s, s))


def _bs(mask_s):
    """The [B, S] key-padding form the flash kernel itself takes (B = 2)."""
    return np.broadcast_to(np.asarray(mask_s), (2, S))


ENTRY_POINTS = {
    **{
        f"attention_{impl}": (
            lambda m, impl=impl: attention(*_qkv(), causal=False, mask=m, impl=impl)
        )
        for impl in IMPLS
    },
    "attention_reference": lambda m: ops.attention_reference(*_qkv(), causal=False, mask=m),
    "flash_attention": lambda m: fa.flash_attention(*_qkv(), causal=False, mask=_bs(m)),
    "flash_attention_with_lse": lambda m: fa.flash_attention_with_lse(
        *_qkv(), causal=False, mask=_bs(m)
    ),
    "flash_attention_reference": lambda m: fa.attention_reference(
        *_qkv(), causal=False, mask=_bs(m)
    ),
    "softmax": lambda m: ops.softmax(jnp.zeros((2, S)), mask=m),
}


@pytest.mark.parametrize("bad", list(BAD_MASKS), ids=list(BAD_MASKS))
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_concrete_mask_other_than_bool_or_0_1_is_refused(entry, bad):
    mask = np.asarray(BAD_MASKS[bad])
    with pytest.raises(ShapeError, match=MESSAGE):
        ENTRY_POINTS[entry](mask)
    # A jax array outside jit is as concrete as a numpy one.
    with pytest.raises(ShapeError, match=MESSAGE):
        ENTRY_POINTS[entry](jnp.asarray(mask))


def test_the_message_names_the_first_bad_value_and_where_it_is():
    with pytest.raises(ShapeError) as info:
        ops.attention(*_qkv(), causal=False, mask=np.asarray([[1, 1, 1], [0, 0, -np.inf]]))
    message = str(info.value)
    assert message.startswith("mask[1, 2] = -inf;"), message
    assert "lmjax masks keep where 1" in message and "keep = additive == 0" in message


@pytest.mark.parametrize("impl", IMPLS)
def test_bool_int_and_float_0_1_masks_mean_the_same(impl):
    q, k, v = _qkv(seed=1)
    keep = np.asarray([[True, False, True], [True, True, False]])[:, None, None, :]
    outs = [
        np.asarray(attention(q, k, v, causal=False, mask=m, impl=impl))
        for m in (keep, keep.astype(np.int32), keep.astype(np.float32), jnp.asarray(keep))
    ]
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    # And the mask is applied: dropping key 1 of batch row 0 changes that row's output.
    unmasked = np.asarray(attention(q, k, v, causal=False, impl=impl))
    assert np.abs(outs[0][0] - unmasked[0]).max() > 1e-3


def test_under_jit_a_bool_mask_is_used_as_is():
    """A traced mask cannot be inspected; a bool one needs no inspection."""
    q, k, v = _qkv(seed=2)
    keep = jnp.asarray([[True, False, True], [True, True, True]])[:, None, None, :]
    step = jax.jit(lambda q, k, v, m: ops.attention(q, k, v, causal=False, mask=m))
    np.testing.assert_allclose(
        step(q, k, v, keep), ops.attention(q, k, v, causal=False, mask=keep), rtol=1e-6
    )


def test_the_additive_to_keep_conversion_in_the_message_is_right():
    """The fix the message shows gives the mask the additive one meant."""
    q, k, v = _qkv(seed=3)
    additive = np.asarray([0.0, -np.inf, 0.0])
    keep = additive == 0
    out = ops.attention(q, k, v, causal=False, mask=keep)
    dropped = ops.attention(q, k[:, ::2], v[:, ::2], causal=False)  # keys 0 and 2 only
    np.testing.assert_allclose(out, dropped, rtol=1e-5, atol=1e-6)
