"""Model validation (SPEC sections 3 and 11): every rejected config and input, with its message.

Each message must name the offending value, what was allowed, and a fix.
"""

from __future__ import annotations

import contextlib
import io
import math
import re

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest

from lmjax import models
from lmjax import params as ptree
from lmjax.cli import main
from lmjax.config import parse_overrides, parse_value
from lmjax.errors import ConfigError, ShapeError, TokenError

GPT = models.preset("gpt")


def assert_message(err: Exception, *parts: str) -> None:
    text = str(err)
    assert "Fix:" in text and "expected" in text, text
    for part in parts:
        assert part in text, f"{part!r} not in {text!r}"


@pytest.mark.parametrize(
    "overrides, parts",
    [
        (dict(vocab_size=0), ("model.vocab_size", "0", "[1, 2147483647]")),
        (dict(context_length=0), ("model.context_length", "[1, ")),
        (dict(d_model=0), ("model.d_model",)),
        (dict(n_heads=0), ("model.n_heads",)),
        (dict(n_layers=0), ("model.n_layers",)),
        (dict(d_ff=0), ("model.d_ff",)),
        (dict(d_model=-32), ("-32",)),
        (dict(n_layers=2.0), ("model.n_layers", "2.0", "an int")),
        (dict(n_heads=True), ("model.n_heads", "True")),
        (dict(d_model=30), ("30 % 4 = 2", "n_heads")),
        (dict(positions="rope", d_model=12, n_heads=4), ("d_head", "3", "even")),
        (dict(positions="sinusoidal", d_model=27, n_heads=3), ("d_model", "27", "even")),
        (dict(eps=0.0), ("model.eps", "0.0", "> 0")),
        (dict(eps=-1e-5), ("model.eps",)),
        (dict(eps=float("nan")), ("model.eps", "nan", "finite")),
        (dict(eps=float("inf")), ("model.eps", "inf")),
        (dict(rope_theta=0.0), ("model.rope_theta",)),
        (dict(dropout=1.0), ("model.dropout", "1.0", "[0, 1)")),
        (dict(dropout=-0.1), ("model.dropout",)),
        (dict(norm="batchnorm"), ("model.norm", "batchnorm", "rmsnorm")),
        (dict(activation="tanh"), ("model.activation", "swiglu")),
        (dict(positions="alibi"), ("model.positions", "alibi", "learned")),
        (dict(attention="sparse"), ("model.attention", "sparse", "materialized")),
        (dict(remat="everything"), ("model.remat", "everything", "dots")),
        (dict(dtype="float8"), ("model.dtype", "float8", "bfloat16")),
        (dict(param_dtype="int8"), ("model.param_dtype", "int8")),
        (dict(ops="fast"), ("model.ops", "fast", "reference")),
        (dict(bias="yes"), ("model.bias", "yes", "True or False")),
        (dict(tie_embeddings=1), ("model.tie_embeddings",)),
        (dict(vocab_size=3_000_000_000), ("model.vocab_size", "3000000000", "2147483647")),
        (dict(dtype=jnp.int32), ("model.dtype", "int32")),
    ],
)
def test_construction_rejects(overrides, parts):
    with pytest.raises(ConfigError) as info:
        GPT.replace(**overrides)
    assert_message(info.value, *parts)


def test_unknown_fields_and_presets_are_named():
    with pytest.raises(ConfigError) as info:
        models.preset("gpt", n_layer=3)
    assert_message(info.value, "n_layer", "n_layers")
    with pytest.raises(ConfigError) as info:
        models.preset("gpt5")
    assert_message(info.value, "gpt5", "llama-tiny")
    with pytest.raises(ConfigError) as info:
        models.ModelConfig.from_dict({"vocab_size": 3})
    assert_message(info.value, "missing", "d_model")
    assert models.ModelConfig.from_dict(GPT.to_dict()) == GPT


def test_dtypes_may_be_given_as_jnp_dtypes():
    cfg = GPT.replace(dtype=jnp.bfloat16, param_dtype=np.float32)
    assert (cfg.dtype, cfg.param_dtype) == ("bfloat16", "float32")
    assert cfg == GPT.replace(dtype="bfloat16")


def test_float16_with_the_xla_impl_on_cpu_is_a_config_error_not_an_xla_crash():
    cfg = GPT.replace(dtype="float16", attention="xla")
    params = models.init(jax.random.key(0), cfg)
    if jax.default_backend() == "cpu":
        with pytest.raises(ConfigError) as info:
            jax.jit(models.forward)(params, jnp.zeros((1, 4), jnp.int32), cfg)
        assert_message(info.value, "float16", "materialized")
    # float16 through the materialized impl works (statistics in float32 inside).
    logits = jax.jit(models.forward)(
        params, jnp.zeros((1, 4), jnp.int32), cfg.replace(attention="materialized")
    )
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()


