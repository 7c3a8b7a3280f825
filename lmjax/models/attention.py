"""The one place that chooses how attention runs: the ops (materialized, XLA), cuDNN's fused
attention, or the Pallas flash kernel, and on a device mesh how the kernel is split.

    out_BTHDh = softmax(q_BTHDh k_BSHDh^T / sqrt(Dh), masked) v_BSHDh     (`ops.attention`)

`impl` "materialized" and "xla" are `lmjax.ops.attention`; "cudnn" is
`jax.nn.dot_product_attention(implementation="cudnn")` through `ops.attention_cudnn` (every
mask, offset, window and segment id translated, packed documents kept apart); "flash" is
`pallas_kernels.flash_attention` (FlashAttention-2: O(T) memory, the logsumexp saved and the
probabilities recomputed in the backward; interpreted on CPU, compiled on GPU and TPU); "auto"
picks one for this machine and these inputs (`attention_choice.choose`: cuDNN on a CUDA GPU
where it can, flash on a TPU, XLA on a CPU) and says once which. The primitives in `ops` know
nothing of the kernel, as `models.project` is the one place that knows NF4 and LoRA.

On a mesh. XLA's SPMD partitioner cannot split a Mosaic (TPU) kernel ("Mosaic kernels cannot
be automatically partitioned. Please wrap the call in a shard_map"), so when a mesh is in context
(`jax.set_mesh(mesh)` around tracing, as `lmjax compile` does) the flash call runs inside
`jax.shard_map`: each device attends over its own batch rows (mesh axes `data`, `fsdp`) and its
own heads (`model`). Attention mixes neither rows nor heads, so the shards need no
communication and give the single-device result exactly. A batch the batch axes do not divide,
or heads the `model` axis does not divide, is a `ConfigError`. No mesh, or a mesh of one
device: the kernel is called as it is.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from lmjax import ops
from lmjax.checks import is_int, require
from lmjax.models.attention_choice import resolve
from lmjax.models.config import ATTENTION_IMPLS, ModelConfig
from lmjax.models.sharding import BATCH_AXES, HEAD_AXIS, batch_axes, context_mesh_shape
from lmjax.ops.attention_cudnn import cudnn_attention
from lmjax.ops.attention_mask import check_inputs, keep_mask, segment_pair
from pallas_kernels.flash_attention import flash_attention

IMPLS = ATTENTION_IMPLS


def attend(
    cfg: ModelConfig, q_BTHDh, k_BSHDh, v_BSHDh, *, causal=True, mask=None, segment_ids=None
) -> jax.Array:
    """Attention with the config's impl (`cfg.attention`), op set and sliding window:
    `-> [B, T, H, Dh]` (k and v may have fewer heads, `cfg.kv_heads`).

    `cfg.ops="reference"` runs `ops.attention_reference` whatever `cfg.attention` says."""
    options = dict(
        causal=causal,
        mask=mask,
        window=cfg.sliding_window,
        segment_ids=segment_ids,
    )
    if cfg.ops != "custom":
        return ops.attention_reference(q_BTHDh, k_BSHDh, v_BSHDh, **options)
    return dot_product_attention(q_BTHDh, k_BSHDh, v_BSHDh, impl=cfg.attention, **options)


def dot_product_attention(
    q,
    k,
    v,
    *,
    causal: bool,
    offset=0,
    mask=None,
    window=None,
    segment_ids=None,
    impl: str = "materialized",
    return_probabilities: bool = False,
):
    """`lmjax.ops.attention`'s contract (shapes, grouped-query heads, masks, offset, window,
    segment ids, empty rows) for every impl.

    q `[B, T, H, Dh]`, k and v `[B, S, Hkv, Dh]` -> out `[B, T, H, Dh]` (and p with
    `return_probabilities`, materialized only). "auto" becomes one of the others
    (`attention_choice.choose`). "cudnn" takes bfloat16/float16 inputs and head sizes cuDNN
    supports (else a `ConfigError`), anything else of the contract (`ops.attention_cudnn`).
    "flash" takes float32/bf16/f16 inputs, a static int `offset` and only key-padding masks
    (broadcastable from [B, 1, 1, S]); anything else is a `ConfigError`. Its segment ids go to
    the kernel as `q_segment_ids`, `kv_segment_ids` (int32). On a mesh it runs shard-mapped
    (module docstring).
    """
    require(impl in IMPLS, "impl", impl, f"one of {IMPLS}", "pick a listed impl")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if impl in ("auto", "cudnn"):
        check_inputs(q, k, v, impl, return_probabilities, mask, window, segment_ids)
        impl = resolve(impl, q.dtype, q.shape[-1], _flash_refusal(offset, mask))
    elif impl == "flash":
        resolve(impl, q.dtype, q.shape[-1])  # refuses flash on a GPU whose jax lacks Triton
    if impl == "cudnn":
        pair = segment_pair(segment_ids, q.shape, k.shape)
        options = dict(offset=offset, mask=mask, window=window, segment_ids=pair)
        return cudnn_attention(q, k, v, causal=causal, **options)
    if impl != "flash":
        kwargs = dict(offset=offset, mask=mask, window=window, segment_ids=segment_ids)
        return ops.attention(
            q, k, v, causal=causal, impl=impl, return_probabilities=return_probabilities, **kwargs
        )
    check_inputs(q, k, v, impl, return_probabilities, mask, window, segment_ids)
    fix = "pass an int offset, or use impl='materialized' or impl='xla' for a traced one"
    static = "a static Python int (the kernel fixes its causal block skipping at trace time)"
    require(is_int(offset), "offset with impl='flash'", offset, static, fix)
    arrays_BX = {}  # the kernel's [B, T] and [B, S] arguments, those in use
    if mask is not None:
        arrays_BX["mask"] = _key_padding(mask, q.shape, k.shape)
    if segment_ids is not None:
        pair = segment_pair(segment_ids, q.shape, k.shape)
        arrays_BX["q_segment_ids"], arrays_BX["kv_segment_ids"] = (
            ids.astype(jnp.int32) for ids in pair
        )
    return _flash_on_mesh(q, k, v, arrays_BX, causal=causal, offset=int(offset), window=window)


def _flash_refusal(offset, mask) -> str | None:
    """Why the flash kernel cannot take this call (`auto` then runs XLA), or None."""
    if not is_int(offset):
        return "the flash kernel takes a static int offset, not a traced one"
    shape = (1,) * (4 - jnp.ndim(mask)) + jnp.shape(mask) if mask is not None else None
    if shape is not None and shape[1:3] != (1, 1):
        return "the flash kernel takes key-padding masks only, not one over heads or queries"
    return None


def _key_padding(mask, q_shape, k_shape) -> jax.Array:
    """bool [B, S] from a mask broadcastable from [B, 1, 1, S]; other masks are refused."""
    b, s, mask = q_shape[0], k_shape[1], jnp.asarray(mask)
    # A mask no impl could use is the ShapeError every impl raises; checked abstractly, so no
    # [B, H, T, S] array is allocated.
    jax.eval_shape(lambda m: keep_mask(q_shape, k_shape, causal=False, mask=m), mask)
    mask_4d = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    require(
        mask_4d.shape[1:3] == (1, 1),
        "mask.shape with impl='flash'",
        mask.shape,
        f"a key-padding mask broadcastable from [B, 1, 1, S] = [{b}, 1, 1, {s}]",
        "use impl='materialized' (or 'xla') for masks that vary over heads or queries",
    )
    return jnp.broadcast_to(mask_4d[:, 0, 0, :] != 0, (b, s))


def _flash_on_mesh(q, k, v, arrays_BX: dict, *, causal: bool, offset: int, window) -> jax.Array:
    """The kernel on the context mesh's shards (batch rows x heads, query and key/value heads
    alike), or whole without a mesh. `arrays_BX`: the kernel's keyword arrays in use, each
    [B, T] or [B, S] (mask, q_segment_ids, kv_segment_ids), split over the batch only."""
    names = tuple(arrays_BX)

    def run(q, k, v, *arrays):
        options = dict(zip(names, arrays, strict=True))
        return flash_attention(q, k, v, causal=causal, offset=offset, window=window, **options)

    args = (q, k, v, *arrays_BX.values())
    shape = context_mesh_shape()
    if shape is None:
        return run(*args)
    batch, heads = mesh_split(shape, q.shape[0], q.shape[2], k.shape[2])
    spec_BTHDh = PartitionSpec(batch, None, heads, None)
    specs = (spec_BTHDh,) * 3 + (PartitionSpec(batch, None),) * len(names)
    # check_vma=False: the kernel's pallas_call carries no varying-axes types; every output
    # shard is computed from its own inputs alone, so nothing is claimed replicated.
    mesh = jax.sharding.get_abstract_mesh()
    sharded = jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=spec_BTHDh, check_vma=False)
    return sharded(*args)


def mesh_split(
    mesh_shape, batch: int, heads: int, kv_heads: int | None = None
) -> tuple[tuple[str, ...], str | None]:
    """(batch axes, head axis) of a mesh `{axis: size}` that split `batch` rows and `heads`
    (and `kv_heads` key/value heads, None = `heads`).

    Axes of size 1 are left out (they split nothing); a batch the batch axes do not divide, or
    heads (query or key/value) the head axis does not divide, is a `ConfigError` naming the
    sizes. Each device then holds whole groups: its H / model query heads read exactly its
    Hkv / model key/value heads (query head h reads h // G).
    """
    rows_axes = batch_axes(mesh_shape)
    rows = math.prod(mesh_shape[a] for a in rows_axes)
    where = ",".join(f"{a}={n}" for a, n in mesh_shape.items())
    require(
        batch % rows == 0,
        f"batch rows of flash attention on mesh {where}",
        batch,
        f"a multiple of {' x '.join(rows_axes)} = {rows} (each device attends over whole rows)",
        f"make the batch a multiple of {rows}, or use model.attention=xla",
    )
    model = mesh_shape.get(HEAD_AXIS, 1)
    require(
        heads % model == 0,
        f"heads of flash attention on mesh {where}",
        heads,
        f"a multiple of {HEAD_AXIS} = {model} (each device attends over whole heads)",
        f"set model.n_heads to a multiple of {model}, or use model.attention=xla",
    )
    kv_heads = heads if kv_heads is None else kv_heads
    require(
        kv_heads % model == 0,
        f"key/value heads of flash attention on mesh {where}",
        kv_heads,
        f"a multiple of {HEAD_AXIS} = {model} (each device attends over whole head groups)",
        f"set model.n_kv_heads to a multiple of {model}, or use model.attention=xla",
    )
    return rows_axes, (HEAD_AXIS if model > 1 else None)


__all__ = ["BATCH_AXES", "HEAD_AXIS", "IMPLS", "attend", "dot_product_attention", "mesh_split"]
