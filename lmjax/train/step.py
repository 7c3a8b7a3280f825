"""The jitted train and eval steps (docs/training.md).

    loss(θ; x, y) = mean_{b,t} CE(forward(θ, x)[b, t], y[b, t])
    g = (1/A) Σ_a ∇θ loss(θ; x_a, y_a)          over A micro-batches (gradient accumulation)
    g = Σ_a (n_a / Σ n) ∇θ loss(θ; x_a, y_a, m_a)   with a loss mask m (n_a its 1s): by tokens
    θ', opt' = optimizer(clip(g), opt, θ)

`train_step(state, batch) -> (state, metrics)` is one `jax.jit` with the state donated, so the
new parameters and optimizer state reuse the old buffers. A step whose loss, gradient norm or
new parameters are not all finite leaves the state unchanged (parameters never become NaN or
inf); when the batch carries its `step`, a state whose counter disagrees is not advanced either,
so after a non-finite step the state stays at the last good step and `state.step` tells the
caller where the run failed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from lmjax import models
from lmjax.checks import require
from lmjax.models import ModelConfig

# Re-exported: they sit below lora, which uses them.
from lmjax.models.loss import Loss, counted_tokens, loss_fn


class TrainState(NamedTuple):
    """Everything a resumed run needs besides the data, which is a function of (seed, step)."""

    step: jax.Array  # int32 scalar: optimizer steps taken
    params: dict
    opt_state: Any
    key: jax.Array  # uint32[2]: the run's dropout key; step keys are fold_in(key, step)


def init_state(
    key: jax.Array, cfg: ModelConfig, tx: optax.GradientTransformation, init_params=None
) -> TrainState:
    """Step 0: parameters from `init_params(key)` (default `models.init(key, cfg)`; LoRA's
    adapters for fine-tuning), the optimizer state of exactly those, and the dropout key.

    LoRA (docs/fine-tuning.md): the adapters are the state, the base stays outside it,
    `init_state(key, model_cfg, tx, init_params=lambda k: lora.init(k, base, lcfg))`."""
    require(
        isinstance(cfg, ModelConfig),
        "init_state's cfg",
        type(cfg).__name__,
        "the ModelConfig (also for LoRA: the adapters come from init_params)",
        "call init_state(key, model_cfg, tx, init_params=lambda k: lora.init(k, base, lcfg))",
    )
    init_key, dropout_key = jax.random.split(key)
    params = models.init(init_key, cfg) if init_params is None else init_params(init_key)
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), dropout_key)


def model_loss(cfg: ModelConfig) -> Loss:
    """The default objective: `loss_fn` of every model parameter (nothing frozen)."""

    def loss(params, frozen, inputs_BT, targets_BT, dropout_key, **masks):
        del frozen
        return loss_fn(params, inputs_BT, targets_BT, cfg, dropout_key, **masks)

    return Loss(loss, uses_key=cfg.dropout > 0.0)


# Optional batch keys -> the loss's keywords (lmjax.models.loss.loss_fn).
BATCH_MASKS = {"loss_mask": "loss_mask_BT", "segment_ids": "segment_ids_BT"}


def batch_masks(batch: dict) -> dict:
    """`{loss keyword: array}` for the optional keys `batch` carries (none: {})."""
    return {kw: batch[key] for key, kw in BATCH_MASKS.items() if key in batch}


def token_weights(batch_ABT: dict) -> jax.Array | None:
    """float32 `[A]`: micro-batch a's share of the step's counted tokens, count_a / Σ count
    (Σ 0: all zero), so that Σ_a w_a mean_a is the mean over every counted token; None
    without a loss mask (every micro-batch counts all its B*T tokens: weights 1/A)."""
    if "loss_mask" not in batch_ABT:
        return None
    counts_A = jax.vmap(counted_tokens)(batch_ABT["targets"], batch_ABT["loss_mask"])
    return counts_A.astype(jnp.float32) / jnp.maximum(jnp.sum(counts_A), 1).astype(jnp.float32)


def _mean_loss_and_grads(loss: Loss, params, frozen, batch_ABT: dict, key):
    """Loss and gradient over the A micro-batches, accumulated with `lax.scan`: the plain mean
    (1/A) Σ_a without a loss mask, else weighted by tokens, Σ_a w_a (`token_weights`)."""
    grad_fn = jax.value_and_grad(loss.fn)
    inputs_ABT, targets_ABT = batch_ABT["inputs"], batch_ABT["targets"]
    masks_A = batch_masks(batch_ABT)
    a = inputs_ABT.shape[0]
    keys = jax.random.split(key, a) if loss.uses_key else None
    if a == 1:  # no accumulation: skip the scan (one micro-batch's mean is the step's)
        k = None if keys is None else keys[0]
        masks = jax.tree.map(lambda m: m[0], masks_A)
        return grad_fn(params, frozen, inputs_ABT[0], targets_ABT[0], k, **masks)
    weights_A = token_weights(batch_ABT)

    def micro(carry, xs):
        inputs_BT, targets_BT, k, masks, w = xs
        value = grad_fn(params, frozen, inputs_BT, targets_BT, k, **masks)
        if w is not None:  # weighted in the loop: the sum then needs no division
            value = jax.tree.map(lambda v: (w * v).astype(v.dtype), value)
        return jax.tree.map(jnp.add, carry, value), None

    zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    xs = (inputs_ABT, targets_ABT, keys, masks_A, weights_A)
    (loss_sum, grads), _ = jax.lax.scan(micro, zero, xs)
    if weights_A is not None:
        return loss_sum, grads
    return loss_sum / a, jax.tree.map(lambda g: g / a, grads)


def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]))


def global_norm(tree) -> jax.Array:
    """sqrt(sum of squares over every leaf), in float32."""
    leaves = jax.tree.leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def make_train_step(
    cfg: ModelConfig,
    tx: optax.GradientTransformation,
    lr: optax.Schedule,
    state_sharding: Any = None,
    loss: Loss | None = None,
):
    """`train_step(state, batch, frozen=None) -> (state, metrics)`, jitted, state donated.

    batch: `{"inputs": int [A, B, T], "targets": int [A, B, T]}` (A micro-batches; A = 1 for no
    accumulation) and optionally `"step"`: the step this batch belongs to, and packed or
    masked data's `"segment_ids"` int `[A, B, T]` (to the model) and `"loss_mask"` `[A, B, T]`
    (bool or 0/1: the loss is the mean over its 1s across all micro-batches).
    metrics: loss, grad_norm (before clipping), lr (used by this step), finite (bool), and
    with a loss mask real_token_fraction = mean(loss_mask).
    `state_sharding`: a `TrainState` of shardings (`lmjax.parallel`) the new state is pinned to,
    so it leaves the step laid out as it came in and the donated buffers are reused; the batch
    arrives already sharded and XLA partitions everything in between.
    `loss`: the objective (default `model_loss(cfg)`, all parameters trained); LoRA passes one
    whose trained `state.params` are the adapters and whose `frozen` argument (not donated,
    no gradient, no optimizer state) is the base model.
    """
    objective = loss or model_loss(cfg)

    def train_step(state: TrainState, batch: dict, frozen=None) -> tuple[TrainState, dict]:
        key = jax.random.fold_in(state.key, state.step)
        loss, grads = _mean_loss_and_grads(objective, state.params, frozen, batch, key)
        grad_norm = global_norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # The new parameters too: a finite gradient times a huge step can still overflow.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & _all_finite(params)
        ok = finite if "step" not in batch else finite & (batch["step"] == state.step)
        new = TrainState(state.step + 1, params, opt_state, state.key)
        # cond, not a per-leaf where: XLA then passes the donated buffers through instead of
        # copying the Adam moments (measured ~1% of a CPU step).
        new = jax.lax.cond(ok, lambda: new, lambda: state)
        if state_sharding is not None:
            new = jax.lax.with_sharding_constraint(new, state_sharding)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr(state.step), "finite": finite}
        if "loss_mask" in batch:
            metrics["real_token_fraction"] = jnp.mean(batch["loss_mask"].astype(jnp.float32))
        return new, metrics

    return jax.jit(_traced_on(_mesh_of(state_sharding), train_step), donate_argnums=0)


def _mesh_of(sharding: Any) -> Mesh | None:
    """The one mesh of `sharding`'s `NamedSharding` leaves, else None."""
    meshes = {s.mesh for s in jax.tree.leaves(sharding) if isinstance(s, NamedSharding)}
    return meshes.pop() if len(meshes) == 1 else None


def _traced_on(mesh: Mesh | None, fn: Callable) -> Callable:
    """`fn`, traced with `mesh` in context (None: `fn` itself), so the model can split what XLA
    cannot: `lmjax.models.attention` shard-maps the flash kernel (a Mosaic call XLA's TPU
    partitioner refuses)."""
    if mesh is None:
        return fn
    abstract = mesh.abstract_mesh

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(abstract):
            return fn(*args, **kwargs)

    return traced


def make_eval_step(cfg: ModelConfig, mesh: Mesh | None = None):
    """`eval_step(params, inputs_BT, targets_BT, loss_mask_BT=None, segment_ids_BT=None) ->
    mean loss` (no dropout; over the mask's 1s), jitted; traced on `mesh` when one is given,
    as the train step is on its state's mesh."""

    def eval_step(params, inputs_BT, targets_BT, loss_mask_BT=None, segment_ids_BT=None):
        masks = {"loss_mask_BT": loss_mask_BT, "segment_ids_BT": segment_ids_BT}
        return loss_fn(params, inputs_BT, targets_BT, cfg, **masks)

    return jax.jit(_traced_on(mesh, eval_step))
