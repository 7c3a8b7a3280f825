"""Optimizers and learning-rate schedules from a `RunConfig` (docs/training.md).

    lr(s) = lr_peak * (s + 1) / W                             for s < W (linear warmup)
    lr(s) = lr_end + (lr_peak - lr_end) * shape((s - W) / (S - W))   for W <= s < S
    lr(s) = lr_end                                            for s >= S
    shape(u) = (1 + cos(pi u)) / 2 (cosine) | 1 - u (linear) | 1 (constant, lr_end unused)

with W = warmup_steps, S = decay_steps (default train.steps), lr_end = lr_peak * final_lr_ratio.
A run of at most W steps (`lmjax train` pins S = W + 1 then) takes every step on the warmup ramp.
Step s is the (s+1)-th update, so warmup's first step already moves (lr_peak / W) and the W-th
reaches the peak.
The gradient transformation is `clip_by_global_norm(clip_norm)` followed by the optimizer; AdamW
decays only parameters whose names match none of `optimizer.no_decay` (by default biases, norm
scales and embeddings). The globs are over per-layer names (`lmjax.params`: a stacked block leaf
`blocks.attention.query.weight [N, ...]` is matched as `blocks.0.attention.query.weight`, ...),
so a glob may exempt some layers of a stacked leaf (`blocks.0.*`): those slices are not
decayed, the others are, as when each layer was a leaf of its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from lmjax import params as ptree
from lmjax.config import OptimizerConfig, RunConfig, ScheduleConfig


def schedule(sched: ScheduleConfig, peak_lr: float, total_steps: int) -> optax.Schedule:
    """The warmup + decay schedule above, as a function of the step (an int or int array)."""
    warmup = sched.warmup_steps
    decay_steps = sched.decay_steps or total_steps
    end = peak_lr * sched.final_lr_ratio

    def lr(step):
        s = jnp.asarray(step, jnp.float32)
        warm = peak_lr * (s + 1.0) / max(warmup, 1)
        u = jnp.clip((s - warmup) / max(decay_steps - warmup, 1), 0.0, 1.0)
        if sched.decay == "cosine":
            decayed = end + (peak_lr - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * u))
        elif sched.decay == "linear":
            decayed = end + (peak_lr - end) * (1.0 - u)
        else:
            decayed = jnp.full_like(u, peak_lr)
        return jnp.where(s < warmup, warm, decayed)

    return lr


def decay_mask(params, no_decay) -> dict:
    """Per leaf, the layers that get weight decay: names matching none of the `no_decay` globs.

    A plain leaf gets a bool; a stacked block leaf a bool when its layers agree, else a tuple
    of N bools (`lmjax.params.layer_matches`)."""

    def decayed(name, leaf):
        exempt = ptree.layer_matches(name, leaf, no_decay)
        if not isinstance(exempt, tuple):
            return not exempt
        return not any(exempt) if all(exempt) or not any(exempt) else tuple(not e for e in exempt)

    return ptree.map_with_names(decayed, params)


def add_decayed_weights(weight_decay: float, no_decay) -> optax.GradientTransformation:
    """`u + weight_decay * p` on the layers `decay_mask` decays, `u` elsewhere: optax's
    `add_decayed_weights(weight_decay, mask)` (what `optax.adamw(mask=...)` holds, with the same
    state) with the mask applied by layer inside a stacked leaf that a glob exempts in part."""

    def one(decayed, u, p):
        if not isinstance(decayed, tuple):
            return u + weight_decay * p if decayed else u
        layers = jnp.asarray(decayed).reshape((-1,) + (1,) * (p.ndim - 1))
        return jnp.where(layers, u + weight_decay * p, u)

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(optax.NO_PARAMS_MSG)
        mask = decay_mask(params, no_decay)
        return jax.tree.map(one, mask, updates, params, is_leaf=_is_tuple), state

    # optax.masked's state: checkpoints of optax.adamw(mask=...) restore into it unchanged.
    init_fn = lambda params: optax.MaskedState(inner_state=optax.EmptyState())  # noqa: E731
    return optax.GradientTransformation(init_fn, update_fn)


def _is_tuple(x) -> bool:
    return isinstance(x, tuple)


def optimizer(opt: OptimizerConfig, lr: optax.Schedule) -> optax.GradientTransformation:
    """Clip by global norm (when set), then AdamW / Adam / SGD with momentum at rate `lr`."""
    if opt.name == "adamw":
        # optax.adamw's own chain, its mask applied by layer (`add_decayed_weights`).
        core = optax.chain(
            optax.scale_by_adam(b1=opt.b1, b2=opt.b2, eps=opt.eps),
            add_decayed_weights(opt.weight_decay, opt.no_decay),
            optax.scale_by_learning_rate(lr),
        )
    elif opt.name == "adam":
        core = optax.adam(lr, b1=opt.b1, b2=opt.b2, eps=opt.eps)
    else:
        core = optax.sgd(lr, momentum=opt.momentum or None, nesterov=opt.nesterov)
    if opt.clip_norm is None:
        return core
    return optax.chain(optax.clip_by_global_norm(opt.clip_norm), core)


def from_config(cfg: RunConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    lr = schedule(cfg.schedule, cfg.optimizer.lr, cfg.train.steps)
    return optimizer(cfg.optimizer, lr), lr
