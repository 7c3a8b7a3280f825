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
scales and embeddings).
"""

from __future__ import annotations

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
    """True for every leaf that gets weight decay: names matching none of the `no_decay` globs."""
    return ptree.map_with_names(lambda name, _: not ptree.matches(name, no_decay), params)


def optimizer(opt: OptimizerConfig, lr: optax.Schedule) -> optax.GradientTransformation:
    """Clip by global norm (when set), then AdamW / Adam / SGD with momentum at rate `lr`."""
    if opt.name == "adamw":
        core = optax.adamw(
            lr,
            b1=opt.b1,
            b2=opt.b2,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            mask=lambda p: decay_mask(p, opt.no_decay),
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
