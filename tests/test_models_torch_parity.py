"""Whole-model parity with an independent PyTorch decoder (SPEC section 3).

`torch_forward` below is written from the SPEC equations with plain tensors and
`torch.nn.functional`; it never calls lmjax (it only reads the config's fields and the parameter
names). Both sides get the same weights (lmjax's `init`, flattened per layer with
`lmjax.params.unstack` and `flatten`, then shifted by seeded noise so that no bias is zero and no
norm scale is one: otherwise a bias added in the wrong place or a scale/bias mix-up would be
invisible); lmjax runs them stacked again (`lmjax.params.stack`, its blocks scanned). We compare

- the logits `[B, T, V]` of `lmjax.models.forward` against the torch model, and
- for EVERY parameter name, `jax.grad` of `lmjax.ops.cross_entropy(forward(...), targets)`
  against torch autograd of `F.cross_entropy` (mean over the B*T tokens).

Error measure (per tensor): max |lmjax - torch| / max |torch|. It is scale-free per parameter and
does not blow up on entries that happen to be near zero, which an elementwise rtol would.

One exception: the gradient of `attention.key.bias` is exactly zero in exact arithmetic. The key
bias adds q_i . b_k to every score of query row i, the same for every key j, and softmax is
invariant to a per-row constant (its backward rows sum to zero), so dL/db_k = 0 and both sides
return only round-off (~1e-8). Relative to itself that noise is meaningless, so for those names the
error is measured against the largest gradient entry of the whole model instead, and
`test_every_parameter_is_used_and_named_as_declared` checks that it is at round-off level.

Configs: `gpt` (learned positions, pre-LayerNorm, exact GELU, biases, untied head with bias),
`llama` (RoPE rotate-half as HF Llama, RMSNorm eps 1e-6, SwiGLU, no biases, untied head) and a
tiny `gpt2` (tanh GELU, tied head without bias).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import lmjax.models
from lmjax import ops, testing
from lmjax import params as ptree

# Float32 round-off differs between the two implementations (summation order in matmuls and
# reductions, erf/tanh/exp implementations, the fused cross-entropy VJP vs autograd), and with the
# CPU (XLA picks its vector width from the host). The tolerances are lmjax.testing.f32_rtol's
# bound for the longest chain of roundings: the forward's for logits (784-864 here: 1.4-1.5e-5);
# for gradients, the forward, the loss (V, then the mean over B T) and the backward through the
# same chain, each weight gradient summed over B T tokens (2.1-2.2e-5). Real modelling
# differences exceed them: the smallest, the GELU approximation (exact vs tanh), moves logits by
# ~2e-4 and gradients by ~6e-4; a wrong eps or RoPE theta by 1e-2 or more, a weight moved by 1%
# of its spread too (`test_modelling_slips_are_detected`, `test_perturbing_one_torch_weight_...`).


def logits_rtol(cfg) -> float:
    return testing.f32_rtol(testing.forward_chain(cfg, cfg.context_length))


def grad_rtol(cfg) -> float:
    chain = testing.forward_chain(cfg, cfg.context_length)
    return testing.f32_rtol(2 * chain + cfg.vocab_size + 2 * B * cfg.context_length)


B = 2  # batch size
SEED = 0
# Parameters whose gradient is identically zero (see the module docstring), and how far from zero
# their round-off may be, relative to the largest gradient entry of the model.
ZERO_GRAD_SUFFIX = ".attention.key.bias"
ZERO_GRAD_ATOL = 1e-6

CONFIGS = {
    "gpt": dict(),
    "llama": dict(),
    "gpt2": dict(vocab_size=50, context_length=16, d_model=32, n_heads=4, n_layers=2, d_ff=64),
}


def make_config(name: str):
    return lmjax.models.preset(name, **CONFIGS[name])


# ---- the independent torch decoder ---------------------------------------------------------------


def _linear(p: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    """y = x W^T + b with W `[out, in]` (torch.nn.Linear convention); b only if present."""
    return F.linear(x, p[f"{name}.weight"], p.get(f"{name}.bias"))


def _norm(p: dict, name: str, x: torch.Tensor, cfg) -> torch.Tensor:
    scale = p[f"{name}.scale"]
    if cfg.norm == "rmsnorm":
        # RMSNorm: x / sqrt(mean(x^2) + eps) * scale
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.eps) * scale
    # LayerNorm: (x - mean) / sqrt(biased var + eps) * scale (+ bias)
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    y = (x - mean) * torch.rsqrt(var + cfg.eps) * scale
    bias = p.get(f"{name}.bias")
    return y if bias is None else y + bias


def _rope(x_BTHK: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE as Hugging Face Llama (`LlamaRotaryEmbedding` inv_freq and cos/sin cache,
    `rotate_half`, `apply_rotary_pos_emb`), positions 0..T-1. (lmjax's `ops.rope` is checked against
    the HF code itself in tests/test_torch_parity.py; transformers is not imported here because
    its import alone costs ~3 s.)"""
    t, dh = x_BTHK.shape[1], x_BTHK.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dh, 2, dtype=torch.int64).float() / dh))
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv_freq)  # [T, Dh/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, Dh]
    cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
    x1, x2 = x_BTHK[..., : dh // 2], x_BTHK[..., dh // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x_BTHK * cos + rotated * sin


def _attention(p: dict, prefix: str, x_BTD: torch.Tensor, cfg) -> torch.Tensor:
    b, t, d = x_BTD.shape
    h, dh = cfg.n_heads, d // cfg.n_heads
    q, k, v = (
        _linear(p, f"{prefix}.{name}", x_BTD).reshape(b, t, h, dh)
        for name in ("query", "key", "value")
    )
    if cfg.positions == "rope":
        q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
    q, k, v = (a.transpose(1, 2) for a in (q, k, v))  # [B, H, T, Dh]
    scores = q @ k.transpose(-1, -2) / math.sqrt(dh)  # [B, H, T, T]
    future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [B, H, T, Dh]
    return _linear(p, f"{prefix}.output", out.transpose(1, 2).reshape(b, t, d))


def _feed_forward(p: dict, prefix: str, x_BTD: torch.Tensor, cfg) -> torch.Tensor:
    if cfg.activation == "swiglu":
        gate, up = _linear(p, f"{prefix}.gate", x_BTD), _linear(p, f"{prefix}.up", x_BTD)
        return _linear(p, f"{prefix}.down", F.silu(gate) * up)
    act = {
        "gelu": lambda z: F.gelu(z, approximate="none"),
        "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
        "relu": F.relu,
    }[cfg.activation]
    return _linear(p, f"{prefix}.project", act(_linear(p, f"{prefix}.expand", x_BTD)))


def torch_forward(p: dict, tokens_BT: torch.Tensor, cfg) -> torch.Tensor:
    """Pre-norm decoder: embed (+ learned positions), N blocks, final norm, head -> `[B, T, V]`."""
    t = tokens_BT.shape[1]
    x = F.embedding(tokens_BT, p["token_embedding.weight"])
    if cfg.positions == "learned":
        x = x + p["position_embedding.weight"][:t][None]
    assert cfg.positions in ("learned", "rope"), "sinusoidal is not covered here"
    for i in range(cfg.n_layers):
        blk = f"blocks.{i}"
        x = x + _attention(p, f"{blk}.attention", _norm(p, f"{blk}.attention_norm", x, cfg), cfg)
        x = x + _feed_forward(
            p, f"{blk}.feed_forward", _norm(p, f"{blk}.feed_forward_norm", x, cfg), cfg
        )
    x = _norm(p, "final_norm", x, cfg)
    if cfg.tie_embeddings:
        return F.linear(x, p["token_embedding.weight"])
    return _linear(p, "language_model_head", x)


# ---- harness -------------------------------------------------------------------------------------


def make_case(cfg, seed: int = SEED):
    """Flat float32 numpy weights (lmjax init + seeded noise), tokens and targets `[B, C]`.

    The weights are named per layer (`blocks.{i}.…`, `ptree.unstack`), as the torch side reads
    them; lmjax gets them stacked (`lmjax_outputs`)."""
    rng = np.random.default_rng(seed)
    init = lmjax.models.init(jax.random.key(seed), cfg)
    flat = {
        name: np.asarray(leaf, np.float32)
        for name, leaf in ptree.flatten(ptree.unstack(init)).items()
    }
    for name, a in flat.items():
        # Biases away from 0, scales away from 1, everything else nudged by ~10% of its spread.
        spread = float(a.std()) if a.std() > 0 else 0.1
        flat[name] = (a + 0.1 * spread * rng.standard_normal(a.shape)).astype(np.float32)
    t = cfg.context_length
    tokens = rng.integers(0, cfg.vocab_size, size=(B, t)).astype(np.int32)
    targets = rng.integers(0, cfg.vocab_size, size=(B, t)).astype(np.int32)
    return flat, tokens, targets


def lmjax_outputs(flat: dict, tokens: np.ndarray, targets: np.ndarray, cfg):
    params = ptree.stack(ptree.unflatten({name: jnp.asarray(a) for name, a in flat.items()}))
    tokens_j, targets_j = jnp.asarray(tokens), jnp.asarray(targets)

    def loss_fn(prm):
        logits = lmjax.models.forward(prm, tokens_j, cfg)
        return ops.cross_entropy(logits, targets_j), logits

    # Ids are checked eagerly here; the jit is only for speed (eager op dispatch is ~3x slower).
    lmjax.models.check_tokens(tokens_j, cfg)
    (loss, logits), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    assert logits.dtype == jnp.float32
    flat_grads = {name: np.asarray(g) for name, g in ptree.flatten(ptree.unstack(grads)).items()}
    return np.asarray(logits), float(loss), flat_grads


def torch_outputs(flat: dict, tokens: np.ndarray, targets: np.ndarray, cfg, perturb=None):
    """Logits, loss and `{name: grad}` from the torch decoder; `perturb(p)` edits the weights."""
    p = {name: torch.tensor(a, requires_grad=True) for name, a in flat.items()}
    if perturb is not None:
        with torch.no_grad():
            perturb(p)
    tokens_t = torch.tensor(tokens.astype(np.int64))
    targets_t = torch.tensor(targets.astype(np.int64))
    logits = torch_forward(p, tokens_t, cfg)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets_t.reshape(-1))
    loss.backward()
    grads = {name: t.grad.numpy() for name, t in p.items() if t.grad is not None}
    return logits.detach().numpy(), loss.item(), grads


