"""Validation loss: the mean over a run's fixed validation batches.

    val_loss = mean_i loss(params, eval_batch(i)),   i = 0 .. train.eval_batches - 1
    val_loss = Σ_i n_i loss_i / Σ_i n_i             with loss masks (n_i: batch i's counted tokens)

each batch `[B, T]` with B = batch_size / grad_accum (one micro-batch) and T = seq_len, the same
batches at every evaluation and in `lmjax eval` (`lmjax.data.prepared.eval_batch`): random crops,
or with the split's document offsets (data.packing) packed rows with segment ids and a mask.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from lmjax.data import prepared as D
from lmjax.models.loss import counted_tokens


def evaluate(
    eval_step,
    params,
    val_tokens,
    t,
    seq_len: int,
    sharding=None,
    vocab_size: int | None = None,
    documents=None,
) -> float:
    """Mean loss over the `t.eval_batches` fixed validation batches (micro-batch sized).

    `sharding`: lay each `[B, T]` batch out by it (every host computes the same batch and
    hands over only its devices' rows); None: host arrays. `vocab_size`: refuse a batch with
    an id outside the vocabulary (`TokenError`; the gather would clamp it). `documents`: the
    split's document offsets for packed batches (None: random crops).
    """
    micro = t.batch_size // t.grad_accum

    def batch(i: int) -> dict:
        return D.eval_batch(val_tokens, t.seed, i, micro, seq_len, vocab_size, documents)

    def place(arrays: dict) -> dict:
        if sharding is None:
            return arrays
        return {
            k: jax.make_array_from_callback(a.shape, sharding, a.__getitem__)
            for k, a in arrays.items()
        }

    losses, counts = [], []
    for i in range(t.eval_batches):
        b = batch(i)
        mask = b.get("loss_mask")
        counts.append(None if mask is None else counted_tokens(b["targets"], mask))
        on = place(b)
        # The masks only when present: an unpacked batch calls eval_step as it always did.
        masks = {f"{k}_BT": on[k] for k in _MASK_KEYS if k in on}
        losses.append(eval_step(params, on["inputs"], on["targets"], **masks))
    if counts[0] is None:  # every batch counts all its B*T tokens
        return float(np.mean(jax.device_get(losses)))
    losses, weights = (np.asarray(jax.device_get(v), np.float64) for v in (losses, counts))
    return float(np.sum(weights * losses) / max(np.sum(weights), 1.0))


_MASK_KEYS = ("loss_mask", "segment_ids")  # eval_step's optional `<key>_BT` arguments


@dataclasses.dataclass(frozen=True)
class Evaluator:
    """`evaluator(trained params) -> val_loss`: `evaluate` with a run's step, data and layout.

    `model_params` maps what is trained to the tree the model takes (a fine-tune: the base
    with the adapters attached); `sharding` is a mesh run's `[B, T]` batch layout (None: none);
    `val_documents` the validation split's document offsets when packing (None: crops).
    """

    eval_step: Any
    val_tokens: Any  # [N_val] ids
    train: Any  # the run's TrainConfig: batch_size, grad_accum, eval_batches, seed
    seq_len: int
    vocab_size: int
    model_params: Any
    sharding: Any = None
    val_documents: Any = None

    def __call__(self, params) -> float:
        return evaluate(
            self.eval_step,
            self.model_params(params),
            self.val_tokens,
            self.train,
            self.seq_len,
            self.sharding,
            vocab_size=self.vocab_size,
            documents=self.val_documents,
        )


__all__ = ["Evaluator", "evaluate"]
