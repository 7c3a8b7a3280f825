"""The decoder forward pass: tokens `[B, T]` -> logits `[B, T, V]` (docs/models.md).

    x_0 = E_token[tokens] (+ E_position[t] | + sinusoid(t))            [B, T, D]
    for each block (pre-norm residual):
        x = x + Attention(norm_a(x))     causal; RoPE on q and k when positions="rope"
        x = x + FeedForward(norm_f(x))   W_project act(W_expand h), or SwiGLU:
                                         W_down (silu(W_gate h) * W_up h)
    logits = norm_final(x) W_head^T (+ b_head)      W_head = E_token when tie_embeddings

Packed rows (`segment_ids [B, T]`, lmjax.models.segments): attention stays inside each
segment and positions restart at 0 at each segment's first token.

Dropout (rate `cfg.dropout`, only when a `dropout_key` is given) is applied to the embedding
sum and to each residual branch's output. Loss and optimizer live outside the model.

Layers. The blocks' parameters are stored stacked (`params["blocks"]` leaves `[N, ...]`,
lmjax.params). With `cfg.scan_layers` (the default) the N blocks run as one `lax.scan` whose
body is one block, so the program holds one block whatever N is; otherwise a Python loop runs
block i on the i-th slice of the same tree. Both give the same values (tests/test_scan_layers.py).

Decoding (`lmjax.generate`) reuses these pieces rather than a copy: `embed` and `project_qkv`
take explicit positions, and `cached_block` is `block` with the attention core (`attend`)
swapped for one that stores k, v in a KV cache and attends over it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from lmjax import ops
from lmjax import params as ptree
from lmjax.checks import check_token_ids, is_concrete, require
from lmjax.errors import ShapeError
from lmjax.models.attention import attend
from lmjax.models.config import REMAT_POLICIES, ModelConfig
from lmjax.models.layout import check_params
from lmjax.models.projection import project
from lmjax.models.segments import check_segment_ids, segment_positions
from lmjax.models.sharding import rows_on_mesh
from lmjax.ops.rope import RopeScaling
from lmjax.quant.nf4 import QuantizedWeight


def _op(cfg: ModelConfig, name: str):
    """The primitive `name` from the op set the config selects (custom VJP or reference)."""
    return getattr(ops, name if cfg.ops == "custom" else f"{name}_reference")


def _linear(cfg: ModelConfig):
    """The projection of the config's op set, for any layer kind (`models.project`)."""
    return functools.partial(project, reference=cfg.ops != "custom")


def _norm(cfg: ModelConfig, p: dict, x_BTD: jax.Array) -> jax.Array:
    if cfg.norm == "rmsnorm":
        return _op(cfg, "rms_norm")(x_BTD, p["scale"], cfg.eps)
    return _op(cfg, "layer_norm")(x_BTD, p["scale"], p.get("bias"), cfg.eps)


def _dropout(cfg: ModelConfig, key, x: jax.Array) -> jax.Array:
    if key is None or cfg.dropout == 0.0:
        return x
    return _op(cfg, "dropout")(key, x, cfg.dropout, False)


