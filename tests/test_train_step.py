"""The jitted train step: optimizers, decay mask, schedule, accumulation, guards, bf16."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lmjax import models, testing
from lmjax import params as ptree
from lmjax.config import RunConfig
from lmjax.train import init_state, make_train_step, optim
from lmjax.train.step import loss_fn

MODEL = models.preset("gpt")  # V=27, C=16, D=32, 2 layers: 19,419 parameters
# Two float32 programs of one step (other shapes or ops, so other sum orders, and another CPU's
# vector width): lmjax.testing.f32_rtol over the forward's chain, the loss (V, the mean over 4 x
# 16 tokens) and, for gradients, the backward, each summed over those tokens: 1.5e-5 and 2.2e-5.
_CHAIN = testing.forward_chain(MODEL, 16) + MODEL.vocab_size + 64
LOSS_RTOL, GRAD_RTOL = testing.f32_rtol(_CHAIN), testing.f32_rtol(2 * _CHAIN + 64)


# One compiled loss for every test that scores parameters of MODEL's shapes (eagerly, each of
# the forward's ops would compile a program of its own).
jitted_loss = jax.jit(loss_fn, static_argnums=3)


def run_cfg(**overrides) -> RunConfig:
    return RunConfig.from_dict({"model": {"preset": "gpt"}}, overrides)


def batch(accum: int, micro: int, seed: int = 0, t: int = 16) -> dict:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, MODEL.vocab_size, size=(accum, micro, t + 1), dtype=np.int32)
    return {"inputs": tokens[..., :-1], "targets": tokens[..., 1:]}


def test_llama_decay_mask_exempts_rms_scales_and_decays_the_untied_head():
    params = models.abstract_params(models.preset("llama"))
    mask = ptree.flatten(optim.decay_mask(params, run_cfg().optimizer.no_decay))
    exempt = {name for name, decayed in mask.items() if not decayed}
    # The blocks are stored stacked (lmjax.params): one leaf, so one mask entry, for all layers.
    expected = {"token_embedding.weight", "final_norm.scale"} | {
        f"blocks.{n}_norm.scale" for n in ("attention", "feed_forward")
    }
    assert exempt == expected and mask["language_model_head.weight"]


def test_default_decay_mask_exempts_biases_norm_scales_and_embeddings():
    cfg = MODEL.replace(norm="layernorm", bias=True, tie_embeddings=False)
    params = models.abstract_params(cfg)
    decayed = {
        n
        for n, d in ptree.flatten(optim.decay_mask(params, run_cfg().optimizer.no_decay)).items()
        if d
    }
    # Expected from SPEC section 3's names: every linear weight and the head, nothing else
    # (each stacked block leaf once, for all its layers).
    expected = {
        f"blocks.{m}.weight"
        for m in (
            "attention.query",
            "attention.key",
            "attention.value",
            "attention.output",
            "feed_forward.expand",
            "feed_forward.project",
        )
    } | {"language_model_head.weight"}
    assert decayed == expected


def test_adamw_applies_weight_decay_only_where_the_mask_says():
    # With a zero gradient Adam's step is 0, so the whole update is -lr * wd * p on decayed
    # leaves and exactly 0 elsewhere: this checks the mask reaches optax.
    cfg = run_cfg(
        **{
            "optimizer.lr": 0.1,
            "optimizer.weight_decay": 0.5,
            "optimizer.clip_norm": None,
            "schedule.warmup_steps": 0,
            "schedule.decay": "constant",
        }
    )
    tx, _ = optim.from_config(cfg)
    params = models.init(jax.random.PRNGKey(0), MODEL)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)  # one program, not per op
    mask = ptree.flatten(optim.decay_mask(params, cfg.optimizer.no_decay))
    for name, u in ptree.flatten(updates).items():
        p = ptree.flatten(params)[name]
        np.testing.assert_allclose(u, -0.05 * p if mask[name] else 0 * p, rtol=1e-6, atol=0)


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_schedule_matches_its_equation(decay):
    sched = run_cfg(
        **{
            "schedule.warmup_steps": 10,
            "schedule.decay": decay,
            "schedule.decay_steps": 110,
            "schedule.final_lr_ratio": 0.2,
        }
    ).schedule
    lr = optim.schedule(sched, 2.0, total_steps=999)

    def expected(s):
        if s < 10:
            return 2.0 * (s + 1) / 10
        u = min((s - 10) / 100, 1.0)
        shape = {"cosine": (1 + math.cos(math.pi * u)) / 2, "linear": 1 - u, "constant": 1.0}
        return 0.4 + 1.6 * shape[decay] if decay != "constant" else 2.0

    for s in (0, 1, 9, 10, 35, 60, 109, 110, 500):
        assert float(lr(s)) == pytest.approx(expected(s), rel=1e-6, abs=1e-7)


def test_train_step_equals_a_plain_reference_step():
    """One AdamW step through make_train_step equals jax.grad of the reference model + optax."""
    cfg = run_cfg(**{"optimizer.clip_norm": 0.5, "schedule.warmup_steps": 0})
    tx, lr = optim.from_config(cfg)
    state = init_state(jax.random.PRNGKey(1), MODEL, tx)
    b = batch(1, 4)
    ref_cfg = MODEL.replace(ops="reference")

    def ref_loss(p):
        logits = models.forward(p, b["inputs"][0], ref_cfg)
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, b["targets"][0][..., None], -1).mean()

    core = optax.adamw(
        lr,
        b1=0.9,
        b2=0.95,
        eps=1e-8,
        weight_decay=0.1,
        mask=lambda p: optim.decay_mask(p, cfg.optimizer.no_decay),
    )

    @jax.jit  # one program: run eagerly, every op of the reference would compile on its own
    def reference_step(params):
        loss, grads = jax.value_and_grad(ref_loss)(params)
        clipped = optax.clip_by_global_norm(0.5).update(grads, optax.EmptyState())[0]
        updates, _ = core.update(clipped, core.init(params), params)
        return loss, grads, optax.apply_updates(params, updates)

    loss, grads, expected = reference_step(state.params)
    step = make_train_step(MODEL, tx, lr)
    state_before = jax.device_get(state)  # the step donates `state`
    new, metrics = step(state, b)
    assert float(metrics["loss"]) == pytest.approx(float(loss), rel=LOSS_RTOL)
    norm = math.sqrt(
        sum(float((np.asarray(g, np.float64) ** 2).sum()) for g in jax.tree.leaves(grads))
    )
    assert float(metrics["grad_norm"]) == pytest.approx(norm, rel=1e-5)
    assert float(lr(0)) == pytest.approx(
        cfg.optimizer.lr
    )  # no warmup: the update is not trivially zero
    for name, value in ptree.flatten(new.params).items():
        if name.endswith("attention.key.bias"):
            # Its gradient is zero in exact arithmetic (a key bias shifts every score of a row
            # equally, which softmax ignores), so both gradients are rounding noise and Adam's
            # g / (|g| + eps) turns noise into steps of up to lr: only that bound is comparable.
            assert np.abs(ptree.flatten(grads)[name]).max() < 1e-6
            assert np.abs(value - ptree.flatten(state_before.params)[name]).max() <= 1.01 * 3e-4
            continue
        np.testing.assert_allclose(value, ptree.flatten(expected)[name], rtol=1e-5, atol=1e-7)
    assert int(new.step) == 1


@pytest.fixture(scope="module")
def sgd_step():
    cfg = run_cfg(
        **{
            "optimizer.name": "sgd",
            "optimizer.lr": 0.5,
            "optimizer.momentum": 0.0,
            "optimizer.clip_norm": None,
            "schedule.warmup_steps": 0,
            "schedule.decay": "constant",
        }
    )
    tx, lr = optim.from_config(cfg)
    return tx, make_train_step(MODEL, tx, lr)


def test_gradient_accumulation_equals_the_large_batch(sgd_step):
    tx, step = sgd_step
    big = batch(1, 4, seed=3)
    split = {k: v.reshape(2, 2, 16) for k, v in big.items()}
    fresh = lambda: init_state(jax.random.PRNGKey(2), MODEL, tx)  # noqa: E731 (donated)
    start = ptree.flatten(jax.device_get(fresh().params))
    a, ma = step(fresh(), big)
    b, mb = step(fresh(), split)
    assert float(ma["loss"]) == pytest.approx(float(mb["loss"]), rel=LOSS_RTOL)
    # Each SGD update (-lr x gradient) from the two summation orders: float32 sums in another
    # order differ by a few ulps of the largest terms, which an element near zero sees as a
    # large relative error (CI once saw 5.5e-5 on one of 512 entries at |update| 3e-3), so the
    # errors are measured against the largest update of the model, to GRAD_RTOL (derived above,
    # not read off one CPU). Averaging twice as many sequences, or missing a micro-batch, moves
    # the largest updates by O(themselves).
    flat_a, flat_b = ptree.flatten(a.params), ptree.flatten(b.params)
    update_a = {k: np.asarray(flat_a[k], np.float64) - v for k, v in start.items()}
    update_b = {k: np.asarray(flat_b[k], np.float64) - v for k, v in start.items()}
    scale = max(float(np.abs(u).max()) for u in update_a.values())
    for name in start:
        error = np.abs(update_a[name] - update_b[name]).max() / scale
        assert error <= GRAD_RTOL, (name, error)


def test_state_is_donated(sgd_step):
    tx, step = sgd_step
    state = init_state(jax.random.PRNGKey(2), MODEL, tx)
    leaf = state.params["token_embedding"]["weight"]
    step(state, batch(1, 2))
    assert leaf.is_deleted()


def test_non_finite_step_leaves_the_state_unchanged(sgd_step):
    tx, step = sgd_step
    state = init_state(jax.random.PRNGKey(2), MODEL, tx)
    poisoned = dict(state.params, final_norm={**state.params["final_norm"]})
    poisoned["final_norm"]["scale"] = state.params["final_norm"]["scale"].at[0].set(jnp.nan)
    state = state._replace(params=poisoned)
    expected = jax.device_get(state)
    new, metrics = step(state, batch(1, 2))
    assert not bool(metrics["finite"]) and math.isnan(float(metrics["loss"]))
    assert int(new.step) == 0
    for x, y in zip(jax.tree.leaves(new), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_batch_for_another_step_does_not_advance_the_state(sgd_step):
    tx, step = sgd_step
    state = init_state(jax.random.PRNGKey(2), MODEL, tx)
    new, metrics = step(state, {**batch(1, 2), "step": np.int32(5)})
    assert bool(metrics["finite"]) and int(new.step) == 0
    new, _ = step(new, {**batch(1, 2), "step": np.int32(0)})
    assert int(new.step) == 1


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_other_optimizers_reduce_the_loss(name):
    cfg = run_cfg(
        **{
            "optimizer.name": name,
            "optimizer.lr": 0.01 if name == "adam" else 0.5,
            "schedule.warmup_steps": 0,
            "schedule.decay": "constant",
        }
    )
    tx, lr = optim.from_config(cfg)
    step = make_train_step(MODEL, tx, lr)
    state, b = init_state(jax.random.PRNGKey(0), MODEL, tx), batch(1, 4)
    first = float(jitted_loss(state.params, b["inputs"][0], b["targets"][0], MODEL))
    for _ in range(15):
        state, _ = step(state, b)
    assert float(jitted_loss(state.params, b["inputs"][0], b["targets"][0], MODEL)) < first - 0.3


def test_bf16_compute_with_f32_master_weights_trains():
    model = MODEL.replace(dtype="bfloat16")
    cfg = run_cfg(**{"optimizer.lr": 0.01, "schedule.warmup_steps": 0})
    tx, lr = optim.from_config(cfg)
    step = make_train_step(model, tx, lr)
    state, b = init_state(jax.random.PRNGKey(0), model, tx), batch(1, 4)
    losses = []
    for _ in range(30):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(state.params))
    assert all(math.isfinite(x) for x in losses)
    # 30 Adam steps memorise most of a 64-token batch even in bf16 (float32 gets about 1.0).
    assert losses[-1] < 0.5 * losses[0]


def _step_flops(model, accum: int, micro: int):
    """`metrics.xla_flops` of MODEL's train step on abstract `[accum, micro, 16]` batches."""
    from lmjax.train.metrics import xla_flops

    tx, lr = optim.from_config(run_cfg())
    state = jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), model, tx))
    tokens = jax.ShapeDtypeStruct((accum, micro, 16), jnp.int32)
    args = (state, {"inputs": tokens, "targets": tokens})
    traced = make_train_step(model, tx, lr).trace(*args)
    return xla_flops(traced, args, traced.lower().compile(), model.n_layers)


