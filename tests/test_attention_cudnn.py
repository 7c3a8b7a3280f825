"""`model.attention: cudnn` and `auto` (issue 31): the dispatch table, cuDNN's translation of
every lmjax attention feature, and a train step lowered for CUDA on this CPU host.

cuDNN cannot run here, so the translation (`lmjax.ops.attention_cudnn`) is run with the same
arguments and `implementation="xla"` and held to `ops.attention_reference` (values and
gradients, float32); what cuDNN itself makes of them is checked by lowering for CUDA with a
stand-in cuDNN (tests/_cudnn.py), where jax applies its own cuDNN checks.
"""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cudnn import FMHA_CALL, fake_cudnn  # noqa: F401 (fake_cudnn is a fixture)

from lmjax import compat, models, ops
from lmjax.config import RunConfig
from lmjax.errors import ConfigError
from lmjax.models import attention_choice
from lmjax.models.attention_choice import Machine, choose, resolve
from lmjax.ops.attention_cudnn import cudnn_attention
from lmjax.train import init_state, make_train_step
from pallas_kernels import flash_attention

CPU, TPU, ROCM = Machine("cpu"), Machine("tpu"), Machine("gpu", cuda=False)
H100, A100 = Machine("gpu", True, (9, 0)), Machine("gpu", True, (8, 0))
# A jax without the Pallas Triton backend (docs/kernels.md, "Without Triton").
H100_NO_TRITON = Machine("gpu", True, (9, 0), triton=False)
ROCM_NO_TRITON, TPU_NO_TRITON = Machine("gpu", triton=False), Machine("tpu", triton=False)
NO_TRITON = "not flash: this jax has no Pallas Triton backend"
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
TRACED = "the flash kernel takes a static int offset, not a traced one"

# (impl, machine, dtype, head size, why flash cannot) -> (runs, what auto's line contains)
TABLE = {
    "gpu_cudnn": (("auto", H100, BF16, 64, None), ("cudnn", "runs cudnn on this gpu")),
    "gpu_cudnn_f16": (("auto", A100, F16, 128, None), ("cudnn", "runs cudnn")),
    "hopper_head_256": (("auto", H100, BF16, 256, None), ("cudnn", "runs cudnn")),
    "gpu_cudnn_traced": (("auto", H100, BF16, 64, TRACED), ("cudnn", "runs cudnn")),
    "ampere_head_256": (
        ("auto", A100, BF16, 256, None),
        (
            "flash",
            "runs flash on this gpu, not cudnn: cuDNN attention takes a head size that "
            "is a multiple of 8 and at most 128 before Hopper (9.0), not 256",
        ),
    ),
    "gpu_float32": (
        ("auto", H100, F32, 64, None),
        (
            "flash",
            "runs flash on this gpu, not cudnn: cuDNN attention takes bfloat16 or "
            "float16 inputs, not float32",
        ),
    ),
    "gpu_head_12": (("auto", H100, BF16, 12, None), ("flash", "multiple of 8")),
    "gpu_float32_traced": (
        ("auto", H100, F32, 64, TRACED),
        ("xla", "runs xla on this gpu, not flash: " + TRACED),
    ),
    "rocm": (("auto", ROCM, BF16, 64, None), ("flash", "cuDNN is on NVIDIA (CUDA) GPUs only")),
    "tpu": (("auto", TPU, BF16, 64, None), ("flash", "runs flash on this tpu")),
    "tpu_traced": (("auto", TPU, F32, 64, TRACED), ("xla", "not flash: " + TRACED)),
    # On a CPU the materialized impl, not XLA's: it keeps 2.7x less for the backward (GPT-2
    # 124M, T = 1024), and takes float16, which XLA's CPU attention does not.
    "cpu": (("auto", CPU, F32, 64, None), ("materialized", "runs materialized on this cpu")),
    "cpu_bf16": (("auto", CPU, BF16, 64, None), ("materialized", "on this cpu")),
    "cpu_f16": (("auto", CPU, F16, 64, None), ("materialized", "on this cpu")),
    "cpu_traced": (("auto", CPU, F32, 64, TRACED), ("materialized", "on this cpu")),
    # Without Triton auto never picks flash on a GPU: cuDNN where it can, else XLA.
    "no_triton_cudnn": (("auto", H100_NO_TRITON, BF16, 64, None), ("cudnn", "runs cudnn")),
    "no_triton_float32": (
        ("auto", H100_NO_TRITON, F32, 64, None),
        (
            "xla",
            "runs xla on this gpu, not cudnn: cuDNN attention takes bfloat16 or float16 "
            "inputs, not float32, " + NO_TRITON,
        ),
    ),
    "no_triton_rocm": (("auto", ROCM_NO_TRITON, BF16, 64, None), ("xla", NO_TRITON)),
    "no_triton_traced": (("auto", ROCM_NO_TRITON, BF16, 64, TRACED), ("xla", NO_TRITON)),
    "no_triton_tpu": (("auto", TPU_NO_TRITON, BF16, 64, None), ("flash", "runs flash on this tpu")),
    "no_triton_cpu": (
        ("auto", Machine("cpu", triton=False), F32, 64, None),
        ("materialized", "cpu"),
    ),
    # Explicit choices run as named and say nothing; cudnn's machine is jax's to check.
    "explicit_cudnn_on_cpu": (("cudnn", CPU, BF16, 64, None), ("cudnn", None)),
    "explicit_flash": (("flash", H100, BF16, 64, None), ("flash", None)),
    "explicit_xla": (("xla", TPU, F32, 64, None), ("xla", None)),
    "explicit_materialized": (("materialized", H100, BF16, 64, None), ("materialized", None)),
}