def project_qkv(cfg: ModelConfig, p: dict, h_BTD: jax.Array, positions_BT=None) -> tuple:
    """Queries `[B, T, H, Dh]`, keys and values `[B, T, Hkv, Dh]` of the normed input `h [B, T, D]`.

    K and V keep their Hkv heads (grouped-query attention reads each for H / Hkv query heads;
    no repeated copy). With `qk_norm`, q and k are RMS-normalised over each head's Dh features
    (scales `query_norm`, `key_norm`) before RoPE. RoPE (positions="rope") rotates q and k by
    `positions [B|1, T]` (default `0..T-1`); decoding passes each token's absolute position so
    cached keys keep the rotation of their own slot.
    """
    b, t, _ = h_BTD.shape

    def linear(name, heads):  # named for the remat policies (config.ATTENTION_PROJECTIONS)
        y = _saved(_linear(cfg)(p[name], h_BTD), f"{name}_proj")
        return y.reshape(b, t, heads, cfg.d_head)

    q_BTHDh = linear("query", cfg.n_heads)
    k_BTHDh, v_BTHDh = linear("key", cfg.kv_heads), linear("value", cfg.kv_heads)
    if cfg.qk_norm:
        rms_norm = _op(cfg, "rms_norm")
        q_BTHDh = rms_norm(q_BTHDh, p["query_norm"]["scale"], cfg.eps)
        k_BTHDh = rms_norm(k_BTHDh, p["key_norm"]["scale"], cfg.eps)
    if cfg.positions == "rope":
        rope = functools.partial(
            _op(cfg, "rope"), positions=positions_BT, theta=cfg.rope_theta, scaling=_scaling(cfg)
        )
        q_BTHDh, k_BTHDh = rope(q_BTHDh), rope(k_BTHDh)
    return q_BTHDh, k_BTHDh, v_BTHDh


def _scaling(cfg: ModelConfig) -> RopeScaling | None:
    """The config's RoPE frequency scaling for `ops.rope` (None: the plain frequencies)."""
    if cfg.rope_scaling == "none":
        return None
    return RopeScaling(
        cfg.rope_scaling,
        cfg.rope_factor,
        cfg.rope_low_freq_factor,
        cfg.rope_high_freq_factor,
        cfg.rope_original_context,
    )


def _self_attend(cfg: ModelConfig, q_BTHDh, k_BTHDh, v_BTHDh, segment_ids_BT=None) -> tuple:
    return attend(cfg, q_BTHDh, k_BTHDh, v_BTHDh, segment_ids=segment_ids_BT), None


def _attention(cfg: ModelConfig, p: dict, h_BTD: jax.Array, positions_BT, attend_fn) -> tuple:
    q_BTHDh, k_BTHDh, v_BTHDh = project_qkv(cfg, p, h_BTD, positions_BT)
    out_BTHDh, aux = attend_fn(cfg, q_BTHDh, k_BTHDh, v_BTHDh)
    b, t, _ = h_BTD.shape
    y_BTD = _linear(cfg)(p["output"], out_BTHDh.reshape(b, t, cfg.q_features))
    return _saved(y_BTD, "out_proj"), aux


def _saved(y_BT_: jax.Array, name: str) -> jax.Array:
    """A projection's output, named for the remat policies and pinned to the device's own
    batch rows on a mesh: a scanned model hands what the backward keeps to it in `[N, ...]`
    buffers, which take this layout (unpinned, XLA laid them out whole on every device)."""
    return checkpoint_name(rows_on_mesh(y_BT_, rest="free"), name)


def _feed_forward(cfg: ModelConfig, p: dict, x_BTD: jax.Array) -> jax.Array:
    def linear(name, x, tag):  # named for the remat policies (config.MLP_PROJECTIONS)
        return _saved(_linear(cfg)(p[name], x), tag)

    if cfg.activation == "swiglu":
        h_BTF = _op(cfg, "swiglu")(linear("gate", x_BTD, "mlp_in"), linear("up", x_BTD, "mlp_in"))
        return linear("down", h_BTF, "mlp_out")
    h_BTF = _op(cfg, cfg.activation)(linear("expand", x_BTD, "mlp_in"))
    return linear("project", h_BTF, "mlp_out")


def _block(p, x_BTD, keys, cfg, positions_BT, attend_fn) -> tuple:
    attn_key, ff_key = keys
    h_BTD = _norm(cfg, p["attention_norm"], x_BTD)
    y_BTD, aux = _attention(cfg, p["attention"], h_BTD, positions_BT, attend_fn)
    x_BTD = x_BTD + _dropout(cfg, attn_key, y_BTD)
    h_BTD = _norm(cfg, p["feed_forward_norm"], x_BTD)
    return x_BTD + _dropout(cfg, ff_key, _feed_forward(cfg, p["feed_forward"], h_BTD)), aux


