"""Parity with PyTorch (and Hugging Face Llama's RoPE) as an independent implementation.

For every op: the forward value of `lmjax.ops.<op>` against the torch function, and the VJP of
one random cotangent (lmjax's hand-written custom VJP via `jax.vjp`) against torch autograd, for
every float input. Everything is float32; inputs come from numpy and are copied to both sides.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from lmjax import ops, testing

# Float32 rounding on both sides, derived (lmjax.testing.f32_rtol, so any CPU): the longest
# chain here is attention's, forward D + 2T and backward as much again plus a dozen elementwise
# roundings (~52); 64 covers it and every other op (layer norm over D, cross-entropy over V then
# the mean over B T). 4e-6 of max(1, max |torch|); a VJP term dropped or doubled is O(1).
TOL_CHAIN = 64

B, T, H, D = 2, 5, 2, 8
V = 7  # vocabulary size for embedding and cross-entropy


def normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _to_torch(a: np.ndarray, requires_grad: bool) -> torch.Tensor:
    if np.issubdtype(a.dtype, np.integer):
        return torch.tensor(a.astype(np.int64))
    return torch.tensor(a, requires_grad=requires_grad)


def assert_parity(jax_fn, torch_fn, *args: np.ndarray, seed: int = 0):
    """Compare values and the VJPs of every float argument (ints and bools are not differentiated).

    Non-float arguments stay concrete on the JAX side (closed over, not traced), as in eager use.
    A non-scalar output gets a random cotangent, shared by both frameworks; a scalar gets 1.
    """
    diff = [i for i, a in enumerate(args) if np.issubdtype(a.dtype, np.floating)]

    def jax_of_diff(*diff_args):
        full = [jnp.asarray(a) for a in args]
        for i, d in zip(diff, diff_args, strict=True):
            full[i] = d
        return jax_fn(*full)

    out_j, vjp = jax.vjp(jax_of_diff, *(jnp.asarray(args[i]) for i in diff))
    t_args = [_to_torch(a, i in diff) for i, a in enumerate(args)]
    out_t = torch_fn(*t_args)

    shape = tuple(out_t.shape)
    cot = normal(np.random.default_rng(seed + 1000), *shape) if shape else np.float32(1.0)
    grads_j = vjp(jnp.asarray(cot))
    out_t.backward(torch.tensor(cot))

    assert out_j.dtype == jnp.float32

    def close(got, want, what):
        atol = testing.f32_rtol(TOL_CHAIN) * max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=atol, err_msg=what)

    close(out_j, out_t.detach().numpy(), "value")
    for i, g_j in zip(diff, grads_j, strict=True):
        close(g_j, t_args[i].grad.numpy(), f"grad of argument {i}")


# ---- embedding, linear, norms ------------------------------------------------------------------


def test_embedding_repeated_ids():
    rng = np.random.default_rng(0)
    ids = np.array([[1, 3, 1, 0, 3], [2, 2, 2, 6, 1]], np.int32)  # row 4 and 5 unused
    assert_parity(ops.embedding, lambda table, i: F.embedding(i, table), normal(rng, V, D), ids)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("lead", [(B, T), (B, 3, T)], ids=["rank3", "rank4"])
def test_linear(bias, lead):
    rng = np.random.default_rng(1)
    n_in, n_out = 6, 4
    x, w = normal(rng, *lead, n_in), normal(rng, n_out, n_in)
    if bias:
        jax_fn = lambda x, w, b: ops.linear({"weight": w, "bias": b}, x)  # noqa: E731
        assert_parity(jax_fn, F.linear, x, w, normal(rng, n_out))
    else:
        jax_fn = lambda x, w: ops.linear({"weight": w}, x)  # noqa: E731
        assert_parity(jax_fn, F.linear, x, w)


def test_layer_norm():
    rng = np.random.default_rng(2)
    x, scale, bias = 3.0 * normal(rng, B, T, D) + 1.0, normal(rng, D), normal(rng, D)
    assert_parity(
        lambda x, s, b: ops.layer_norm(x, s, b),
        lambda x, s, b: F.layer_norm(x, (D,), s, b, eps=1e-5),
        x,
        scale,
        bias,
    )


def test_rms_norm():
    rng = np.random.default_rng(3)
    x, scale = 3.0 * normal(rng, B, T, D), normal(rng, D)
    assert_parity(
        lambda x, s: ops.rms_norm(x, s, eps=1e-6),
        lambda x, s: F.rms_norm(x, (D,), s, eps=1e-6),
        x,
        scale,
    )


# ---- activations -------------------------------------------------------------------------------

ELEMENTWISE = {
    "gelu": (ops.gelu, lambda x: F.gelu(x, approximate="none")),
    "gelu_tanh": (ops.gelu_tanh, lambda x: F.gelu(x, approximate="tanh")),
    "relu": (ops.relu, F.relu),
    "silu": (ops.silu, F.silu),
    "sigmoid": (ops.sigmoid, torch.sigmoid),
    "tanh": (ops.tanh, torch.tanh),
    "leaky_relu": (lambda x: ops.leaky_relu(x, 0.01), lambda x: F.leaky_relu(x, 0.01)),
}


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_activation(name):
    jax_fn, torch_fn = ELEMENTWISE[name]
    assert_parity(jax_fn, torch_fn, 3.0 * normal(np.random.default_rng(4), B, T, D))


def test_swiglu():
    rng = np.random.default_rng(5)
    gate, up = 3.0 * normal(rng, B, T, D), normal(rng, B, T, D)
    assert_parity(ops.swiglu, lambda g, u: F.silu(g) * u, gate, up)


# ---- softmax and losses ------------------------------------------------------------------------


def torch_masked_softmax(x, keep, dim=-1):
    return torch.softmax(x.masked_fill(~keep, float("-inf")), dim=dim)


@pytest.mark.parametrize("axis", [-1, 1])
def test_softmax(axis):
    x = 3.0 * normal(np.random.default_rng(6), B, T, D)
    assert_parity(lambda x: ops.softmax(x, axis=axis), lambda x: torch.softmax(x, axis), x)


def test_softmax_masked():
    rng = np.random.default_rng(7)
    x = 3.0 * normal(rng, B, T, D)
    keep = rng.random((B, 1, D)) < 0.6
    keep[..., 0] = True  # no fully masked slice
    assert not keep.all()
    assert_parity(lambda x, m: ops.softmax(x, mask=m), torch_masked_softmax, x, keep)


def test_cross_entropy_ignore_index():
    rng = np.random.default_rng(8)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    targets[0, 1] = targets[1, 3] = targets[1, 4] = -100
    assert_parity(
        lambda z, y: ops.cross_entropy(z, y, ignore_index=-100),
        lambda z, y: F.cross_entropy(z.reshape(-1, V), y.reshape(-1), ignore_index=-100),
        3.0 * normal(rng, B, T, V),
        targets,
    )


def _soft_targets(rng, *shape):
    q = rng.random(shape).astype(np.float32)
    return q / q.sum(axis=-1, keepdims=True)


def _torch_soft_ce(z, q):
    return F.cross_entropy(z.reshape(-1, V), q.reshape(-1, V))


LOSSES = {
    "softmax_cross_entropy": (ops.softmax_cross_entropy, _torch_soft_ce, _soft_targets),
    "mse": (ops.mse, F.mse_loss, normal),
    "bce_with_logits": (
        ops.binary_cross_entropy_with_logits,
        F.binary_cross_entropy_with_logits,
        lambda rng, *shape: rng.random(shape).astype(np.float32),  # soft targets in [0, 1)
    ),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_with_float_targets(name):
    jax_fn, torch_fn, make_targets = LOSSES[name]
    rng = np.random.default_rng(9)
    assert_parity(jax_fn, torch_fn, 3.0 * normal(rng, B, T, V), make_targets(rng, B, T, V))


# ---- attention ---------------------------------------------------------------------------------


def _bhtd(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, D] <-> [B, H, T, D]."""
    return x.transpose(1, 2)