@pytest.mark.parametrize("name", list(TABLE))
def test_the_dispatch_table(name):
    """`choose` for each (impl, machine, dtype, head size): what runs and `auto`'s one line."""
    (impl, machine, dtype, d_head, flash_refusal), (runs, says) = TABLE[name]
    chosen, line = choose(impl, machine, dtype, d_head, flash_refusal)
    assert chosen == runs
    if says is None:
        assert line is None
    else:
        assert says in line and "\n" not in line, line


@pytest.mark.parametrize(
    "machine, dtype, d_head, says",
    [
        (H100, F32, 64, "bfloat16 or float16 inputs, not float32"),
        (H100, BF16, 60, "multiple of 8 and at most 256 on compute capability 9.0 and later"),
        (H100, BF16, 264, "not 264"),
        (A100, F16, 256, "at most 128 before Hopper (9.0), not 256"),
        (CPU, BF16, 192, "at most 128 before Hopper"),  # capability unknown: jax's own limit
    ],
)
def test_an_explicit_cudnn_cuDNN_cannot_run_is_one_config_error(machine, dtype, d_head, says):
    with pytest.raises(ConfigError) as caught:
        choose("cudnn", machine, dtype, d_head)
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and says in message, message
    assert message.startswith("model.attention = 'cudnn'") and "model.attention=auto" in message


@pytest.mark.parametrize("machine", [H100_NO_TRITON, ROCM_NO_TRITON])
def test_an_explicit_flash_on_a_gpu_without_triton_is_one_config_error(machine):
    with pytest.raises(ConfigError) as caught:
        choose("flash", machine, BF16, 64)
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and "Triton backend" in message, message
    assert "model.attention=cudnn or model.attention=xla" in message
    assert choose("flash", TPU_NO_TRITON, BF16, 64) == ("flash", None)  # Mosaic, not Triton


def test_this_machine_reads_whether_jax_has_triton(monkeypatch):
    """The availability check `this_machine` reads, simulated missing on a (pretend) GPU."""
    monkeypatch.setattr(attention_choice.jax, "default_backend", lambda: "gpu")
    assert attention_choice.this_machine().triton == flash_attention.triton_available()
    monkeypatch.setattr(flash_attention, "triton_available", lambda: False)
    assert attention_choice.this_machine() == Machine("gpu", False, None, triton=False)


def test_without_triton_models_refuse_flash_and_auto_runs_xla(monkeypatch):
    monkeypatch.setattr(attention_choice, "this_machine", lambda: H100_NO_TRITON)
    attention_choice.say_once.cache_clear()
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 8, 2, 16), F32)
    with pytest.raises(ConfigError, match="Triton backend"):
        models.dot_product_attention(q, q, q, causal=True, impl="flash")
    auto = models.dot_product_attention(q, q, q, causal=True, impl="auto")
    xla = models.dot_product_attention(q, q, q, causal=True, impl="xla")
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(xla))
    attention_choice.say_once.cache_clear()