def block(
    p: dict, x_BTD: jax.Array, keys: tuple, cfg: ModelConfig, segment_ids_BT=None, positions_BT=None
):
    """One pre-norm block: `x + Attn(norm(x))`, then `x + FF(norm(x))`; `[B,T,D] -> [B,T,D]`.

    With `segment_ids [B, T]` attention stays inside each segment and RoPE restarts per segment
    (`positions_BT`: their `segment_positions`, which `features` computes once for every block).
    """
    if segment_ids_BT is None:
        return _block(p, x_BTD, keys, cfg, None, _self_attend)[0]
    if positions_BT is None:
        positions_BT = segment_positions(segment_ids_BT)
    attend_fn = functools.partial(_self_attend, segment_ids_BT=segment_ids_BT)
    return _block(p, x_BTD, keys, cfg, positions_BT, attend_fn)[0]


def cached_block(
    p: dict, x_BTD: jax.Array, cfg: ModelConfig, positions_BT: jax.Array, attend_fn
) -> tuple:
    """`block` for decoding (no dropout): `-> (x [B, T, D], aux)`.

    The tokens sit at absolute `positions [B, T]` (RoPE), and `attend_fn(cfg, q, k, v) ->
    (out [B, T, H, Dh], aux)` replaces causal self-attention: a KV cache stores this call's
    k and v (returning the updated cache as `aux`) and attends over everything cached.
    """
    return _block(p, x_BTD, (None, None), cfg, positions_BT, attend_fn)


def _block_fn(cfg: ModelConfig):
    def fn(p, x_BTD, keys, segment_ids_BT, positions_BT):
        return block(p, x_BTD, keys, cfg, segment_ids_BT, positions_BT)

    if cfg.remat_policy == "none":
        return fn
    # Unrolled, prevent_cse keeps XLA from merging the recomputation back into the forward
    # pass. Inside a scan the loop boundary already does, and the barriers it adds would only
    # cost (jax.checkpoint's docs advise prevent_cse=False there).
    policy = REMAT_POLICIES[cfg.remat_policy]
    return jax.checkpoint(fn, policy=policy, prevent_cse=not cfg.scan_layers)


def layer(blocks: dict, i: int) -> dict:
    """Layer i's parameters: the i-th slice of every stacked leaf (NF4 weights included)."""
    return jax.tree.map(lambda a: a[i], blocks)


def layer_keys(dropout_key, cfg: ModelConfig) -> tuple:
    """`(embedding key, per-layer keys [N, 2])`: `fold_in(dropout_key, j)` for j = 0 and
    j = 1 .. 2N (layer i's attention and feed-forward get 2i + 1 and 2i + 2), or Nones without
    dropout. Scanned and unrolled runs draw the same masks from them."""
    if dropout_key is None or cfg.dropout == 0.0:
        return None, (None, None)
    fold = jax.vmap(jax.random.fold_in, in_axes=(None, 0))
    keys = fold(dropout_key, jnp.arange(1, 2 * cfg.n_layers + 1))  # typed [2N] or raw [2N, 2]
    keys_N2 = keys.reshape(cfg.n_layers, 2, *keys.shape[1:])
    return jax.random.fold_in(dropout_key, 0), (keys_N2[:, 0], keys_N2[:, 1])


def run_layers(cfg: ModelConfig, blocks: dict, x_BTD: jax.Array, step, per_layer=None):
    """`x <- step(layer_params, x, per_layer_i)` for each layer in order: one `lax.scan` over
    the stacked `blocks` (and the `[N, ...]` leaves of `per_layer`) when `cfg.scan_layers`, a
    Python loop over their slices otherwise. `step` returns `(x, out_i)`; the outs come back
    stacked `[N, ...]` (a KV cache's new entries, for instance), or None. Per-layer `blocks`
    (`{"0": ..., "1": ...}`, decoding's layout on a CPU: `lmjax.generate.decode_layout`) always
    run by the loop.
    """
    split = ptree.blocks_layout({ptree.STACKED: blocks}) == "layers"
    if cfg.scan_layers and not split:
        return jax.lax.scan(lambda x, xs: step(xs[0], x, xs[1]), x_BTD, (blocks, per_layer))
    outs = []
    for i in range(cfg.n_layers):
        p_layer = blocks[str(i)] if split else layer(blocks, i)
        x_BTD, out = step(p_layer, x_BTD, layer(per_layer, i))
        outs.append(out)
    stacked = jax.tree.map(lambda *o: jnp.stack(o), *outs) if outs[0] is not None else None
    return x_BTD, stacked