def test_xla_flops_count_every_layer_of_a_scanned_step():
    """XLA's cost analysis counts a `while` body once: the scanned step's own figure holds one
    layer of four. `xla_flops` makes it whole (one layer from a second compile with two layers a
    trip), and it then agrees with the unrolled step's figure, which XLA counts whole itself.

    Tolerance, derived: both programs do the same per-layer work and differ only in how the
    layers' gradients reach the stacked [N, ...] leaves. The scan writes layer i's slice in
    place (no FLOPs); the unrolled backward pads each layer's gradient slice to [N, ...] and
    adds it in, at most 2 N P element-wise FLOPs a layer (P: one layer's parameters), so
    |unrolled - whole| <= 2 N^2 P (32 P here; measured 22 P). Counting the loop's body once
    falls short by about 3 layers' work (hundreds of P), so the check can fail. Two
    micro-batches: the layer loops sit inside the accumulation loop. One remat policy for both
    (none: "auto" picks another for a scan)."""
    n = 4
    model = MODEL.replace(n_layers=n, remat="none")
    scanned, unrolled = (_step_flops(model.replace(scan_layers=s), 2, 2) for s in (True, False))
    p_layer = sum(
        spec.size
        for name, spec in models.declare_layers(model).items()
        if name.startswith("blocks.0.")
    )
    assert unrolled.per_layer is None and unrolled.whole == unrolled.counted  # no layer loop
    assert scanned.per_layer is not None and scanned.per_layer > 0
    tolerance = 2 * n * n * p_layer
    assert abs(unrolled.whole - scanned.whole) <= tolerance, (unrolled, scanned, p_layer)
    assert unrolled.whole - scanned.counted > 2 * scanned.per_layer > 10 * tolerance
    assert scanned.whole == scanned.outside_layers + n * scanned.per_layer


def test_layers_per_trip_keeps_a_loop_of_whole_trips():
    from lmjax.train.metrics import layers_per_trip

    # u divides N and leaves >= 2 trips; else N (no loop left to count once); 1 for one layer.
    assert [layers_per_trip(n) for n in (1, 2, 3, 4, 6, 9, 12, 13, 32)] == [
        1,
        2,
        3,
        2,
        2,
        3,
        2,
        13,
        2,
    ]