def torch_attention(q, k, v, **sdpa_kwargs):
    return _bhtd(F.scaled_dot_product_attention(_bhtd(q), _bhtd(k), _bhtd(v), **sdpa_kwargs))


def _causal_keep(t: int, s: int, offset: int) -> np.ndarray:
    """bool [T, S]: key u visible to query t iff u <= t + offset."""
    return np.arange(s)[None, :] <= np.arange(t)[:, None] + offset


def _key_padding(rng) -> np.ndarray:
    keep = rng.random((B, 1, 1, T)) < 0.6
    keep[..., 0] = True  # every query sees at least one key
    assert not keep.all()
    return keep


@pytest.mark.parametrize("impl", ["materialized", "xla"])
@pytest.mark.parametrize("case", ["causal", "causal_offset", "key_padding", "causal_key_padding"])
def test_attention(case, impl):
    rng = np.random.default_rng(10)
    t, s, offset = (3, 6, 2) if case == "causal_offset" else (T, T, 0)
    q, k, v = normal(rng, B, t, H, D), normal(rng, B, s, H, D), normal(rng, B, s, H, D)
    causal = case != "key_padding"
    pad = _key_padding(rng) if case.endswith("key_padding") else None  # [B, 1, 1, S]

    if case == "causal":  # torch's own causal mask (top-left aligned; T == S)
        torch_kwargs = dict(is_causal=True)
    else:  # an explicit bool mask built in numpy, broadcast like lmjax's
        keep = _causal_keep(t, s, offset) if causal else np.ones((t, s), bool)
        torch_kwargs = dict(attn_mask=torch.tensor(keep if pad is None else keep & pad))

    assert_parity(
        lambda q, k, v: ops.attention(q, k, v, causal=causal, offset=offset, mask=pad, impl=impl),
        lambda q, k, v: torch_attention(q, k, v, **torch_kwargs),
        q,
        k,
        v,
    )


# ---- rope --------------------------------------------------------------------------------------


def hf_rope(x_BTHD: torch.Tensor, position_ids_BT: torch.Tensor) -> torch.Tensor:
    """Hugging Face Llama: cos/sin from `LlamaRotaryEmbedding`, rotation by `apply_rotary_pos_emb`
    on the [B, H, T, D] layout; only the query output is used."""
    config = LlamaConfig(hidden_size=H * D, num_attention_heads=H, head_dim=D)
    assert config.rope_parameters == {"rope_theta": 10000.0, "rope_type": "default"}
    cos, sin = LlamaRotaryEmbedding(config)(x_BTHD, position_ids_BT)
    x_BHTD = _bhtd(x_BTHD)
    q_embed, _ = apply_rotary_pos_emb(x_BHTD, x_BHTD.detach(), cos, sin, unsqueeze_dim=1)
    return _bhtd(q_embed)


@pytest.mark.parametrize("case", ["default", "offset", "explicit"])
def test_rope(case):
    rng = np.random.default_rng(11)
    x = normal(rng, B, T, H, D)
    offset = 7 if case == "offset" else 0
    if case == "explicit":
        positions = rng.integers(0, 50, (B, T)).astype(np.int32)
        jax_fn = lambda x, p: ops.rope(x, p)  # noqa: E731
    else:
        positions = np.broadcast_to(np.arange(T) + offset, (B, T)).astype(np.int32)
        jax_fn = lambda x, _: ops.rope(x, offset=offset)  # noqa: E731 (default positions)
    assert_parity(jax_fn, hf_rope, x, positions)
