"""Models (SPEC section 3): names, counts, init, behaviour (causality, remat, op sets), dtypes.

Behavioural guarantees are checked through gradients, not shapes: causality as zero gradients
from future positions, remat as identical outputs and gradients, the custom-VJP model against
`jax.grad` of the same model built from the `*_reference` ops.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmjax import models, ops, testing
from lmjax import params as ptree

# float32, matmul precision highest (conftest). Model losses and gradients use loss_rtol and
# grad_rtol below (derived); F32_RTOL is for embeddings (one rounding) and the flash curve.
F32_RTOL = 1e-5
BF16_RTOL = 2e-2  # bfloat16 compute keeps 8 mantissa bits; errors compound over 2 blocks

# Tiny sizes for each family; the counting configs of SPEC section 3 are the presets themselves.
TINY = dict(vocab_size=27, context_length=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)
CONFIGS = {
    "gpt": models.preset("gpt"),
    "gpt2": models.preset("gpt2", **TINY),
    "llama": models.preset("llama"),
    "sinusoidal-relu-nobias": models.preset(
        "gpt", positions="sinusoidal", activation="relu", bias=False
    ),
    "rmsnorm-swiglu-bias-tied": models.preset(
        "gpt", norm="rmsnorm", activation="swiglu", tie_embeddings=True
    ),
}


# Jitted: one program per config (configs are static pytrees) where a test only needs the
# model's values; test_remat_is_bit_identical_op_by_op runs it eagerly on purpose.
forward = jax.jit(models.forward)


def tokens_for(cfg: models.ModelConfig, seed: int = 0, batch: int = 2) -> jnp.ndarray:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, cfg.context_length)), jnp.int32)


def loss_fn(params, tokens, cfg, dropout_key=None):
    logits = models.forward(params, tokens[:, :-1], cfg, dropout_key=dropout_key)
    return ops.cross_entropy(logits, tokens[:, 1:])


@functools.cache
def value_and_grad(cfg: models.ModelConfig):
    return jax.jit(jax.value_and_grad(loss_fn), static_argnums=2)


def losses_and_grads(cfg: models.ModelConfig, **changes):
    """(loss, grads) of `cfg` and of `cfg.replace(**changes)` on the same params and batch."""
    params, tokens = models.init(jax.random.key(0), cfg), tokens_for(cfg)
    other = cfg.replace(**changes)
    return value_and_grad(cfg)(params, tokens, cfg), value_and_grad(other)(params, tokens, other)


def loss_rtol(cfg: models.ModelConfig) -> float:
    """Two float32 programs of one model's loss (other fusion, other sum order, another CPU's
    vector width): lmjax.testing.f32_rtol of the forward's chain, then V and the token mean."""
    t = cfg.context_length - 1
    return testing.f32_rtol(testing.forward_chain(cfg, t) + cfg.vocab_size + 2 * t)


def grad_rtol(cfg: models.ModelConfig) -> float:
    """The same for gradients (`max_rel_error`): the forward, the loss, the backward through the
    same chain, each weight gradient summed over the 2 t tokens; 2e-5 for these configs. A VJP
    term dropped or mis-scaled moves a gradient by O(its size)."""
    t = cfg.context_length - 1
    return testing.f32_rtol(2 * testing.forward_chain(cfg, t) + cfg.vocab_size + 4 * t)


def max_rel_error(a, b) -> float:
    """Worst per-leaf `max |a - b|` over the whole tree's `max |b|`.

    Normalized by the largest entry of the whole tree because some leaves are mathematically
    zero (a key bias adds the same q.b_k to every score of a row, and softmax ignores that), so
    their entries are pure rounding noise and a per-leaf ratio would compare noise to noise.
    """
    scale = max(float(jnp.max(jnp.abs(y))) for y in jax.tree.leaves(b))
    errs = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y))), a, b)
    return max(jax.tree.leaves(errs)) / scale


def nonzero_leaves(grads) -> set[str]:
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads))
    return {k for k, g in ptree.flatten(grads).items() if float(jnp.max(jnp.abs(g))) > 1e-4 * scale}


# ---- names and counts -------------------------------------------------------------------------