def embed(p: dict, tokens_BT: jax.Array, cfg: ModelConfig, positions_BT=None) -> jax.Array:
    """Token embedding plus absolute positions (learned or sinusoidal): `[B, T] -> [B, T, D]`.

    `positions [B, T]` (default `0..T-1` for every row) are each token's absolute position, as
    decoding needs; a position outside `[0, C)` gives a NaN row, never a clamped one.
    """
    x_BTD = _op(cfg, "embedding")(p["token_embedding"]["weight"], tokens_BT)
    t = tokens_BT.shape[1]
    if cfg.positions == "learned" and positions_BT is None and t <= cfg.context_length:
        # Rows 0..T-1 are a slice, its gradient a pad: a lookup by arange(T) would be a gather
        # and a scatter-add over constant indices, which GPU compilers fold (issue 32).
        x_BTD = x_BTD + p["position_embedding"]["weight"][:t][None]
    elif cfg.positions == "learned":
        pos_BT = jnp.arange(t)[None] if positions_BT is None else positions_BT  # NaN rows past C
        x_BTD = x_BTD + _op(cfg, "embedding")(p["position_embedding"]["weight"], pos_BT)
    elif cfg.positions == "sinusoidal" and positions_BT is None:
        x_BTD = x_BTD + ops.sinusoidal_positions(t, cfg.d_model, x_BTD.dtype)[None]
    elif cfg.positions == "sinusoidal":
        # Rows of the same float64-built table, so position t gets the bits forward gives it.
        table_CD = ops.sinusoidal_positions(cfg.context_length, cfg.d_model, x_BTD.dtype)
        x_BTD = x_BTD + jnp.take(table_CD, positions_BT, axis=0, mode="fill", fill_value=jnp.nan)
    return x_BTD


def head_params(p: dict, cfg: ModelConfig) -> dict:
    """The language-model head's linear params: the token table when tied."""
    if cfg.tie_embeddings:
        return {"weight": p["token_embedding"]["weight"]}
    return p["language_model_head"]


