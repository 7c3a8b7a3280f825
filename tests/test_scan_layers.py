"""Scanned layers (issue 44): the blocks stored stacked and run as one `lax.scan`
(`model.scan_layers`, the default) against the same tree run by a Python loop over its slices.

The two are the same float operations on the same values in the same order within a block;
only XLA's fusion of them differs (a loop body is compiled once, apart from its neighbours), so
each side's sums may run in another order. The tolerances are lmjax.testing.f32_rtol of the
model's rounding chain, as for any two float32 programs of one model (tests/test_models.py).
The unrolled path is the one the torch, transformers and finite-difference tests pinned before
this change; those tests now run scanned (the default), so they witness the scan directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmjax import models, ops, testing
from lmjax import params as ptree

TINY = dict(vocab_size=27, context_length=16, d_model=32, n_heads=4, n_layers=3, d_ff=64)
CONFIGS = {
    "gpt2": models.preset("gpt2", **TINY),
    "llama": models.preset("llama", **{**TINY, "n_kv_heads": 2}),
}


def tokens_for(cfg, seed=0, batch=2):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, cfg.context_length)), jnp.int32)


def loss_fn(params, tokens, cfg, dropout_key=None, segment_ids=None):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    seg = None if segment_ids is None else segment_ids[:, :-1]
    logits = models.forward(params, inputs, cfg, dropout_key=dropout_key, segment_ids=seg)
    return ops.cross_entropy(logits, targets)


@functools.cache
def value_and_grad(cfg):
    return jax.jit(jax.value_and_grad(loss_fn), static_argnums=2)


def rtols(cfg) -> tuple[float, float]:
    """(loss, gradient) bounds: f32_rtol of the forward chain, then V and the token mean; the
    gradient runs the chain back as well and sums each weight's over the 2 t tokens."""
    t = cfg.context_length - 1
    chain = testing.forward_chain(cfg, t)
    return (
        testing.f32_rtol(chain + cfg.vocab_size + 2 * t),
        testing.f32_rtol(2 * chain + cfg.vocab_size + 4 * t),
    )


def max_abs_error(a, b) -> float:
    """Worst leaf's max |a - b|: compared with the whole tree's max |b| (some leaves are exactly
    zero in exact arithmetic, e.g. a key bias, so a per-leaf ratio would compare noise)."""
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y))), a, b)))


def both(cfg, *args):
    scanned, unrolled = cfg, cfg.replace(scan_layers=False)
    assert scanned.scan_layers, "scanning is the default"
    return value_and_grad(scanned)(*args[:2], scanned, *args[2:]), value_and_grad(unrolled)(
        *args[:2], unrolled, *args[2:]
    )


@pytest.mark.parametrize(
    "name, changes",
    [
        ("gpt2", {}),
        ("llama", {}),
        ("llama", {"remat": "block"}),
        ("gpt2", {"remat": "save_dot_except_mlp"}),
        ("gpt2", {"dropout": 0.1}),
    ],
)
def test_scanned_and_unrolled_give_the_same_loss_and_gradients(name, changes):
    cfg = CONFIGS[name].replace(**changes)
    params, tokens = models.init(jax.random.key(0), cfg), tokens_for(cfg)
    key = jax.random.key(7) if cfg.dropout else None
    (loss_s, grad_s), (loss_u, grad_u) = both(cfg, params, tokens, key)
    loss_rtol, grad_rtol = rtols(cfg)
    np.testing.assert_allclose(loss_s, loss_u, rtol=loss_rtol)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grad_u))
    assert max_abs_error(grad_s, grad_u) <= grad_rtol * scale
    # Every layer's slice of every stacked gradient is reached (no layer dropped or repeated).
    for name_, g in ptree.flatten(grad_s).items():
        if ptree.is_stacked(name_) and not name_.endswith("key.bias"):
            assert (np.abs(np.asarray(g)).reshape(cfg.n_layers, -1).max(axis=1) > 0).all(), name_
    if cfg.dropout:  # the same masks on both sides: a different mask moves the loss by O(rate)
        (loss_off, _), _ = both(cfg, params, tokens, None)
        assert abs(float(loss_off) - float(loss_s)) > 100 * loss_rtol * abs(float(loss_off))