def spec_names(n_layers: int, *, swiglu: bool, biases: bool, norm_bias: bool, head: str, pos: bool):
    """The flattened names, written out from SPEC section 3's list (not from lmjax.models)."""
    names = ["token_embedding.weight"] + (["position_embedding.weight"] if pos else [])
    norm = ["scale", "bias"] if norm_bias else ["scale"]
    params = ["weight", "bias"] if biases else ["weight"]
    for i in range(n_layers):
        b = f"blocks.{i}"
        names += [f"{b}.attention_norm.{s}" for s in norm]
        names += [
            f"{b}.attention.{p}.{w}" for p in ("query", "key", "value", "output") for w in params
        ]
        names += [f"{b}.feed_forward_norm.{s}" for s in norm]
        ff = ("gate", "up", "down") if swiglu else ("expand", "project")
        names += [f"{b}.feed_forward.{p}.{w}" for p in ff for w in params]
    names += [f"final_norm.{s}" for s in norm]
    if head != "tied":
        names += ["language_model_head.weight"] + (
            ["language_model_head.bias"] if head == "bias" else []
        )
    return sorted(names)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("gpt", dict(swiglu=False, biases=True, norm_bias=True, head="bias", pos=True)),
        ("gpt2", dict(swiglu=False, biases=True, norm_bias=True, head="tied", pos=True)),
        ("llama", dict(swiglu=True, biases=False, norm_bias=False, head="weight", pos=False)),
    ],
)
def test_parameter_names_are_the_spec_list(name, expected):
    cfg = CONFIGS[name]
    params = jax.eval_shape(lambda k: models.init(k, cfg), jax.random.key(0))
    per_layer = spec_names(cfg.n_layers, **expected)
    assert sorted(ptree.flatten(ptree.unstack(params))) == per_layer
    assert list(ptree.flatten(params)) == list(models.declare(cfg)), "init follows the declaration"
    # Stored stacked: each block leaf once, its per-layer shapes behind a leading N axis.
    stacked = sorted({re.sub(r"^blocks\.\d+\.", "blocks.", n) for n in per_layer})
    assert sorted(ptree.flatten(params)) == stacked
    layer_shapes = {n: a.shape for n, a in ptree.flatten(ptree.unstack(params)).items()}
    for name, leaf in ptree.flatten(params).items():
        if name.startswith("blocks."):
            each = ptree.layer_names(name, cfg.n_layers)
            assert leaf.shape == (cfg.n_layers, *layer_shapes[each[0]]), name


def _eval_count(cfg) -> int:
    return ptree.count(jax.eval_shape(lambda k: models.init(k, cfg), jax.random.key(0)))


def test_counts_of_the_spec_configs():
    gpt = models.preset("gpt")
    assert (
        gpt.vocab_size,
        gpt.context_length,
        gpt.d_model,
        gpt.d_ff,
        gpt.n_layers,
        gpt.n_heads,
    ) == (27, 16, 32, 64, 2, 4)
    assert _eval_count(gpt) == models.param_count(gpt) == 19_419
    llama = models.preset("llama")
    assert (llama.vocab_size, llama.d_model, llama.n_layers, llama.n_heads, llama.d_ff) == (
        16,
        32,
        2,
        2,
        64,
    )
    assert _eval_count(llama) == models.param_count(llama) == 21_664


def test_gpt2_full_sizes_match_hugging_face_without_allocating():
    # Hugging Face's GPT2LMHeadModel reports 124,439,808 (small) and 354,823,168 (medium)
    # parameters with the head tied to wte; eval_shape allocates nothing.
    assert _eval_count(models.preset("gpt2-124m")) == 124_439_808
    assert _eval_count(models.preset("gpt2-350m")) == 354_823_168
    assert models.preset("gpt2") == models.preset("gpt2-124m")


def test_every_preset_builds_and_counts_agree():
    for name in models.PRESETS:
        cfg = models.preset(name)
        assert _eval_count(cfg) == models.param_count(cfg) > 0, name


# ---- init -------------------------------------------------------------------------------------


def test_init_is_deterministic_and_follows_the_declaration():
    cfg = CONFIGS["gpt"]
    a, b = models.init(jax.random.key(3), cfg), models.init(jax.random.key(3), cfg)
    c = models.init(jax.random.key(4), cfg)
    jax.tree.map(np.testing.assert_array_equal, a, b)
    assert list(ptree.flatten(a)) == list(models.declare(cfg))
    # Per layer (the stacked leaves sliced), each layer's leaf follows its own declaration.
    flat_a, flat_c = ptree.flatten(ptree.unstack(a)), ptree.flatten(ptree.unstack(c))
    for name, spec in models.declare_layers(cfg).items():
        leaf = np.asarray(flat_a[name])
        assert leaf.shape == spec.shape and leaf.dtype == np.float32, name
        if spec.init == "zeros":
            assert not leaf.any(), name
        elif spec.init == "ones":
            assert (leaf == 1).all(), name
        elif spec.init == "xavier_uniform":
            out_f, in_f = spec.shape
            assert np.abs(leaf).max() <= np.sqrt(6 / (in_f + out_f)), name
            assert not np.array_equal(leaf, np.asarray(flat_c[name])), "depends on the key"
        else:
            assert abs(leaf.std() - 0.02) < 0.004, name
    weights = [np.asarray(v) for k, v in flat_a.items() if k.endswith("query.weight")]
    assert not np.array_equal(weights[0], weights[1]), "each block draws its own weights"