def head(p: dict, x_BTD: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm and the language-model head (the token table when tied): `[B,T,D] -> [B,T,V]`."""
    x_BTD = _norm(cfg, p["final_norm"], x_BTD)
    return _linear(cfg)(head_params(p, cfg), x_BTD)


def check_tokens(tokens, cfg: ModelConfig) -> jax.Array:
    """Shape checks at trace time; the id range check whenever the ids are concrete.

    Concrete ids are range-checked before they become a JAX array, so an int64 id that int32
    cannot hold is reported, not wrapped around.
    """
    concrete = is_concrete(tokens)
    if concrete and not isinstance(tokens, jax.Array):
        tokens = np.asarray(tokens)
    fix_shape = "pass token ids as a [batch, time] integer array"
    if tokens.ndim != 2:
        raise ShapeError.describe("tokens.shape", tokens.shape, "rank 2, [batch, time]", fix_shape)
    integer = jnp.issubdtype(tokens.dtype, jnp.integer)
    fix_dtype = "cast tokens with .astype(jnp.int32)"
    require(integer, "tokens.dtype", tokens.dtype, "an integer dtype", fix_dtype, ShapeError)
    b, t = tokens.shape
    if b == 0 or t == 0:
        raise ShapeError.describe(
            "tokens.shape", tokens.shape, "batch >= 1 and time >= 1", "drop empty batches"
        )
    if t > cfg.context_length:
        raise ShapeError.describe(
            "tokens time length T",
            t,
            f"T <= context_length = {cfg.context_length}",
            "crop the sequence to the last context_length tokens or raise context_length",
        )
    if concrete:
        check_token_ids(
            np.asarray(tokens),
            cfg.vocab_ids,
            "tokens",
            fix="re-tokenize with the model's tokenizer ("
            + (
                f"tokenizer_size = {cfg.vocab_ids}: embedding rows past it are padding)"
                if cfg.padded_vocab
                else f"vocab_size = {cfg.vocab_size})"
            ),
        )
    return jnp.asarray(tokens)


def cast(params: Any, dtype) -> Any:
    """Every float leaf in `dtype` (the compute copy of f32 master weights); a no-op if equal.

    Integer leaves (a LoRA adapter's dropout key) are left as they are, and so is an NF4
    `QuantizedWeight` as a whole: its float32 statistics (absmax2, offset) are part of its format,
    and rounded to bf16 they would decode other weights; the kernel decodes in x's dtype anyway.
    """
    return jax.tree.map(lambda a: _cast_leaf(a, dtype), params, is_leaf=_is_quantized)


def _is_quantized(a) -> bool:
    return isinstance(a, QuantizedWeight)


def _cast_leaf(a, dtype):
    if _is_quantized(a):
        return a
    floating = jnp.issubdtype(a.dtype, jnp.floating)
    return a.astype(dtype) if floating and a.dtype != dtype else a


def forward(
    params: dict, tokens, cfg: ModelConfig, *, dropout_key=None, segment_ids=None
) -> jax.Array:
    """Logits `[B, T, V]` (float32) for tokens `[B, T]`; see the module docstring.

    The computation runs in `cfg.dtype` (params are cast from `cfg.param_dtype`, so gradients
    come back in the master dtype); the logits are returned in float32 for the loss. Without a
    `dropout_key` dropout is off (evaluation). Raises `ShapeError` for a bad token shape, `T > C`
    or params that do not match `cfg`, and `TokenError` for an id outside `[0, V)` when the ids
    are concrete (under `jit` the caller checks ids at its host-side boundary). `segment_ids
    [B, T]` (ints, one per document of a packed row) keep each document to itself: its logits
    are those it gets alone.
    """
    p, x_BTD = features(params, tokens, cfg, dropout_key=dropout_key, segment_ids=segment_ids)
    return _linear(cfg)(head_params(p, cfg), x_BTD).astype(jnp.float32)


def features(params: dict, tokens, cfg: ModelConfig, *, dropout_key=None, segment_ids=None):
    """`forward` up to the head: `-> (params in cfg.compute_dtype, final-normed x [B, T, D])`.

    `forward` applies the head to x; the train step instead feeds x and `head_params` to
    `ops.linear_cross_entropy`, which never materializes the logits. Checks as `forward`.
    """
    tokens_BT = check_tokens(tokens, cfg)
    segment_ids_BT = check_segment_ids(segment_ids, tokens_BT)
    positions_BT = None if segment_ids_BT is None else segment_positions(segment_ids_BT)
    check_params(params, cfg)
    p = cast(params, cfg.compute_dtype)
    embed_key, keys_N = layer_keys(dropout_key, cfg)
    # On a mesh the residual stream stays on each device's own batch rows (models.sharding).
    x_BTD = rows_on_mesh(_dropout(cfg, embed_key, embed(p, tokens_BT, cfg, positions_BT)))
    run_block = _block_fn(cfg)

    def step(p_layer, x_BTD, keys):
        x_BTD = run_block(p_layer, x_BTD, keys, segment_ids_BT, positions_BT)
        return rows_on_mesh(x_BTD), None

    x_BTD, _ = run_layers(cfg, p["blocks"], x_BTD, step, keys_N)
    return p, _norm(cfg, p["final_norm"], x_BTD)