def test_packed_rows_scanned_and_unrolled():
    cfg = CONFIGS["llama"]
    params, tokens = models.init(jax.random.key(1), cfg), tokens_for(cfg, 1)
    segments = jnp.asarray(np.repeat([[0, 1], [0, 0]], [7, 9], axis=1), jnp.int32)
    (loss_s, grad_s), (loss_u, grad_u) = both(cfg, params, tokens, None, segments)
    loss_rtol, grad_rtol = rtols(cfg)
    np.testing.assert_allclose(loss_s, loss_u, rtol=loss_rtol)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grad_u))
    assert max_abs_error(grad_s, grad_u) <= grad_rtol * scale


def test_logits_and_greedy_tokens_are_the_same():
    cfg = CONFIGS["llama"]
    params = models.init(jax.random.key(2), cfg)
    fwd = jax.jit(models.forward, static_argnums=2)
    prompt = tokens_for(cfg, 2)[:, :4]

    def greedy(c, steps=8):
        tokens = prompt
        for _ in range(steps):
            nxt = jnp.argmax(fwd(params, tokens, c)[:, -1], axis=-1)
            tokens = jnp.concatenate([tokens, nxt[:, None].astype(tokens.dtype)], axis=1)
        return np.asarray(tokens)

    unrolled = cfg.replace(scan_layers=False)
    full = tokens_for(cfg, 3)
    a, b = fwd(params, full, cfg), fwd(params, full, unrolled)
    np.testing.assert_allclose(a, b, rtol=0, atol=testing.logits_atol(cfg, b))
    np.testing.assert_array_equal(greedy(cfg), greedy(unrolled))


def _program(cfg, n_layers):
    cfg = cfg.replace(n_layers=n_layers)
    params = models.abstract_params(cfg)
    tokens = jax.ShapeDtypeStruct((2, cfg.context_length), jnp.int32)
    return jax.jit(jax.grad(loss_fn), static_argnums=2).lower(params, tokens, cfg).as_text()


def test_the_scanned_program_does_not_grow_with_depth():
    cfg = CONFIGS["gpt2"]
    scanned = [_program(cfg, n).count("\n") for n in (1, 8)]
    unrolled = [_program(cfg.replace(scan_layers=False), n).count("\n") for n in (1, 8)]
    # One block's forward and backward in a loop whatever N is; the unrolled program has 8.
    assert scanned[1] <= scanned[0] + 20, scanned
    assert unrolled[1] > 4 * unrolled[0], unrolled
    assert "stablehlo.while" in _program(cfg, 8)


def test_remat_applies_to_the_scanned_block():
    cfg = CONFIGS["gpt2"]
    kept = {p: models.residual_bytes(cfg.replace(remat=p), 2, 16) for p in models.REMAT_POLICIES}
    assert kept["block"] == kept["full"] < kept["save_dot_except_mlp"] < kept["none"]
    assert kept["dots"] < kept["none"]
    # With no remat the scan keeps what the unrolled loop keeps, up to one [B, T, D] float32
    # activation (measured: the unrolled jaxpr hands one more to its backward); the weights
    # both read are slices of the stacked input, not copies (models.residual_bytes).
    unrolled = models.residual_bytes(cfg.replace(scan_layers=False, remat="none"), 2, 16)
    assert 0 <= unrolled - kept["none"] <= 4 * 2 * 16 * cfg.d_model


def test_layer_count_mismatch_is_one_line():
    cfg = CONFIGS["gpt2"]
    params = models.init(jax.random.key(0), cfg.replace(n_layers=2))
    with pytest.raises(Exception) as info:
        models.forward(params, tokens_for(cfg), cfg)
    assert "(2, " in str(info.value) and "(3, " in str(info.value)
    assert "\n" not in str(info.value)
