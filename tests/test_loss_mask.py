"""Loss masks through the fused head, the loss, the train step and its accumulation.

    L = Σ_n m_n nll_n / Σ_n m_n        (m: the 0/1 loss mask; Σ m = 0 gives L = 0, zero gradients)

Witnesses: a plain-jnp masked mean written here, `jax.grad` of it, float64 finite differences,
and torch's `cross_entropy` over the counted positions. The train step: A micro-batches with
different mask counts equal the one big batch (weights by tokens, not by micro-batch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torch.nn.functional as F

from lmjax import lora, models, ops, testing
from lmjax import params as ptree
from lmjax.config import TrainConfig
from lmjax.data import eval_batch
from lmjax.errors import ShapeError
from lmjax.testing import F32_RTOL, FD_RTOL, OpCase
from lmjax.train.evaluate import evaluate
from lmjax.train.step import init_state, loss_fn, make_eval_step, make_train_step

V, D = 7, 4
MODEL = models.preset("gpt")  # V=27, C=16, D=32, 2 layers


def _masked_args(shape_BT, empty=False):
    """(params, x, targets, mask): a mask with zeros in every row (all zeros when `empty`)."""

    def make(rng, dtype):
        params = {
            "weight": jnp.asarray(rng.standard_normal((V, D)), dtype),
            "bias": jnp.asarray(rng.standard_normal(V), dtype),
        }
        x = jnp.asarray(1.5 * rng.standard_normal((*shape_BT, D)), dtype)
        y = jnp.asarray(rng.integers(0, V, shape_BT), jnp.int32)
        mask = (rng.random(shape_BT) < 0.6).astype(np.float32)
        mask[..., 0] = 0.0
        mask[..., -1] = 1.0
        return params, x, y, jnp.asarray(0 * mask if empty else mask)

    return make


def plain_masked_mean(params, x, y, mask):
    """The masked mean written out in jnp, independent of lmjax's loss code."""
    z = jnp.einsum("...d,vd->...v", x, params["weight"]) + params["bias"][None, None, :]
    logp = jax.nn.log_softmax(z, axis=-1)
    nll = -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]
    return jnp.sum(mask * nll) / jnp.maximum(jnp.sum(mask), 1.0)


def fused(params, x, y, mask):
    return ops.linear_cross_entropy(params, x, y, loss_mask=mask, chunk=3)


def reference(params, x, y, mask):
    return ops.linear_cross_entropy_reference(params, x, y, loss_mask=mask)


CASE = OpCase("masked_ragged_chunks", fused, plain_masked_mean, _masked_args((2, 5)), (0, 1))


def test_fused_masked_loss_matches_jnp_and_its_gradient():
    report = testing.compare_with_reference(CASE, seed=0, transform=jax.jit)
    assert report.within(F32_RTOL) and report.grad_scale > 0, report
    lmjax_reference = OpCase("ref", reference, plain_masked_mean, CASE.make_args, (0, 1))
    assert testing.compare_with_reference(lmjax_reference, seed=1).within(F32_RTOL)


def test_fused_masked_loss_matches_finite_differences():
    assert testing.finite_difference_error(CASE, seed=0) <= FD_RTOL


def unfused(params, x, y, mask):
    """`ops.cross_entropy` of the logits (the path of a reference-ops or adapted head)."""
    logits = jnp.einsum("btd,vd->btv", x, params["weight"]) + params["bias"][None, None, :]
    return ops.cross_entropy(logits, y, loss_mask=mask)


@pytest.mark.parametrize("op", [fused, unfused])
def test_masked_rows_get_exactly_zero_gradient(op):
    params, x, y, mask = _masked_args((2, 5))(np.random.default_rng(2), jnp.float32)
    dx = jax.grad(op, argnums=1)(params, x, y, mask)
    masked = np.asarray(mask) == 0
    assert (np.asarray(dx)[masked] == 0.0).all()
    assert (np.abs(np.asarray(dx)[~masked]).max(axis=-1) > 0).all()