def test_init_keys_by_name_so_other_leaves_do_not_move():
    # Adding a layer must not change the existing layers' initial values.
    two = ptree.flatten(ptree.unstack(models.init(jax.random.key(0), CONFIGS["llama"])))
    three = models.init(jax.random.key(0), CONFIGS["llama"].replace(n_layers=3))
    three = ptree.flatten(ptree.unstack(three))
    for name, leaf in two.items():
        np.testing.assert_array_equal(leaf, three[name], err_msg=name)


def test_param_dtype_bfloat16_init():
    params = models.init(jax.random.key(0), CONFIGS["llama"].replace(param_dtype="bfloat16"))
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}


# ---- forward and gradients ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_custom_vjp_model_gradient_equals_jax_grad_of_reference_model(name):
    cfg = CONFIGS[name]
    params = models.init(jax.random.key(1), cfg)
    tokens = tokens_for(cfg, seed=1)
    loss_c, grad_c = value_and_grad(cfg)(params, tokens, cfg)
    ref = cfg.replace(ops="reference")
    loss_r, grad_r = value_and_grad(ref)(params, tokens, ref)
    assert np.isfinite(float(loss_c))
    np.testing.assert_allclose(loss_c, loss_r, rtol=loss_rtol(cfg))
    assert max_rel_error(grad_c, grad_r) < grad_rtol(cfg)
    # Every leaf learns, except key biases, whose gradient is exactly zero in exact arithmetic.
    expected = {k for k in ptree.flatten(params) if not k.endswith("attention.key.bias")}
    assert nonzero_leaves(grad_c) == expected


def test_reference_switch_really_changes_the_op_set():
    # The reference model must not silently route through the custom ops: a jaxpr of the
    # custom model contains custom_vjp calls, the reference one none.
    cfg = CONFIGS["gpt"]
    params, tokens = models.init(jax.random.key(0), cfg), tokens_for(cfg)
    custom = str(jax.make_jaxpr(lambda p: models.forward(p, tokens, cfg))(params))
    ref_cfg = cfg.replace(ops="reference")
    ref = str(jax.make_jaxpr(lambda p: models.forward(p, tokens, ref_cfg))(params))
    assert "custom_vjp" in custom and "custom_vjp" not in ref