def test_configs_are_frozen_and_hashable():
    with pytest.raises(AttributeError):
        GPT.d_model = 64  # type: ignore[misc]
    assert hash(GPT) == hash(models.preset("gpt")) and GPT.replace(n_layers=3) != GPT


# ---- inputs --------------------------------------------------------------------------------

PARAMS = jax.eval_shape(lambda k: models.init(k, GPT), jax.random.key(0))


def forward_shape(tokens):
    """Trace forward without running it: shape checks happen at trace time."""
    return jax.eval_shape(lambda p, t: models.forward(p, t, GPT), PARAMS, tokens)


@pytest.mark.parametrize(
    "shape, dtype, parts",
    [
        ((16,), jnp.int32, ("tokens.shape", "(16,)", "rank 2")),
        ((1, 2, 3), jnp.int32, ("tokens.shape", "rank 2")),
        ((0, 4), jnp.int32, ("tokens.shape", "(0, 4)", "batch >= 1")),
        ((2, 0), jnp.int32, ("tokens.shape", "time >= 1")),
        ((1, 17), jnp.int32, ("17", "context_length = 16", "crop")),
        ((1, 4), jnp.float32, ("tokens.dtype", "float32", "integer")),
    ],
)
def test_forward_rejects_bad_token_shapes_at_trace_time(shape, dtype, parts):
    with pytest.raises(ShapeError) as info:
        forward_shape(jax.ShapeDtypeStruct(shape, dtype))
    assert_message(info.value, *parts)


def test_in_range_tokens_trace_fine():
    out = forward_shape(jax.ShapeDtypeStruct((3, 16), jnp.int32))
    assert out.shape == (3, 16, 27) and out.dtype == jnp.float32


@pytest.mark.parametrize("bad", [27, -1, 1000])
def test_out_of_range_ids_are_token_errors_not_clamps(bad):
    params = models.init(jax.random.key(0), GPT)
    tokens = np.zeros((2, 5), np.int32)
    tokens[1, 3] = bad
    with pytest.raises(TokenError) as info:
        models.forward(params, tokens, GPT)
    assert_message(info.value, "tokens[1, 3]", str(bad), "[0, 27)", "vocab_size = 27")


def test_int64_ids_beyond_int32_are_rejected_not_wrapped():
    params = models.init(jax.random.key(0), GPT)
    tokens = np.array([[2**32 + 3, 1, 2]], np.int64)  # would wrap to id 3 as int32
    with pytest.raises(TokenError) as info:
        models.forward(params, tokens, GPT)
    assert_message(info.value, "tokens[0, 0]", str(2**32 + 3))


def test_params_that_do_not_match_the_config_are_named():
    params = ptree.flatten(models.init(jax.random.key(0), GPT))
    tokens = jnp.zeros((1, 4), jnp.int32)
    missing = dict(params)
    del missing["blocks.feed_forward.expand.bias"]
    extra = {**params, "blocks.attention.query.lora_a": params["final_norm.scale"]}
    one_layer = {**params, "blocks.attention.query.bias": params["blocks.attention.query.bias"][:1]}
    wrong = {**params, "final_norm.scale": jnp.ones(31)}
    scalar = {**params, "final_norm.scale": 1.0}
    ints = {**params, "final_norm.scale": jnp.ones(32, jnp.int32)}
    for flat, parts in (
        (scalar, ("final_norm.scale.shape", "()")),
        (ints, ("final_norm.scale.dtype", "int32", "float")),
        (missing, ("missing parameter", "blocks.feed_forward.expand.bias")),
        (one_layer, ("blocks.attention.query.bias.shape", "(1, 32)", "(2, 32)")),
        (extra, ("unexpected parameter", "lora_a")),
        (wrong, ("final_norm.scale.shape", "(31,)", "(32,)")),
    ):
        with pytest.raises(ShapeError) as info:
            models.forward(ptree.unflatten(flat), tokens, GPT)
        assert_message(info.value, *parts)
    # Params of another config: the llama tree has no position table.
    with pytest.raises(ShapeError) as info:
        models.forward(models.init(jax.random.key(0), models.preset("llama")), tokens, GPT)
    assert_message(info.value, "parameter")


# ---- overrides and the inspect command ------------------------------------------------------