def max_abs(grads: dict) -> float:
    return max(float(np.max(np.abs(g))) for g in grads.values())


def rel_err(got: np.ndarray, want: np.ndarray, scale: float | None = None) -> float:
    """max |got - want| / max |want| (or / `scale` if given); 0/0 counts as 0, x/0 as inf."""
    assert got.shape == want.shape, (got.shape, want.shape)
    num = float(np.max(np.abs(got - want)))
    den = float(np.max(np.abs(want))) if scale is None else scale
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def compare(jax_out, torch_out):
    """`(logits error, {name: grad error})`; asserts both sides have the same parameter names."""
    logits_j, _, grads_j = jax_out
    logits_t, _, grads_t = torch_out
    assert list(grads_t) == list(grads_j), "torch and lmjax differentiate different parameters"
    model_scale = max_abs(grads_t)
    grad_errs = {
        n: rel_err(grads_j[n], grads_t[n], model_scale if n.endswith(ZERO_GRAD_SUFFIX) else None)
        for n in grads_j
    }
    return rel_err(logits_j, logits_t), grad_errs


def assert_close(jax_out, torch_out, cfg, label: str = ""):
    logits_err, grad_errs = compare(jax_out, torch_out)
    tol, gtol = logits_rtol(cfg), grad_rtol(cfg)
    assert logits_err <= tol, f"{label} logits rel error {logits_err:.3e} > {tol:.3e}"
    worst = max(grad_errs, key=grad_errs.get)
    assert grad_errs[worst] <= gtol, (
        f"{label} grad of {worst}: rel error {grad_errs[worst]:.3e} > {gtol:.3e} "
        f"({sum(e > gtol for e in grad_errs.values())} of {len(grad_errs)} params over)"
    )