@pytest.mark.parametrize("positions", ["learned", "sinusoidal", "rope"])
def test_embedding_adds_the_configured_positions(positions):
    # Written from the equations with numpy (and the float64 sinusoid reference), not lmjax.
    cfg = CONFIGS["gpt"].replace(positions=positions)
    params, tokens = models.init(jax.random.key(0), cfg), tokens_for(cfg)
    table = np.asarray(params["token_embedding"]["weight"])
    expected = table[np.asarray(tokens)]
    if positions == "learned":
        expected = expected + np.asarray(params["position_embedding"]["weight"])[None]
    elif positions == "sinusoidal":
        expected = expected + ops.sinusoidal_positions_reference(cfg.context_length, cfg.d_model)
    got = models.embed(params, tokens, cfg)
    np.testing.assert_allclose(got, expected, rtol=F32_RTOL, atol=1e-7)
    # A one-layer model that ignored its positions would give its last position the same
    # logits for two orders of the same tokens: causal attention over a set is order-blind.
    # (A repeated token does not show it: RoPE moves only the scores, and equal tokens have
    # equal values, so every position of "3 3 3 3" has the same logits in exact arithmetic.)
    one = cfg.replace(n_layers=1)

    def last_logits(p, c):
        orders = jnp.array([[5, 7, 3], [7, 5, 3]], jnp.int32)
        return np.asarray(forward(p, orders, c)[:, -1])

    ours = last_logits(models.init(jax.random.key(0), one), one)
    # The control: learned positions of zero are such a model, equal to float32 rounding.
    learned = one.replace(positions="learned")
    zero = {"position_embedding": {"weight": jnp.zeros((one.context_length, one.d_model))}}
    blind = last_logits(models.init(jax.random.key(0), learned) | zero, learned)
    rounding = F32_RTOL * np.abs(blind).max()
    np.testing.assert_allclose(blind[0], blind[1], rtol=0, atol=rounding)
    assert np.abs(ours[0] - ours[1]).max() > 100 * rounding, positions


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_causality_through_gradients(name):
    cfg = CONFIGS[name]
    params = models.init(jax.random.key(2), cfg)
    t = 5
    # Token `v_future` occurs only after position t, so no logit at or before t may depend on
    # its embedding row: the gradient into that row must be exactly zero.
    v_future = cfg.vocab_size - 1
    tokens = np.asarray(tokens_for(cfg, seed=2)) % (cfg.vocab_size - 1)
    tokens[:, t + 1 :: 2] = v_future
    tokens = jnp.asarray(tokens)

    def early_logits(table, upto):
        # `upto` is traced (one compile for both calls): positions after it are zeroed by a
        # select, whose gradient into the unselected branch is exactly zero.
        p = {**params, "token_embedding": {"weight": table}}
        logits_BTV = models.forward(p, tokens, cfg)
        early_T = jnp.arange(logits_BTV.shape[1]) <= upto
        return jnp.sum(jnp.where(early_T[None, :, None], logits_BTV**2, 0.0))

    table = params["token_embedding"]["weight"]
    grad = jax.jit(jax.grad(early_logits))
    g_early = grad(table, t)
    assert not np.asarray(g_early[v_future]).any()
    g_late = grad(table, t + 1)
    assert np.abs(np.asarray(g_late[v_future])).max() > 0, "the check can see a dependency"
    # And by value: changing every token after t leaves the logits at or before t unchanged.
    changed = tokens.at[:, t + 1 :].set((tokens[:, t + 1 :] + 1) % cfg.vocab_size)
    a, b = forward(params, tokens, cfg), forward(params, changed, cfg)
    np.testing.assert_array_equal(a[:, : t + 1], b[:, : t + 1])
    assert not np.array_equal(a[:, t + 1 :], b[:, t + 1 :])


def test_causality_of_learned_positions_through_gradients():
    cfg = CONFIGS["gpt"]
    params, tokens, t = models.init(jax.random.key(5), cfg), tokens_for(cfg), 6

    def early(pos_table):
        p = {**params, "position_embedding": {"weight": pos_table}}
        return jnp.sum(models.forward(p, tokens, cfg)[:, : t + 1])

    g = np.asarray(jax.jit(jax.grad(early))(params["position_embedding"]["weight"]))
    assert not g[t + 1 :].any()
    assert (np.abs(g[: t + 1]).max(axis=1) > 0).all()


@pytest.mark.parametrize("policy", ["block", "dots", "dots_no_batch"])
def test_remat_gives_the_same_outputs_and_gradients_under_jit(policy):
    cfg = CONFIGS["llama"].replace(remat="none")
    (loss0, grad0), (loss1, grad1) = losses_and_grads(cfg, remat=policy)
    remat = cfg.replace(remat=policy)
    # jit fuses the recomputed graph differently, so its sums may run in another order.
    np.testing.assert_allclose(loss1, loss0, rtol=loss_rtol(cfg))
    assert max_rel_error(grad1, grad0) < grad_rtol(cfg)
    # Remat really changes what the backward keeps: fewer residual bytes.
    assert models.residual_bytes(remat, 2, 16) < models.residual_bytes(cfg, 2, 16)


def test_remat_is_bit_identical_op_by_op():
    # Without jit every primitive runs on its own, so recomputation repeats exactly the same
    # float operations on the same inputs: outputs and gradients must match bit for bit.
    cfg = CONFIGS["gpt"].replace(remat="none")
    params, tokens = models.init(jax.random.key(0), cfg), tokens_for(cfg)
    remat = cfg.replace(remat="block")
    # The inputs loss_fn feeds the model, so the gradients' forward pass reuses the programs
    # each eager primitive compiled here (one per primitive and shape) instead of compiling more.
    inputs = tokens[:, :-1]
    np.testing.assert_array_equal(
        models.forward(params, inputs, cfg), models.forward(params, inputs, remat)
    )
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.grad(loss_fn)(params, tokens, cfg),
        jax.grad(loss_fn)(params, tokens, remat),
    )


def test_attention_impls_agree_inside_the_model():
    (loss0, grad0), (loss1, grad1) = losses_and_grads(CONFIGS["gpt"], attention="xla")
    np.testing.assert_allclose(loss0, loss1, rtol=loss_rtol(CONFIGS["gpt"]))
    assert max_rel_error(grad1, grad0) < grad_rtol(CONFIGS["gpt"])