def test_matches_torch_over_the_counted_positions():
    params, x, y, mask = _masked_args((3, 5))(np.random.default_rng(3), jnp.float32)
    with jax.default_matmul_precision("highest"):
        loss, (dp, dx) = jax.value_and_grad(fused, argnums=(0, 1))(params, x, y, mask)
    tw = torch.tensor(np.asarray(params["weight"]), requires_grad=True)
    tb = torch.tensor(np.asarray(params["bias"]), requires_grad=True)
    tx = torch.tensor(np.asarray(x), requires_grad=True)
    ty = torch.tensor(np.where(np.asarray(mask) == 1, np.asarray(y), -100), dtype=torch.long)
    tloss = F.cross_entropy(F.linear(tx, tw, tb).reshape(-1, V), ty.reshape(-1))
    tloss.backward()
    assert abs(float(loss) - tloss.item()) <= F32_RTOL * max(1.0, abs(tloss.item()))
    for mine, theirs in [(dp["weight"], tw.grad), (dp["bias"], tb.grad), (dx, tx.grad)]:
        err = np.max(np.abs(np.asarray(mine) - theirs.numpy()))
        assert err <= F32_RTOL * max(1.0, np.abs(theirs.numpy()).max()), err


def test_an_all_zero_mask_gives_zero_loss_and_zero_gradients():
    params, x, y, mask = _masked_args((2, 5), empty=True)(np.random.default_rng(4), jnp.float32)
    for op in (fused, reference):
        loss, (dp, dx) = jax.value_and_grad(op, argnums=(0, 1))(params, x, y, mask)
        assert float(loss) == 0.0
        assert all((np.asarray(g) == 0.0).all() for g in jax.tree.leaves((dp, dx)))


def test_bad_masks_are_named():
    params, x, y, mask = _masked_args((2, 5))(np.random.default_rng(5), jnp.float32)
    with pytest.raises(ShapeError, match="loss_mask.shape"):
        ops.linear_cross_entropy(params, x, y, loss_mask=mask[:, :3])
    with pytest.raises(ShapeError, match=r"loss_mask\[0, 1\]"):  # a weight, not a 0/1 mask
        ops.linear_cross_entropy(params, x, y, loss_mask=mask.at[0, 1].set(0.5))
    with pytest.raises(ShapeError, match="loss_mask.shape"):
        ops.cross_entropy(jnp.zeros((2, 5, V)), y, loss_mask=mask[:1])


# ---- the model's loss and the train step ---------------------------------------------------


