"""FlashAttention-2 in Pallas: a GPU (Triton) kernel and a TPU (Mosaic) kernel, one custom VJP.

Shapes (the layout of `jax.nn.dot_product_attention`): q `[B, T, H, Dh]`, k and v
`[B, S, Hkv, Dh]` with H % Hkv == 0, optional key-padding mask `[B, S]` (0/1 or bool) and
segment ids `[B, T]`, `[B, S]` (int) -> out `[B, T, H, Dh]` and the per-row logsumexp
`[B, H, T]` (float32). Letters: B batch, T queries, S keys, H query heads, Hkv key/value heads,
G = H // Hkv query heads per key/value head, Dh head size (the legend of `lmjax.models`);
inside a kernel, one block's arrays are suffixed with Q (its
query rows, `block_q`), K (its key rows, `block_k`) and Dh (the padded head size), e.g. q_QDh,
s_QK; a trailing 1 is a kept unit axis (m_Q1).

Modules: `plan` (BlockSizes, padding, which blocks run), `blocks` (the block math both kernels
share), `defaults` (the GPU kernel's default BlockSizes per GPU generation and head size, each
with the measurement that chose it), `gpu` and `tpu` (the kernels and their pallas_calls),
`vjp` (the custom VJP over padded inputs), `reference` (the argument checks and the plain-jnp
oracle). `plan`, `blocks` and `defaults` import nothing Triton- or Mosaic-specific.

Forward, per batch row b and query head h, with c = 1/sqrt(Dh) (Dh the head size *before*
padding) and k, v the key/value head h // G (grouped-query attention, Hugging Face's repeat_kv
order; read through the kernels' index maps, never a repeated copy):

    s[t,u]    = c * q[t,:] . k[u,:]
    keep[t,u] = mask[u] and (not causal or u <= t + offset)
                and (window is None or (t + offset) - u < window)
                and (no segment ids or q_segment_ids[t] == kv_segment_ids[u])
    over key blocks j (online softmax; f32 running max m, sum l, unnormalised output acc):
        m'  = max(m, max_{u in j, keep} s[t,u])
        p   = exp(s[t,u] - m') where keep, else 0
        l   = exp(m - m') l + sum_u p          acc = exp(m - m') acc + p v_j
    out[t] = acc / l          lse[t] = m + log l
    A row with no visible key has l = 0: out = 0 and lse = -inf (never NaN).

The forward saves only (q, k, v, mask, segment ids, out, lse): O(T) memory, no [T, S]
probabilities.
Dtypes: float32, bfloat16 or float16 inputs; matmul operands stay in the input dtype (p and ds
are rounded to it before their matmuls), every accumulator and softmax statistic is float32.
Float16 on the TPU kernel: Mosaic has no float16 vector loads (libtpu 0.0.42 refuses them,
"Invalid vector type for load"), so the wrapper upcasts q, k, v to float32 (exact), runs the
float32 kernel and rounds out (and dq, dk, dv) to float16; lse stays float32. Its results are
the float32 kernel's rounded once to float16, closer to exact than float16 operands would be,
at float32's VMEM and matmul cost (interpreted too, so the CPU tests check these numerics).

Backward (FlashAttention-2), given dO = dL/dout and dlse = dL/dlse (zero unless lse is used):

    delta[t] = sum_d dO[t,d] out[t,d] - dlse[t]     (d lse / d s = p, so dlse folds in here)
    p[t,u]   = exp(s[t,u] - lse[t]) where keep, else 0      (recomputed block by block)
    dv = p^T dO      dp = dO v^T      ds = p * (dp - delta)
    dq = c ds k      dk = c ds^T q
  One kernel accumulates dk, dv over query blocks; another accumulates dq over key blocks.
  GPU: the dk/dv kernel takes its tiles transposed (s^T = k q^T, [K, Q]: FlashAttention-2's
  Triton layout, reasons in `gpu._gpu_dkdv_kernel`), and the dq kernel may have its own tile
  (`BlockSizes.block_q_dq` x `block_k_dq`).
  Grouped-query attention: dk, dv of a key/value head sum over its G query heads inside the
  dk/dv kernel (a loop over the group on GPU, a grid axis on TPU, both into the same f32
  accumulators), so no `[B, S, H, Dh]` per-query-head intermediate is formed.

Block skipping (plan.kv_range / plan.q_range): query block i only visits the key blocks that
hold a key some row of it sees by the causal rule (u <= t + offset) and the window rule
(u > t + offset - window); the dk/dv kernel likewise visits only the query blocks that see its
keys. With segment ids, query block i and key block j are visited only if their intervals of
ids meet (plan.segment_bounds, computed in XLA before the kernel: qmin_i <= kmax_j and
kmin_j <= qmax_i), so the blocks of other documents in a packed row are skipped as well.
Skipped blocks are never read. Blocks that are entirely visible skip the mask arithmetic
(GPU kernel); with a key mask or segment ids every visited block is masked per element.

Padding (done in the wrapper, undone on the way out, so callers never see it):
  * T is padded to a multiple of the query blocks, S to a multiple of the key blocks. Padded keys
    are masked; padded query rows are computed and dropped (their dO is 0, so they add nothing
    to dk, dv). Segment ids are padded with ids no real one on the other side matches.
  * Dh is zero-padded (zero columns change no score and give zero output columns):
    GPU kernel to the next power of two >= 16 (Triton tiles are powers of two, `tl.dot` needs
    >= 16); TPU kernel to a multiple of 128 (the vector lane width).
  * A block larger than its (rounded-up) sequence shrinks to it, so short inputs are not padded
    up to a full default block.

Backends: `backend="gpu"` (grid (query blocks, B, H), fori_loop over key blocks in the kernel;
dk/dv: grid (key blocks, B, Hkv)) or `backend="tpu"` (grid (B, H, query blocks, key blocks), key
axis sequential, VMEM scratch accumulators; dk/dv: grid (B, Hkv, key blocks, G, query blocks)).
`backend=None` follows the platform compiled for (`jax.default_device`'s, e.g. a compile-only
TPU device on a CPU host, else `jax.default_backend()`); on CPU it runs the GPU kernel
(`CPU_KERNEL`) in interpret mode. Both kernels run interpreted on CPU (`interpret=True`).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import _backend, _triton
from pallas_kernels._backend import CPU_KERNEL, KERNELS  # re-exported: in __all__
from pallas_kernels._backend import require_platform as _require_platform
from pallas_kernels.flash_attention import defaults
from pallas_kernels.flash_attention.plan import BlockSizes, check_blocks, make_plan
from pallas_kernels.flash_attention.reference import INPUT_DTYPES, attention_reference, check_inputs
from pallas_kernels.flash_attention.vjp import flash_padded

# Input dtypes the TPU kernel runs in another dtype (docstring above: Mosaic loads no float16).
_TPU_COMPUTE_DTYPE = {jnp.dtype(jnp.float16): jnp.dtype(jnp.float32)}


def resolve_backend(backend: str | None, interpret: bool | None) -> tuple[str, bool]:
    """(kernel, interpret) for the arguments of `flash_attention` on this host.

    None follows `jax.default_backend()`: "gpu" and "tpu" compile their own kernel; "cpu" runs
    `CPU_KERNEL` interpreted. Any other name, or a platform with no kernel, is a ConfigError.
    """
    return _backend.resolve_backend(
        backend,
        interpret,
        what="flash attention backend",
        fix="pass backend='gpu' or backend='tpu', or use lmjax.ops.attention(impl='xla')",
    )


def flash_attention_with_lse(
    q,
    k,
    v,
    *,
    causal: bool,
    mask=None,
    offset: int = 0,
    window: int | None = None,
    q_segment_ids=None,
    kv_segment_ids=None,
    block_sizes: BlockSizes | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
):
    """(out [B, T, H, Dh], lse [B, H, T] f32); both differentiable. See the module docstring.

    k and v are `[B, S, Hkv, Dh]` with H % Hkv == 0: query head h reads key/value head
    h // (H // Hkv) through the kernels' index maps (no repeated copy), and dk, dv come back
    `[B, S, Hkv, Dh]`, summed over each group. `mask` is a `[B, S]` key-padding mask, bool or
    0/1 (1 keeps the key), as in `lmjax.ops.attention`: a concrete mask with any other value is
    a `ShapeError` (an additive mask converts with `keep = additive == 0`); a traced one is read
    as "nonzero keeps", so under jit pass a bool mask. Causal: key u is visible to query t iff
    u <= t + offset (`offset` a static int; a cache of S keys decoding T new queries uses
    offset = S - T, which is negative when T > S: the first rows then see no key). `window`
    (None or a static int >= 1): key u visible only if (t + offset) - u < window; key blocks
    outside the band are skipped. `q_segment_ids [B, T]`, `kv_segment_ids [B, S]` (integer,
    both or neither): key u visible only if their ids are equal (per element; a block pair
    whose id intervals do not meet is skipped, so a packed row's other documents cost
    nothing). Rows with no visible key: out 0, lse -inf, and exactly zero gradients (dq of
    the row, its share of dk and dv). `block_sizes=None`: the compiled GPU kernel takes
    `defaults.lookup(device kind, Dh)`, the TPU kernel and interpret mode
    `BlockSizes.default(kernel)`. A compiled GPU call on a jax without the Pallas Triton
    backend is a ConfigError (`triton_available`).
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    check_inputs(q, k, v, mask, offset, window, q_segment_ids, kv_segment_ids)
    kernel, interpret = resolve_backend(backend, interpret)
    compiled_gpu = kernel == "gpu" and not interpret
    if compiled_gpu:
        _triton.require(
            "flash attention backend", "use attention=cudnn or attention=xla on this jax"
        )
    if block_sizes is None and compiled_gpu:
        block_sizes = defaults.lookup(_backend.device_kind(), q.shape[-1]).sizes
    sizes = _backend.block_sizes_or_default(block_sizes, BlockSizes, kernel)
    check_blocks(sizes, kernel, interpret)
    _require_platform(kernel, interpret)
    segments = q_segment_ids is not None
    plan = make_plan(
        q.shape,
        k.shape,
        sizes,
        kernel,
        interpret,
        bool(causal),
        int(offset),
        mask is not None,
        window=None if window is None else int(window),
        has_segments=segments,
    )
    kmask = None if mask is None else (jnp.asarray(mask) != 0).astype(jnp.int32)
    qseg, kvseg = (
        (jnp.asarray(x).astype(jnp.int32) for x in (q_segment_ids, kv_segment_ids))
        if segments
        else (None, None)
    )
    compute = _compute_dtype(kernel, q.dtype)
    q_c, k_c, v_c = (x.astype(compute) for x in (q, k, v))  # no-ops unless float16 on TPU
    out, lse = flash_padded(plan, q_c, k_c, v_c, kmask, qseg, kvseg)
    return out.astype(q.dtype), lse


def triton_available() -> bool:
    """Whether this jax has the Pallas Triton backend the GPU kernel needs (without it, a
    compiled GPU call is a ConfigError and `model.attention=auto` never picks flash on a GPU)."""
    return _triton.available()


def _compute_dtype(kernel: str, dtype) -> jnp.dtype:
    """The dtype `kernel` computes inputs of `dtype` in: float16 on the TPU kernel runs as
    float32 (module docstring); everything else as itself."""
    dtype = jnp.dtype(dtype)
    return _TPU_COMPUTE_DTYPE.get(dtype, dtype) if kernel == "tpu" else dtype


def flash_attention(q, k, v, *, causal: bool, **options):
    """FlashAttention-2: `out [B, T, H, Dh]`; `options` (mask, offset, window, q_segment_ids,
    kv_segment_ids, block_sizes, backend, interpret) and the contract as in
    `flash_attention_with_lse`, whose lse it drops."""
    return flash_attention_with_lse(q, k, v, causal=causal, **options)[0]


__all__ = [
    "BlockSizes",
    "CPU_KERNEL",
    "INPUT_DTYPES",
    "KERNELS",
    "attention_reference",
    "flash_attention",
    "flash_attention_with_lse",
    "resolve_backend",
    "triton_available",
]