def test_auto_says_once_which_it_chose(monkeypatch, caplog):
    """One log line per choice per process, however often attention is traced."""
    monkeypatch.setattr(attention_choice, "this_machine", lambda: A100)
    attention_choice.say_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="lmjax"):
        for _ in range(3):
            assert resolve("auto", BF16, 64) == "cudnn"
        assert resolve("auto", F32, 64) == "flash"
        assert resolve("auto", F32, 64) == "flash"
        assert resolve("cudnn", BF16, 64) == "cudnn"  # explicit: nothing said
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "lmjax"]
    fallback = "model.attention=auto runs flash on this gpu, not cudnn: cuDNN attention takes " \
        "bfloat16 or float16 inputs, not float32"  # fmt: skip
    # The plain choice at INFO (an error's stderr stays one line), the fallback at WARNING.
    assert lines == [
        ("INFO", "lmjax: model.attention=auto runs cudnn on this gpu"),
        ("WARNING", "lmjax: " + fallback),
    ]
    assert attention_choice.said()[-2:] == ["model.attention=auto runs cudnn on this gpu", fallback]
    attention_choice.say_once.cache_clear()


def test_auto_is_the_default_and_cudnn_a_choice():
    assert models.ModelConfig(27, 16, 32, 4, 2, 64).attention == "auto"
    gpt = {"model": {"preset": "gpt"}}
    assert RunConfig.from_dict(gpt).model_config().attention == "auto"
    cfg = RunConfig.from_dict(gpt, {"model.attention": "cudnn"}).model_config()
    assert cfg.attention == "cudnn"
    with pytest.raises(ConfigError, match="auto.*cudnn"):
        models.preset("gpt", attention="cuDNN")


B, H, DH = 2, 4, 8
_PAD = np.ones((B, 1, 1, 7), bool)
_PAD[1, ..., -3:] = False  # row 1: its last 3 keys are padding
_HEADS = np.random.default_rng(5).random((B, H, 1, 6)) < 0.7  # a mask that varies by head
_HEADS[..., 0] = True


def _ids(*rows):
    return np.asarray(rows, np.int32)


# name: (T, S, Hkv, attention's keywords, what jax.nn.dot_product_attention receives:
#        is_causal, local_window_size, the keep mask's shape or None for no mask)
CASES = {
    "causal": (6, 6, 4, dict(causal=True), (True, None, None)),
    "gqa_causal": (6, 6, 2, dict(causal=True), (True, None, None)),
    "mqa_window": (6, 6, 1, dict(causal=True, window=3), (True, (2, 0), None)),
    "not_causal": (5, 7, 2, dict(causal=False), (False, None, None)),
    # cuDNN has no offset and no non-causal window: the keep mask carries them (T, S even).
    "offset": (3, 7, 2, dict(causal=True, offset=4), (False, None, (B, 1, 4, 8))),
    "window_not_causal": (6, 6, 2, dict(causal=False, window=2), (False, None, (B, 1, 6, 6))),
    "window_offset": (3, 6, 1, dict(causal=True, offset=3, window=3), (False, None, (B, 1, 4, 6))),
    "key_padding": (4, 7, 2, dict(causal=False, mask=_PAD), (False, None, (B, 1, 4, 8))),
    "mask_by_head": (6, 6, 2, dict(causal=True, mask=_HEADS), (True, None, (B, H, 6, 6))),
    # Packed rows: documents 1, 2 and a padding id 0; row 1 one document, its own padding.
    "segments": (
        7,
        7,
        2,
        dict(causal=True, segment_ids=_ids([1, 1, 1, 2, 2, 2, 0], [3, 3, 3, 3, 3, 0, 0])),
        (True, None, (B, 1, 8, 8)),
    ),
    "segments_window": (
        6,
        6,
        1,
        dict(causal=True, window=2, segment_ids=_ids([1, 1, 2, 2, 2, 2], [4, 4, 4, 4, 4, 0])),
        (True, (1, 0), (B, 1, 6, 6)),
    ),
    # Decoding 3 queries after 3 cached keys, queries and keys with their own ids; query id 5
    # matches no key, so its row is empty (output and gradients 0).
    "segments_pair_offset_padding": (
        3,
        6,
        2,
        dict(
            causal=True,
            offset=3,
            mask=_PAD[..., :6],
            segment_ids=(_ids([2, 2, 0], [1, 5, 1]), _ids([1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0])),
        ),
        (False, None, (B, 1, 4, 6)),
    ),
}