def _batch(accum, micro, seed=0, t=16):
    """`[A, b, T]` inputs/targets and a loss mask whose 1s differ in number per micro-batch."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, MODEL.vocab_size, size=(accum, micro, t + 1), dtype=np.int32)
    mask = np.zeros((accum, micro, t), np.float32)
    for a in range(accum):
        mask[a, :, : 3 + 9 * a] = 1.0  # micro-batch 0 counts 3 per row, 1 counts 12
    return {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "loss_mask": mask}


def test_model_loss_with_a_mask_is_the_masked_mean_of_the_logits():
    params = models.init(jax.random.PRNGKey(0), MODEL)
    b = {k: v[0] for k, v in _batch(1, 2, seed=1).items()}
    logits = models.forward(params, b["inputs"], MODEL)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -np.take_along_axis(np.asarray(logp), b["targets"][..., None], axis=-1)[..., 0]
    expected = (nll * b["loss_mask"]).sum() / b["loss_mask"].sum()
    masked_loss = jax.jit(loss_fn, static_argnums=3)
    for cfg in (MODEL, MODEL.replace(ops="reference")):  # fused head and forward + CE
        got = masked_loss(params, b["inputs"], b["targets"], cfg, loss_mask_BT=b["loss_mask"])
        assert float(got) == pytest.approx(float(expected), rel=1e-5)
    evaluated = make_eval_step(MODEL)(params, b["inputs"], b["targets"], b["loss_mask"])
    assert float(evaluated) == pytest.approx(float(expected), rel=1e-5)


@pytest.fixture(scope="module")
def sgd():
    tx = optax.sgd(0.5)
    return tx, make_train_step(MODEL, tx, optax.constant_schedule(0.5))


def test_accumulation_weights_micro_batches_by_their_counted_tokens(sgd):
    tx, step = sgd
    split = _batch(2, 2, seed=3)
    big = {k: v.reshape(1, 4, 16) for k, v in split.items()}
    fresh = lambda: init_state(jax.random.PRNGKey(2), MODEL, tx)  # noqa: E731 (donated)
    a, ma = step(fresh(), big)
    b, mb = step(fresh(), split)
    assert float(ma["loss"]) == pytest.approx(float(mb["loss"]), rel=1e-6)
    for name, value in ptree.flatten(a.params).items():  # F32_RTOL of the leaf's scale
        other = np.asarray(ptree.flatten(b.params)[name])
        assert np.abs(np.asarray(value) - other).max() <= F32_RTOL * max(1.0, np.abs(other).max())
    # The metric: mean(loss_mask) = (2*3 + 2*12) / (4*16).
    assert float(mb["real_token_fraction"]) == pytest.approx(30 / 64)
    # Averaging the two micro-batch means (the unmasked rule) would be a different loss.
    params = fresh().params
    means = [
        loss_fn(params, split["inputs"][i], split["targets"][i], MODEL,
                loss_mask_BT=split["loss_mask"][i])
        for i in range(2)
    ]  # fmt: skip
    assert abs(np.mean(means) - float(mb["loss"])) > 1e-3


def test_an_all_zero_mask_step_changes_nothing(sgd):
    tx, step = sgd
    empty = {k: v if k != "loss_mask" else 0 * v for k, v in _batch(2, 2, seed=4).items()}
    before = init_state(jax.random.PRNGKey(2), MODEL, tx)
    expected = jax.tree.map(np.asarray, before.params)
    after, m = step(before, empty)
    assert float(m["loss"]) == 0.0 and float(m["grad_norm"]) == 0.0 and bool(m["finite"])
    for x, y in zip(jax.tree.leaves(after.params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(x), y)


def test_lora_objective_takes_the_mask():
    lcfg = lora.LoraConfig(r=2)
    base = models.init(jax.random.PRNGKey(0), MODEL)
    adapters = lora.init(jax.random.PRNGKey(1), base, lcfg)
    b = {k: v[0] for k, v in _batch(1, 2, seed=5).items()}
    objective = lora.objective(MODEL, lcfg)
    masked = objective.fn(adapters, base, b["inputs"], b["targets"], None,
                          loss_mask_BT=b["loss_mask"])  # fmt: skip
    attached = lora.attach(base, adapters, lcfg)
    expected = loss_fn(attached, b["inputs"], b["targets"], MODEL, loss_mask_BT=b["loss_mask"])
    unmasked = loss_fn(attached, b["inputs"], b["targets"], MODEL)
    assert float(masked) == pytest.approx(float(expected), rel=1e-6)
    assert abs(float(masked) - float(unmasked)) > 1e-3


def test_a_packed_batch_reaches_the_model_through_the_step(sgd):
    """segment_ids go to the model: the step's loss is loss_fn's with them, not without."""
    tx, step = sgd
    b = _batch(1, 2, seed=6)
    b["loss_mask"][:] = 1.0
    b["segment_ids"] = np.repeat(np.array([1] * 7 + [2] * 9, np.int32)[None, None], 2, axis=1)
    state = init_state(jax.random.PRNGKey(2), MODEL, tx)
    args = (state.params, b["inputs"][0], b["targets"][0], MODEL)
    packed = float(loss_fn(*args, segment_ids_BT=b["segment_ids"][0]))
    plain = float(loss_fn(*args))
    _, metrics = step(state, b)
    assert float(metrics["loss"]) == pytest.approx(packed, rel=1e-6)
    assert abs(packed - plain) > 1e-4 and float(metrics["real_token_fraction"]) == 1.0


def test_packed_validation_is_the_token_weighted_mean():
    """evaluate() passes the masks and weights each batch by its counted tokens."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, MODEL.vocab_size, 400).astype(np.uint16)
    cuts = np.cumsum(rng.integers(2, 12, 80))  # documents of 2-11 tokens
    documents = np.concatenate([[0], cuts[cuts < 400], [400]]).astype(np.int64)
    t = TrainConfig(batch_size=2, eval_batches=2)
    step = make_eval_step(MODEL)
    params = models.init(jax.random.PRNGKey(0), MODEL)
    got = evaluate(step, params, tokens, t, 16, documents=documents)
    total = count = 0.0
    counts = []
    for i in range(2):
        b = eval_batch(tokens, t.seed, i, 2, 16, None, documents)
        n = float(b["loss_mask"].sum())
        assert "segment_ids" in b and 0 < n < b["loss_mask"].size  # boundaries are masked
        mean = loss_fn(params, b["inputs"], b["targets"], MODEL, loss_mask_BT=b["loss_mask"],
                       segment_ids_BT=b["segment_ids"])  # fmt: skip
        total, count = total + n * float(mean), count + n
        counts.append(n)
    assert counts[0] != counts[1]  # so the plain mean of the two would differ
    assert got == pytest.approx(total / count, rel=1e-6)
