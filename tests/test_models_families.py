"""Llama / Mistral / Qwen2 / Qwen3 / SmolLM shapes (issue 23) and packed rows (issue 24).

Config fields and their errors, the parameter layout, RoPE scaling against transformers' own
rope init functions, the presets' parameter counts against transformers (meta device: nothing
allocated) and `lmjax inspect`, tiny random models of each family against transformers with the
weights copied by hand, and packed rows (segment ids) against each document alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import PartitionSpec

from lmjax import models, params, testing
from lmjax.cli import main
from lmjax.errors import ConfigError, ShapeError
from lmjax.ops.rope import RopeScaling, rope, rope_frequencies, rope_reference
from lmjax.parallel.rules import param_specs

# ---- tiny configs of each family ----------------------------------------------------------------

_TINY = dict(vocab_size=64, context_length=16, d_model=32, n_heads=4, n_layers=2, d_ff=48)
FAMILIES = {
    # Llama with grouped-query attention and an untied head.
    "llama": dict(n_kv_heads=2, rope_theta=10000.0),
    # Llama 3.1-style RoPE scaling (all three bands populated at head size 8, theta 500000).
    "llama3": dict(
        n_kv_heads=2,
        tie_embeddings=True,
        rope_theta=500000.0,
        rope_scaling="llama3",
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_context=12,
    ),
    # Mistral: a sliding window shorter than the sequence.
    "mistral": dict(n_kv_heads=1, sliding_window=4),
    # Qwen2: biases on q, k, v only, tied head.
    "qwen2": dict(n_kv_heads=2, qkv_bias=True, tie_embeddings=True, rope_theta=1e6),
    # Qwen3: explicit head_dim (4 x 12 != 32) and q/k RMSNorm.
    "qwen3": dict(n_kv_heads=2, head_dim=12, qk_norm=True, tie_embeddings=True, rope_theta=1e6),
}


def tiny(family: str, **overrides) -> models.ModelConfig:
    return models.preset("llama", **_TINY, **FAMILIES[family], **overrides)


def hf_config(cfg: models.ModelConfig):
    """The transformers config of the same model (the family chosen by the features used)."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling != "none":
        rope |= {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor}
    if cfg.rope_scaling == "llama3":
        rope |= {
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_context,
        }
    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.d_head,
        max_position_embeddings=cfg.context_length,
        rms_norm_eps=cfg.eps,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters=rope,
    )
    if cfg.qk_norm:
        return transformers.Qwen3Config(**kwargs)
    if cfg.qkv_has_bias:
        return transformers.Qwen2Config(**kwargs)
    if cfg.sliding_window is not None:
        return transformers.MistralConfig(**kwargs, sliding_window=cfg.sliding_window)
    return transformers.LlamaConfig(**kwargs)


def hf_param_count(cfg: models.ModelConfig) -> int:
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg))
    return sum(p.numel() for p in model.parameters())  # a tied table is counted once


def abstract_count(cfg: models.ModelConfig) -> int:
    tree = jax.eval_shape(lambda: models.init(jax.random.key(0), cfg))
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))


# ---- config fields and errors -------------------------------------------------------------------


def test_defaults_are_the_old_model():
    cfg = models.preset("llama")
    assert (cfg.kv_heads, cfg.d_head) == (2, 16)
    assert (cfg.q_features, cfg.kv_features) == (32, 32)
    assert cfg.qkv_has_bias is False and models.preset("gpt").qkv_has_bias is True
    assert models.preset("gpt", qkv_bias=False).qkv_has_bias is False


