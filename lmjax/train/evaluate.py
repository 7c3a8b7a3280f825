"""Validation loss: the mean over a run's fixed validation batches.

    val_loss = mean_i loss(params, eval_batch(i)),   i = 0 .. train.eval_batches - 1

each batch `[B, T]` with B = batch_size / grad_accum (one micro-batch) and T = seq_len, the same
batches at every evaluation and in `lmjax eval` (`lmjax.train.data.eval_batch`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from lmjax.train import data as D


def evaluate(
    eval_step, params, val_tokens, t, seq_len: int, sharding=None, vocab_size: int | None = None
) -> float:
    """Mean loss over the `t.eval_batches` fixed validation batches (micro-batch sized).

    `sharding`: lay each `[B, T]` batch out by it (every host computes the same batch and
    hands over only its devices' rows); None: host arrays. `vocab_size`: refuse a batch with
    an id outside the vocabulary (`TokenError`; the gather would clamp it).
    """
    micro = t.batch_size // t.grad_accum

    def batch(i: int):
        arrays = D.eval_batch(val_tokens, t.seed, i, micro, seq_len, vocab_size=vocab_size)
        if sharding is None:
            return arrays
        return [jax.make_array_from_callback(a.shape, sharding, a.__getitem__) for a in arrays]

    losses = [eval_step(params, *batch(i)) for i in range(t.eval_batches)]
    return float(np.mean(jax.device_get(losses)))


@dataclasses.dataclass(frozen=True)
class Evaluator:
    """`evaluator(trained params) -> val_loss`: `evaluate` with a run's step, data and layout.

    `model_params` maps what is trained to the tree the model takes (a fine-tune: the base
    with the adapters attached); `sharding` is a mesh run's `[B, T]` batch layout (None: none).
    """

    eval_step: Any
    val_tokens: Any  # [N_val] ids
    train: Any  # the run's TrainConfig: batch_size, grad_accum, eval_batches, seed
    seq_len: int
    vocab_size: int
    model_params: Any
    sharding: Any = None

    def __call__(self, params) -> float:
        return evaluate(
            self.eval_step,
            self.model_params(params),
            self.val_tokens,
            self.train,
            self.seq_len,
            self.sharding,
            vocab_size=self.vocab_size,
        )


__all__ = ["Evaluator", "evaluate"]