def _qkv(t, s, h_kv, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((B, t, H, DH), (B, s, h_kv, DH), (B, s, h_kv, DH))
    return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in shapes)


def _pair(kwargs: dict) -> dict:
    """`cudnn_attention` takes segment ids as a (q, kv) pair, as `segment_pair` makes them."""
    ids = kwargs.get("segment_ids")
    if ids is None or isinstance(ids, tuple):
        return kwargs
    return kwargs | {"segment_ids": (ids, ids)}


def _record(monkeypatch) -> list[dict]:
    """The keywords of each jax.nn.dot_product_attention call (the call itself still runs)."""
    calls, real = [], jax.nn.dot_product_attention

    def recorded(q, k, v, **kwargs):
        calls.append(kwargs)
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recorded)
    return calls


@pytest.mark.parametrize("name", list(CASES))
def test_each_feature_becomes_arguments_that_give_the_reference(monkeypatch, name):
    """The arguments cuDNN would get, run by XLA: values and the VJP of a random cotangent
    equal `attention_reference`'s (its own mask, k and v repeated to H heads; jax.grad).

    One jitted program per case (both values and both VJPs; the recorded call is the one made
    while tracing), not eager calls that compile every primitive of the two VJPs on its own."""
    t, s, h_kv, kwargs, (is_causal, window, mask_shape) = CASES[name]
    q, k, v = _qkv(t, s, h_kv)
    cotangent = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    calls = _record(monkeypatch)

    @jax.jit
    def both(q, k, v):
        (out, pull), (ref, ref_pull) = (
            jax.vjp(f, q, k, v)
            for f in (
                lambda *a: cudnn_attention(*a, **_pair(kwargs), implementation="xla"),
                lambda *a: ops.attention_reference(*a, **kwargs),
            )
        )
        return (out, pull(cotangent)), (ref, ref_pull(cotangent))

    (out, grads), (reference, expected) = both(q, k, v)
    (call,) = calls
    assert call["implementation"] == "xla"
    assert (call["is_causal"], call["local_window_size"]) == (is_causal, window)
    assert (None if call.get("mask") is None else call["mask"].shape) == mask_shape
    assert "bias" not in call and "query_seq_lengths" not in call
    np.testing.assert_allclose(out, reference, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_traced_offset_goes_into_the_keep_mask():
    q, k, v = _qkv(2, 6, 2)
    run = jax.jit(lambda o: cudnn_attention(q, k, v, causal=True, offset=o, implementation="xla"))
    for offset in (0, 2, 4):
        want = ops.attention_reference(q, k, v, causal=True, offset=offset)
        np.testing.assert_allclose(run(offset), want, rtol=1e-5, atol=1e-6)


def test_packed_rows_equal_each_document_alone():
    """Two documents (5 and 6 tokens) and a padding token in one row of 12, grouped heads:
    each document's outputs and its loss's gradients equal those of the document alone, and
    its loss sends nothing to the other document's keys and values."""
    ids = np.asarray([[1] * 5 + [2] * 6 + [0]], np.int32)
    rng = np.random.default_rng(2)
    q, k, v = (
        jnp.asarray(rng.standard_normal((1, 12, heads, DH)), jnp.float32) for heads in (4, 2, 2)
    )
    weights = jnp.asarray(rng.standard_normal((1, 12, 4, DH)), jnp.float32)

    def loss(q, k, v, weights, segment_ids=None):
        out = cudnn_attention(q, k, v, causal=True, segment_ids=segment_ids, implementation="xla")
        return jnp.sum(out * weights), out

    # Jitted: three programs (the packed row, and each document's length alone) instead of an
    # eager compile for every primitive and shape of four gradient calls.
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    for rows in (slice(0, 5), slice(5, 11)):
        inside = np.zeros((1, 12, 1, 1), bool)
        inside[:, rows] = True
        packed_grads, packed = grad(q, k, v, jnp.where(inside, weights, 0.0), (ids, ids))
        alone_grads, alone = grad(*(x[:, rows] for x in (q, k, v, weights)))
        np.testing.assert_allclose(packed[:, rows], alone, rtol=1e-5, atol=1e-6)
        for got, want in zip(packed_grads, alone_grads, strict=True):
            np.testing.assert_allclose(got[:, rows], want, rtol=1e-5, atol=1e-6)
            outside = np.asarray(got)[:, ~inside[0, :, 0, 0]]
            assert not np.any(outside), "a document reached another document's rows"


def _packed_model_logits(attention: str, segments: bool) -> np.ndarray:
    cfg = models.preset("llama", vocab_size=32, n_heads=4, n_kv_heads=2, dtype="bfloat16")
    cfg = cfg.replace(attention=attention)
    params = models.init(jax.random.key(0), cfg)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 32, (2, 16)), jnp.int32)
    ids = jnp.asarray([[1] * 7 + [2] * 9, [3] * 16], jnp.int32) if segments else None
    # Jitted: one program per config, not an eager compile of each primitive and shape.
    return np.asarray(jax.jit(models.forward)(params, tokens, cfg, segment_ids=ids), np.float32)