@pytest.mark.parametrize(
    "overrides, named",
    [
        (dict(n_kv_heads=3), "model.n_heads % model.n_kv_heads"),
        (dict(n_kv_heads=0), "model.n_kv_heads"),
        (dict(n_kv_heads=2.0), "model.n_kv_heads"),
        (dict(head_dim=0), "model.head_dim"),
        (dict(head_dim=7), "d_head with positions='rope'"),
        (dict(d_model=30), "model.d_model % model.n_heads"),
        (dict(qkv_bias="yes"), "model.qkv_bias"),
        (dict(qk_norm=1), "model.qk_norm"),
        (dict(sliding_window=0), "model.sliding_window"),
        (dict(sliding_window=2.5), "model.sliding_window"),
        (dict(sliding_window=True), "model.sliding_window"),
        (dict(rope_scaling="yarn"), "model.rope_scaling = 'yarn'"),
        (dict(rope_scaling="linear", positions="learned"), "model.rope_scaling"),
        (dict(rope_factor=0.0), "model.rope_factor"),
        (dict(rope_low_freq_factor=float("nan")), "model.rope_low_freq_factor"),
        (dict(rope_original_context=0), "model.rope_original_context"),
        (
            dict(rope_scaling="llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=2.0),
            "model.rope_high_freq_factor",
        ),
    ],
)
def test_bad_fields_are_one_config_error_line(overrides, named):
    with pytest.raises(ConfigError) as err:
        models.preset("llama", **{**dict(n_heads=4), **overrides})
    assert named in str(err.value) and "\n" not in str(err.value)


def test_explicit_head_dim_needs_no_divisible_width():
    cfg = models.preset("llama", d_model=30, n_heads=4, head_dim=6)
    assert (cfg.d_head, cfg.q_features) == (6, 24)


# ---- layout and sharding ------------------------------------------------------------------------


def test_layout_of_grouped_heads_biases_and_qk_norm():
    cfg = tiny("qwen3", qkv_bias=True)  # H 4, Hkv 2, Dh 12, D 32
    shapes = {name: spec.shape for name, spec in models.declare_layers(cfg).items()}
    attn = "blocks.1.attention"
    assert shapes[f"{attn}.query.weight"] == (48, 32) and shapes[f"{attn}.query.bias"] == (48,)
    assert shapes[f"{attn}.key.weight"] == (24, 32) and shapes[f"{attn}.value.bias"] == (24,)
    assert shapes[f"{attn}.output.weight"] == (32, 48)
    assert f"{attn}.output.bias" not in shapes  # bias=False: only q, k, v have one
    assert shapes[f"{attn}.query_norm.scale"] == shapes[f"{attn}.key_norm.scale"] == (12,)
    assert "language_model_head.weight" not in shapes  # tied
    specs = param_specs(cfg, {"data": 1, "fsdp": 2, "model": 2})
    assert specs["blocks.attention.key.weight"] == PartitionSpec(None, "model", "fsdp")
    assert specs["blocks.attention.output.weight"] == PartitionSpec(None, "fsdp", "model")
    assert specs["blocks.attention.key_norm.scale"] == PartitionSpec(None, None)


# ---- RoPE scaling against transformers ----------------------------------------------------------

_SCALINGS = {
    "linear": RopeScaling("linear", factor=4.0),
    # Llama 3.2's own parameters at its head size: the three bands are all populated.
    "llama3": RopeScaling("llama3", 32.0, 1.0, 4.0, 8192),
}


def _hf_rope_config(scaling: RopeScaling, d_head: int, theta: float):
    cfg = models.preset(
        "llama",
        d_model=2 * d_head,
        context_length=2 * scaling.original_context,
        rope_theta=theta,
        rope_scaling=scaling.kind,
        rope_factor=scaling.factor,
        rope_low_freq_factor=scaling.low_freq_factor,
        rope_high_freq_factor=scaling.high_freq_factor,
        rope_original_context=scaling.original_context,
    )
    return hf_config(cfg)


@pytest.mark.parametrize("kind", sorted(_SCALINGS))
def test_inverse_frequencies_equal_transformers(kind):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling, d_head, theta = _SCALINGS[kind], 64, 500000.0
    want, _ = ROPE_INIT_FUNCTIONS[kind](_hf_rope_config(scaling, d_head, theta), "cpu")
    got = rope_frequencies(d_head, theta, scaling)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=0, atol=1e-6)
    plain = rope_frequencies(d_head, theta)
    assert not np.allclose(np.asarray(got), np.asarray(plain))  # the scaling did something


@pytest.mark.parametrize("kind", sorted(_SCALINGS))
def test_rotated_q_equals_transformers(kind):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    scaling, d_head, theta = _SCALINGS[kind], 64, 500000.0
    rng = np.random.default_rng(0)
    q_BTHDh = rng.standard_normal((2, 6, 3, d_head)).astype(np.float32)
    # Positions below 64: float32 angles pos * f then round alike (our f = theta^(-2i/Dh) and
    # transformers' 1 / theta^(2i/Dh) differ in the last bit, an error that grows with pos),
    # while the stretched low frequencies still turn q by up to ~0.2 rad less than unscaled.
    positions_BT = rng.integers(0, 64, (2, 6)).astype(np.int32)
    rotary = LlamaRotaryEmbedding(_hf_rope_config(scaling, d_head, theta))
    q_BHTD = torch.from_numpy(q_BTHDh).transpose(1, 2)
    cos, sin = rotary(q_BHTD, torch.from_numpy(positions_BT).long())
    want, _ = apply_rotary_pos_emb(q_BHTD, q_BHTD, cos, sin)
    got = rope(jnp.asarray(q_BTHDh), positions_BT, theta=theta, scaling=scaling)
    np.testing.assert_allclose(np.asarray(got), want.transpose(1, 2).numpy(), atol=1e-5)
    ref = rope_reference(jnp.asarray(q_BTHDh), positions_BT, theta=theta, scaling=scaling)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5)