@pytest.fixture(scope="module")
def cases():
    """Per config: (cfg, weights, tokens, targets, lmjax outputs); computed once per module."""
    out = {}
    for name in CONFIGS:
        cfg = make_config(name)
        flat, tokens, targets = make_case(cfg)
        out[name] = (cfg, flat, tokens, targets, lmjax_outputs(flat, tokens, targets, cfg))
    return out


# ---- tests ---------------------------------------------------------------------------------------


def test_configs_are_what_the_test_claims():
    gpt, llama, gpt2 = (make_config(n) for n in ("gpt", "llama", "gpt2"))
    assert (gpt.positions, gpt.norm, gpt.activation, gpt.bias, gpt.head_bias) == (
        "learned",
        "layernorm",
        "gelu",
        True,
        True,
    )
    assert not gpt.tie_embeddings
    assert (llama.positions, llama.norm, llama.activation, llama.bias, llama.eps) == (
        "rope",
        "rmsnorm",
        "swiglu",
        False,
        1e-6,
    )
    assert not llama.tie_embeddings
    assert (gpt2.activation, gpt2.tie_embeddings, gpt2.head_bias, gpt2.eps) == (
        "gelu_tanh",
        True,
        False,
        1e-5,
    )
    assert gpt2.vocab_size == 50 and gpt2.d_model == 32


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_parameter_is_used_and_named_as_declared(cases, name):
    cfg, flat, tokens, targets, jax_out = cases[name]
    _, _, grads_t = torch_outputs(flat, tokens, targets, cfg)
    assert list(flat) == list(lmjax.models.declare_layers(cfg))
    # The torch model reaches every leaf (a leaf it ignored would have no .grad) ...
    assert list(grads_t) == list(flat)
    # ... and every leaf moves the loss on both sides (no dead parameter), except the key bias,
    # whose gradient is zero in exact arithmetic and must be round-off on both sides.
    for side, grads in (("torch", grads_t), ("lmjax", jax_out[2])):
        assert all(np.all(np.isfinite(g)) for g in grads.values()), side
        scale = max_abs(grads)
        zero = [n for n in grads if n.endswith(ZERO_GRAD_SUFFIX)]
        assert len(zero) == (cfg.n_layers if cfg.bias else 0)
        noisy = [n for n in zero if np.max(np.abs(grads[n])) > ZERO_GRAD_ATOL * scale]
        assert not noisy, f"{side}: gradient of {noisy} should be 0 (softmax shift invariance)"
        dead = [n for n in grads if n not in zero and np.max(np.abs(grads[n])) <= 1e-3 * scale]
        assert not dead, f"{side}: (near) zero gradient for {dead}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_torch(cases, name):
    cfg, flat, tokens, targets, jax_out = cases[name]
    torch_out = torch_outputs(flat, tokens, targets, cfg)
    assert jax_out[0].shape == (B, cfg.context_length, cfg.vocab_size)
    err, tol = rel_err(jax_out[0], torch_out[0]), logits_rtol(cfg)
    assert err <= tol, f"{name}: logits rel error {err:.3e} > {tol:.3e}"
    # The loss itself (a scalar) matches too.
    assert jax_out[1] == pytest.approx(torch_out[1], rel=tol)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradients_match_torch_for_every_parameter(cases, name):
    cfg, flat, tokens, targets, jax_out = cases[name]
    torch_out = torch_outputs(flat, tokens, targets, cfg)
    assert_close(jax_out, torch_out, cfg, label=name)