def test_a_packed_grouped_query_model_keeps_documents_apart(monkeypatch):
    """A bf16 Llama (4 query heads over 2 key/value heads) with model.attention=cudnn, its
    cuDNN calls run by XLA: the packed logits equal the materialized impl's, and differ from
    what attending across the documents gives by far more than bf16 rounding."""
    real = jax.nn.dot_product_attention
    monkeypatch.setattr(
        jax.nn, "dot_product_attention", lambda *a, **kw: real(*a, **kw | {"implementation": "xla"})
    )
    cudnn = _packed_model_logits("cudnn", True)
    kept_apart = _packed_model_logits("materialized", True)
    across = _packed_model_logits("materialized", False)
    gap = np.abs(cudnn - kept_apart).max()
    assert gap < 0.05, gap
    assert np.abs(across - kept_apart)[0, 7:].max() > 10 * gap


def test_a_packed_grouped_query_train_step_lowers_to_cudnn_for_cuda(fake_cudnn):  # noqa: F811
    """The train step of a packed bf16 Llama (4 query heads, 2 key/value heads) with
    model.attention=cudnn, lowered for CUDA on this CPU host: cuDNN's fused attention forward
    and backward, with its causal mask and a bias (the documents' keep mask), once per layer
    (unrolled here, so each layer's call shows; the scanned default's one call in the loop body
    is tests/test_gpu_structure.py's)."""
    cfg = models.preset("llama", vocab_size=32, n_heads=4, n_kv_heads=2, dtype="bfloat16")
    cfg = cfg.replace(attention="cudnn", scan_layers=False)
    lr = optax.constant_schedule(1e-3)
    tx = optax.adamw(lr)
    state = init_state(jax.random.key(0), cfg, tx)
    ids = np.asarray([[1] * 7 + [2] * 9, [3] * 10 + [0] * 6], np.int32)[None]
    tokens = np.zeros((1, 2, 16), np.int32)
    batch = {"inputs": tokens, "targets": tokens, "segment_ids": ids}
    step = make_train_step(cfg, tx, lr)
    text = compat.lowering_for(step, state, batch, platform="cuda")[1].as_text()
    calls = re.findall(r"custom_call @(__cudnn\$fmha\w+)\(", text)
    assert calls and all(c.startswith(FMHA_CALL) for c in calls)
    layers = cfg.n_layers
    assert calls.count("__cudnn$fmhaScaleBiasSoftmax") == layers, calls
    assert calls.count("__cudnn$fmhaScaleBiasSoftmaxBackward") == layers, calls
    configs = text.replace("\\22", '"')  # the backend configs are escaped JSON
    assert configs.count('"mask_type": "CAUSAL"') == 2 * layers