def test_scaled_rope_vjp_is_the_reference_gradient():
    scaling = _SCALINGS["llama3"]
    x = jax.random.normal(jax.random.key(1), (1, 5, 2, 64))
    g = jax.random.normal(jax.random.key(2), x.shape)
    pos = jnp.array([[0, 3, 17, 40, 63]])  # below 64: see test_rotated_q_equals_transformers
    _, pull = jax.vjp(lambda x: rope(x, pos, theta=5e5, scaling=scaling), x)
    _, pull_ref = jax.vjp(lambda x: rope_reference(x, pos, theta=5e5, scaling=scaling), x)
    np.testing.assert_allclose(pull(g)[0], pull_ref(g)[0], atol=1e-5)


# ---- presets: counts equal transformers', and lmjax inspect prints them ------------------------

PRESETS = ("smollm2-135m", "llama-3.2-1b", "qwen2.5-0.5b", "qwen3-0.6b")


@pytest.mark.parametrize("name", PRESETS)
def test_preset_count_equals_transformers_and_inspect_prints_it(name, capsys):
    cfg = models.preset(name)
    want = hf_param_count(cfg)
    assert abstract_count(cfg) == want == models.param_count(cfg)
    assert main(["inspect", name, "--seq-len", "8"]) == 0
    total = [line for line in capsys.readouterr().out.splitlines() if line.startswith("total")]
    assert total and total[0].split()[-1] == f"{want:,}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiny_family_count_equals_transformers(family):
    cfg = tiny(family)
    assert abstract_count(cfg) == hf_param_count(cfg)


# ---- tiny models against transformers, weights copied by hand ----------------------------------

_HF_NAMES = (
    ("token_embedding.weight", "model.embed_tokens.weight"),
    ("final_norm.scale", "model.norm.weight"),
    ("language_model_head.weight", "lm_head.weight"),
    ("blocks.", "model.layers."),
    ("attention_norm.scale", "input_layernorm.weight"),
    ("feed_forward_norm.scale", "post_attention_layernorm.weight"),
    ("attention.query_norm.scale", "self_attn.q_norm.weight"),
    ("attention.key_norm.scale", "self_attn.k_norm.weight"),
    ("attention.query.", "self_attn.q_proj."),
    ("attention.key.", "self_attn.k_proj."),
    ("attention.value.", "self_attn.v_proj."),
    ("attention.output.", "self_attn.o_proj."),
    ("feed_forward.gate.", "mlp.gate_proj."),
    ("feed_forward.up.", "mlp.up_proj."),
    ("feed_forward.down.", "mlp.down_proj."),
)


def _hf_name(name: str) -> str:
    for ours, theirs in _HF_NAMES:
        name = name.replace(ours, theirs)
    return name