# One weight per config, changed on the torch side only by about 1% of that tensor's spread.
PERTURBED = {
    "gpt": "blocks.1.attention.value.weight",
    "llama": "blocks.0.feed_forward.gate.weight",
    "gpt2": "token_embedding.weight",
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_perturbing_one_torch_weight_is_detected(cases, name):
    cfg, flat, tokens, targets, jax_out = cases[name]
    target = PERTURBED[name]
    tok = int(tokens[0, 0])  # a row of the token table that is actually looked up
    index = (tok, 0) if target == "token_embedding.weight" else (0, 0)
    delta = 0.01 * float(flat[target].std())

    def perturb(p):
        p[target][index] += delta

    torch_out = torch_outputs(flat, tokens, targets, cfg, perturb=perturb)
    with pytest.raises(AssertionError, match="rel error"):
        assert_close(jax_out, torch_out, cfg, label=name)
    logits_err, grad_errs = compare(jax_out, torch_out)
    assert logits_err > logits_rtol(cfg) or max(grad_errs.values()) > grad_rtol(cfg)


# Plausible modelling slips, applied to the torch side only: each must exceed the tolerance.
MUTATIONS = {
    "gpt-gelu_tanh": ("gpt", dict(activation="gelu_tanh")),
    "gpt2-exact_gelu": ("gpt2", dict(activation="gelu")),
    "gpt-eps1e-6": ("gpt", dict(eps=1e-6)),
    "llama-eps1e-5": ("llama", dict(eps=1e-5)),
    "llama-theta5e5": ("llama", dict(rope_theta=500000.0)),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_modelling_slips_are_detected(cases, mutation):
    name, change = MUTATIONS[mutation]
    cfg, flat, tokens, targets, jax_out = cases[name]
    torch_out = torch_outputs(flat, tokens, targets, cfg.replace(**change))
    with pytest.raises(AssertionError, match="rel error"):
        assert_close(jax_out, torch_out, cfg, label=mutation)
