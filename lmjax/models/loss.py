"""The training objective: a model's next-token cross-entropy; `Loss`, what a step differentiates.

    loss(θ; x, y, m) = Σ_{b,t} m[b,t] CE(forward(θ, x)[b, t], y[b, t]) / Σ_{b,t} m[b,t]

with m the loss mask (1 where the target counts; all ones without one) and a target of -100
never counted. Both sit here, below `lmjax.lora` and `lmjax.train`, so that LoRA's objective
(`lora.objective`) is built without importing the trainer above it; `lmjax.train.step`
re-exports them.

With a padded vocabulary (`cfg.tokenizer_size` n < V) CE runs over the first n logits only:
rows n..V-1 of the head are no token, so they take no probability mass (their gradient is
exactly 0) and a target >= n is out of range, as one >= V is otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lmjax import ops
from lmjax.models.config import ModelConfig
from lmjax.models.transformer import features, forward, head_params
from lmjax.ops.losses import counted_positions

IGNORE_INDEX = -100  # ops.cross_entropy's default: a target never counted


def loss_fn(
    params: dict,
    inputs_BT,
    targets_BT,
    cfg: ModelConfig,
    dropout_key=None,
    *,
    loss_mask_BT=None,
    segment_ids_BT=None,
):
    """Mean next-token cross-entropy of one (micro-)batch over its counted positions.

    `loss_mask_BT` `[B, T]` (bool or 0/1; None: all ones): only positions where it is 1 enter
    the mean, and every other position's gradient is exactly 0; none counted: loss and
    gradients 0. `segment_ids_BT` `[B, T]` int: packed documents, passed to the model
    (attention and positions stay inside a segment).

    With the custom ops and a plain (weight, bias) head, the head and the loss are one op,
    `ops.linear_cross_entropy`: no [B, T, V] logits are stored, and the head's gradient is
    formed chunk by chunk in the forward pass (measured ~8% less CPU time per step on the
    benchmark config). Otherwise (reference ops, an adapted head): forward, then cross_entropy.
    """
    # Only when given: the model's forward takes segment_ids since the packing change.
    model_kw = {} if segment_ids_BT is None else {"segment_ids": segment_ids_BT}
    n = cfg.vocab_ids  # V unless padded: then the slices below are no-ops and are skipped
    if cfg.ops == "custom" and set(head_params(params, cfg)) <= {"weight", "bias"}:
        p, x_BTD = features(params, inputs_BT, cfg, dropout_key=dropout_key, **model_kw)
        # A padded head is sliced to its token rows before the fused op, whose VJP stays the
        # plain one; the slice's transpose gives the padded rows a zero gradient.
        head = head_params(p, cfg)
        head = {k: w[:n] for k, w in head.items()} if cfg.padded_vocab else head
        return ops.linear_cross_entropy(head, x_BTD, targets_BT, loss_mask=loss_mask_BT)
    logits_BTV = forward(params, inputs_BT, cfg, dropout_key=dropout_key, **model_kw)
    logits_BTV = logits_BTV[..., :n] if cfg.padded_vocab else logits_BTV
    return ops.cross_entropy(logits_BTV, targets_BT, loss_mask=loss_mask_BT)


def counted_tokens(targets_BT, loss_mask_BT=None) -> jax.Array:
    """int32 scalar: the positions `loss_fn` averages over (target not -100, mask 1). The
    weight of a micro-batch's mean when means are combined: Σ_a count_a loss_a / Σ_a count_a."""
    counted = counted_positions(jnp.asarray(targets_BT), IGNORE_INDEX, None, loss_mask_BT)
    return jnp.sum(counted, dtype=jnp.int32)


class Loss(NamedTuple):
    """What a train step differentiates:
    `fn(params, frozen, inputs_BT, targets_BT, key, **masks) -> mean loss`.

    `params` are the trained leaves (the state's), `frozen` an argument that is neither
    differentiated nor updated (LoRA's base model; None for full training). `key` is a dropout
    key when `uses_key`, else None. `masks`: `loss_mask_BT` and `segment_ids_BT` (`loss_fn`'s
    keywords), passed only when the batch carries them.
    """

    fn: Callable
    uses_key: bool


__all__ = ["IGNORE_INDEX", "Loss", "counted_tokens", "loss_fn"]