def test_parse_values_and_overrides():
    assert [parse_value(t) for t in ("4", "1e-5", "0.1", "true", "False", "null", "gelu")] == [
        4,
        1e-5,
        0.1,
        True,
        False,
        None,
        "gelu",
    ]
    assert parse_value("yes") == "yes" and parse_value("none") == "none"  # remat=none
    # float() reads these words as numbers; as override values they are names (run.dir=nan).
    assert [parse_value(t) for t in ("nan", "inf", "Infinity", "-inf")] == [
        "nan",
        "inf",
        "Infinity",
        "-inf",
    ]
    assert parse_overrides(["n_layers=3", "bias=false", "n_layers=4"]) == {
        "n_layers": 4,
        "bias": False,
    }
    for bad in ("n_layers", "=3"):
        with pytest.raises(ConfigError) as info:
            parse_overrides([bad])
        assert_message(info.value, bad)


def test_inspect_prints_the_table_and_total(capsys):
    assert main(["inspect", "gpt", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^(\S+)\s+\[[\d, ]+\]\s+([\d,]+)$", out, re.M))
    # Per layer, as users read them (the model stores them stacked).
    expected = {name: f"{spec.size:,}" for name, spec in models.declare_layers(GPT).items()}
    assert rows == expected
    assert re.search(r"^total\s+19,419$", out, re.M)
    assert "AdamW state" in out and "batch 2, sequence 16" in out
    # Overrides may come before or after the options; "none" stays the string remat needs.
    assert main(["inspect", "llama", "--seq-len", "8", "n_layers=3", "remat=none"]) == 0
    out = capsys.readouterr().out
    assert "blocks.2.feed_forward.gate.weight" in out and "sequence 8" in out


@pytest.mark.parametrize(
    "argv, part",
    [
        (["inspect", "gpt", "d_model=33"], "33 % 4"),
        (["inspect", "nope"], "nope"),
        (["inspect", "gpt", "depth=3"], "depth"),
        (["inspect", "gpt", "--seq-len", "99"], "context_length = 16"),
        (["inspect", "gpt", "--batch-size", "0"], "--batch-size = 0"),
        (["inspect", "gpt", "vocab_size=3000000000"], "2147483647"),
    ],
)
def test_inspect_errors_are_one_line(capsys, argv, part):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and part in err and err.startswith("lmjax inspect: error:")


BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "bool": 1, "u32": 4}


def saved_bytes_per_jax(cfg, batch: int, seq_len: int) -> int:
    """Independent witness: JAX's own residual listing, without what comes from the arguments."""
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), models.abstract_params(cfg))
    tokens = jnp.zeros((batch, seq_len), jnp.int32)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        jax.ad_checkpoint.print_saved_residuals(
            lambda p, t: models.forward(p, t, cfg), params, tokens
        )
    total = 0
    for line in text.getvalue().splitlines():
        if "from the argument" in line:
            continue
        dtype, dims = re.match(r"\s*(\w+)\[([\d,]*)\]", line).groups()
        total += BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


@pytest.mark.parametrize(
    "changes",
    [{}, dict(dtype="bfloat16"), dict(remat="block"), dict(remat="dots"), dict(attention="xla")],
)
def test_residual_bytes_agree_with_jax_saved_residuals(changes):
    cfg = models.preset("llama", **changes)
    assert models.residual_bytes(cfg, 2, 16) == saved_bytes_per_jax(cfg, 2, 16) > 0


def test_remat_policies_keep_what_they_promise():
    # block keeps only block inputs; dots keeps every matmul output, dots_no_batch only those
    # without batch dims (so not the attention scores): block < dots_no_batch < dots < none.
    kept = {p: models.residual_bytes(GPT.replace(remat=p), 2, 16) for p in models.REMAT_POLICIES}
    assert kept["block"] < kept["dots_no_batch"] < kept["dots"] < kept["none"], kept


def test_memory_estimate_scales_with_the_batch_and_counts_optimizer_state():
    cfg = models.preset("llama")
    one, two, four = (models.memory_estimate(cfg, b, 32) for b in (1, 2, 4))
    assert one.params == one.gradients == 21_664 * 4 and one.optimizer == 21_664 * 8
    # Residuals are per example plus a batch-independent part (e.g. RoPE tables): affine in B.
    per_example = two.activations - one.activations
    assert per_example > 0 and four.activations - two.activations == 2 * per_example
    assert one.total == one.params + one.gradients + one.optimizer + one.activations
    half = models.memory_estimate(cfg.replace(param_dtype="bfloat16"), 1, 32)
    assert half.params == 21_664 * 2 and half.optimizer == 21_664 * 4