def test_bf16_compute_with_f32_master_weights():
    (loss32, grad32), (loss16, grad16) = losses_and_grads(CONFIGS["llama"], dtype="bfloat16")
    mixed, tokens = CONFIGS["llama"].replace(dtype="bfloat16"), tokens_for(CONFIGS["llama"])
    logits = forward(models.init(jax.random.key(0), mixed), tokens, mixed)
    assert logits.dtype == jnp.float32  # jit needs no static_argnames: configs are static
    assert {g.dtype for g in jax.tree.leaves(grad16)} == {jnp.dtype(jnp.float32)}
    np.testing.assert_allclose(loss16, loss32, rtol=BF16_RTOL)
    assert max_rel_error(grad16, grad32) < 10 * BF16_RTOL  # per-leaf max error over max |g|
    assert max_rel_error(grad16, grad32) > 0, "bf16 really ran in bf16"


def test_dropout_needs_a_key_and_is_reproducible():
    cfg = CONFIGS["gpt"].replace(dropout=0.5)
    params, tokens = models.init(jax.random.key(0), cfg), tokens_for(cfg)
    plain = models.forward(params, tokens, cfg)
    np.testing.assert_array_equal(plain, models.forward(params, tokens, cfg.replace(dropout=0.0)))
    k1, k2 = jax.random.key(1), jax.random.key(2)
    a = models.forward(params, tokens, cfg, dropout_key=k1)
    np.testing.assert_array_equal(a, models.forward(params, tokens, cfg, dropout_key=k1))
    assert not np.allclose(a, plain) and not np.allclose(
        a, models.forward(params, tokens, cfg, dropout_key=k2)
    )
    # Gradients through dropout: the custom VJP matches jax.grad of the reference model.
    _, grads = value_and_grad(cfg)(params, tokens, cfg, k1)
    ref = cfg.replace(ops="reference")
    _, grads_ref = value_and_grad(ref)(params, tokens, ref, k1)
    assert max_rel_error(grads, grads_ref) < grad_rtol(cfg)


# ---- overfit acceptance (SPEC section 5, reference 001) ---------------------------------------

OVERFIT_TEXT = "the cat sat on the mat again"  # 28 characters (27 positions), 12 distinct


def test_llama_tiny_overfits_one_batch_with_plain_gradient_descent(capsys):
    chars = sorted(set(OVERFIT_TEXT))
    ids = jnp.asarray([[chars.index(c) for c in OVERFIT_TEXT]], jnp.int32)
    cfg = models.preset("llama")  # V=16, D=32, N=2, H=2, F=64: 21,664 parameters
    assert len(chars) <= cfg.vocab_size and models.param_count(cfg) == 21_664
    inputs, targets = ids[:, :-1], ids[:, 1:]  # 27 positions

    @jax.jit
    def step(p):
        loss, g = jax.value_and_grad(
            lambda p: ops.cross_entropy(models.forward(p, inputs, cfg), targets)
        )(p)
        return jax.tree.map(lambda w, dw: w - 0.3 * dw, p, g), loss

    params, losses = models.init(jax.random.key(0), cfg), []
    for _ in range(200):
        params, loss = step(params)
        losses.append(float(loss))
    predicted = jnp.argmax(models.forward(params, inputs, cfg), axis=-1)
    matches = int((predicted == targets).sum())
    with capsys.disabled():
        print(
            f"\n  overfit: loss {losses[0]:.4f} -> {losses[-1]:.4f} in 200 steps, "
            f"greedy {matches}/{targets.size}"
        )
    assert losses[0] > 2.0, "starts near log(16)"
    assert losses[-1] < 0.05
    assert matches == targets.size


def test_training_with_flash_attention_gives_the_same_losses():
    # Five plain gradient-descent steps on one batch: the Pallas kernel (interpret mode on CPU)
    # must reproduce the materialized attention's loss curve to float32 rounding.
    cfg = CONFIGS["gpt"]
    tokens = tokens_for(cfg)

    def curve(cfg):
        params, losses = models.init(jax.random.key(0), cfg), []
        for _ in range(5):
            loss, grads = value_and_grad(cfg)(params, tokens, cfg)
            params = jax.tree.map(lambda w, g: w - 0.3 * g, params, grads)
            losses.append(float(loss))
        return np.asarray(losses)

    materialized, flash = curve(cfg), curve(cfg.replace(attention="flash"))
    assert materialized[-1] < materialized[0], "the steps really train"
    np.testing.assert_allclose(flash, materialized, rtol=F32_RTOL)