def hf_model_and_params(cfg: models.ModelConfig):
    """A random transformers model (every weight perturbed, so norms and biases matter) and
    the same weights as lmjax params."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config(cfg), attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    state = model.state_dict()
    flat = {name: state[_hf_name(name)].numpy() for name in models.declare_layers(cfg)}
    return model, jax.tree.map(jnp.asarray, params.stack(params.unflatten(flat)))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiny_family_logits_equal_transformers(family):
    cfg = tiny(family)
    model, p = hf_model_and_params(cfg)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    got = models.forward(p, tokens, cfg)
    # Float32 rounding of either program, derived (any CPU): lmjax.testing.logits_atol.
    np.testing.assert_allclose(np.asarray(got), want, atol=testing.logits_atol(cfg, want), rtol=0)


# ---- packed rows --------------------------------------------------------------------------------


def test_segment_positions_restart_per_run():
    ids = jnp.array([[1, 1, 1, 2, 2, 0, 0, 3], [5, 5, 5, 5, 5, 5, 5, 5]])
    want = [[0, 1, 2, 0, 1, 0, 1, 0], [0, 1, 2, 3, 4, 5, 6, 7]]
    got = models.segment_positions(ids)
    assert got.dtype == jnp.int32 and got.tolist() == want


def test_bad_segment_ids_are_shape_errors():
    cfg = models.preset("gpt")
    p = models.init(jax.random.key(0), cfg)
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ShapeError, match="segment_ids.shape"):
        models.forward(p, tokens, cfg, segment_ids=jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(ShapeError, match="segment_ids.dtype"):
        models.forward(p, tokens, cfg, segment_ids=jnp.zeros((1, 4)))


_PACKED = dict(vocab_size=64, context_length=16, d_model=32, n_heads=4, n_layers=2, d_ff=48)
PACKING_CONFIGS = {
    "llama": lambda impl: models.preset("llama", **_PACKED, n_kv_heads=2, attention=impl),
    "gpt": lambda impl: models.preset("gpt", **_PACKED, attention=impl),
    "gpt-sinusoidal": lambda impl: models.preset(
        "gpt", **_PACKED, positions="sinusoidal", attention=impl
    ),
}
# A packed row: document A (5 tokens), document B (7), padding (4, id 0).
_DOCS = ((1, 0, 5), (2, 5, 12))


# One compile per config: eager dispatch of every op (and its VJP) costs far more here.
_forward = jax.jit(models.forward)


def _packed_row(cfg):
    tokens_1T = jax.random.randint(jax.random.key(3), (1, 16), 0, cfg.vocab_size)
    segment_ids_1T = jnp.array([[1] * 5 + [2] * 7 + [0] * 4])
    return tokens_1T, segment_ids_1T


def _log_prob_3(logits_BTV):
    return jnp.mean(jax.nn.log_softmax(logits_BTV)[..., 3])


def _loss_and_logits(p, tokens_1T, cfg, segment_ids_1T, start, end):
    """The loss on positions start..end-1, and the logits at every position (aux)."""
    logits = models.forward(p, tokens_1T, cfg, segment_ids=segment_ids_1T)
    return _log_prob_3(logits[:, start:end]), logits


# Three compiles a case: the packed row's loss and gradient (its logits as aux: documents A's
# and B's, so no packed forward of its own), document B's alone, and document A's forward
# alone. Every impl with both families (GPT-2's learned positions and Llama's RoPE restart per
# document); flash (interpreted on CPU, ~15 s a case) is marked slow.
_PACKING_CASES = [
    ("llama", "materialized"),
    ("llama", "xla"),
    pytest.param("llama", "flash", marks=pytest.mark.slow),
    ("gpt", "materialized"),
    ("gpt", "xla"),
    pytest.param("gpt", "flash", marks=pytest.mark.slow),
    ("gpt-sinusoidal", "materialized"),
]


@pytest.mark.parametrize("name, impl", _PACKING_CASES)
def test_packed_documents_equal_each_document_alone(name, impl):
    cfg = PACKING_CONFIGS[name](impl)
    p = models.init(jax.random.key(0), cfg)
    tokens_1T, segment_ids_1T = _packed_row(cfg)
    (_, a_start, a_end), (_, start, end) = _DOCS
    grad_fn = jax.jit(jax.value_and_grad(_loss_and_logits, has_aux=True), static_argnums=(2, 4, 5))
    (_, packed), packed_grads = grad_fn(p, tokens_1T, cfg, segment_ids_1T, start, end)
    (_, alone_b), alone_grads = grad_fn(p, tokens_1T[:, start:end], cfg, None, 0, end - start)
    packed_b = packed[:, start:end]
    # Two programs of other shapes sum in other orders: float32 bounds derived in lmjax.testing
    # (any CPU), over the 16 positions; the gradient's chain is the forward, the log-softmax and
    # the mean, then the backward.
    np.testing.assert_allclose(packed_b, alone_b, atol=testing.logits_atol(cfg, alone_b, t=16))
    packed_a = packed[:, a_start:a_end]
    alone_a = _forward(p, tokens_1T[:, a_start:a_end], cfg)
    np.testing.assert_allclose(packed_a, alone_a, atol=testing.logits_atol(cfg, alone_a, t=16))
    # The gradients of a loss on document B: through the packed row they are B's alone.
    chain = 2 * testing.forward_chain(cfg, 16) + 2 * cfg.vocab_size + 16
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(alone_grads))
    for (path, got), want in zip(
        params.flatten(packed_grads).items(), params.flatten(alone_grads).values(), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=testing.f32_rtol(chain) * scale, err_msg=path)


def test_packing_changes_what_a_document_sees():
    # Without segment ids document B attends to A and sits at positions 5..11: other logits.
    cfg = PACKING_CONFIGS["llama"]("materialized")
    p = models.init(jax.random.key(0), cfg)
    tokens_1T, _ = _packed_row(cfg)
    unpacked = _forward(p, tokens_1T, cfg)[:, 5:12]
    alone = _forward(p, tokens_1T[:, 5:12], cfg)
    assert np.abs(np.asarray(unpacked - alone)).max() > 1e-3
