"""Nothing that depends only on shapes is computed at run time (issue 32).

On an H200, XLA's GPU constant folder spent 17-30 s per NF4 weight shape evaluating index
arithmetic that `jnp.repeat(scales, 64, total_repeat_length=...)` had lowered to scatters and
prefix sums (`reduce_window`) over constant index arrays. Here each path is traced on this CPU
host and lowered for CUDA (`.trace(...).lower(lowering_platforms=("cuda",))`, no GPU needed),
and its StableHLO text is scanned (`findings`) for what a GPU compiler would have to fold or
sort: any `scatter` (except, in a train step, the token embedding's gradient, whose indices are
the tokens), `sort`, `chlo.top_k`, `reduce_window`, a `cumsum`-family call, and any gather or
scatter whose indices follow from constants and iotas alone, also through private functions.

Paths: NF4 quantize / dequantize / block scales, the GPU (and TPU) NF4 kernel's forward and
custom-VJP input gradient, the tiled XLA path, a QLoRA train step of a small grouped-query
Llama on the kernel and the tiled path, its KV-cache decode step (`lmjax generate` on a QLoRA
run), plain GPT and Llama train steps (materialized attention by query blocks, and the flash
kernel), and sampling, where only top-k / top-p sort (data order).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _pallas import CUSTOM_CALL, lowered_text

from lmjax import lora, models
from lmjax.generate.kv_cache import decode_logits, init_cache
from lmjax.generate.sampling import Sampling, sample
from lmjax.quant import nf4
from lmjax.quant import params as quant_params
from lmjax.train.step import init_state, make_train_step
from pallas_kernels.nf4_matmul import nf4_matmul, nf4_matmul_tiled

# Ops that are a finding wherever they appear (a scatter: unless its indices are data).
_ALWAYS = ("stablehlo.sort", "stablehlo.reduce_window", "chlo.top_k")
_SCATTER = "stablehlo.scatter"
# jnp.cumsum & co. lower to a private function of their name (a reduce_window on GPU).
_CUMULATIVE = re.compile(r"call @(cumsum|cumprod|cummax|cummin|cumlogsumexp)\b")
_INDICES = {"stablehlo.gather": 1, "stablehlo.dynamic_gather": 1, _SCATTER: 1}  # operand index
_SOURCES = ("stablehlo.constant", "stablehlo.iota")  # values known from shapes alone
_OPAQUE = ("stablehlo.while", "stablehlo.case", "stablehlo.custom_call", "stablehlo.rng")
_FUNC = re.compile(r"func\.func (?:public |private )?@([\w.$-]+)\(")
_DEF = re.compile(r'^\s*(%[^=]+?)\s*=\s*"?([\w.]+)"?(.*)$')
_CALLEE = re.compile(r"^\s*@([\w.$-]+)\(")
_VALUE = re.compile(r"%[\w.]+")


def _functions(text: str) -> dict[str, list[str]]:
    """Each function of the module by name, as its lines (SSA names are unique within one)."""
    funcs: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        m = _FUNC.search(line)
        name = m.group(1) if m else name
        if name is not None:
            funcs.setdefault(name, []).append(line)
    return funcs


def _operands(rest: str) -> list[str]:
    """An op line's SSA operands: what precedes its attributes `<{`, region `({` or type."""
    head = re.split(r"<\{| : |\(\{", rest, maxsplit=1)[0]
    return _VALUE.findall(head)


def _definitions(lines: list[str]) -> dict[str, tuple[str, list[str]]]:
    """SSA value -> (defining op, operands); `%5:2 = ...` defines %5 (used as %5#0, %5#1).

    Sibling regions may reuse a name (a scanned model's while bodies: the printer numbers each
    region's values afresh; seen with jax 0.11.2), and a flat map cannot tell which definition
    a use means: such a name maps to no op, so it never counts as constant."""
    defs, seen = {}, set()
    for line in lines:
        m = _DEF.match(line)
        if m:
            for value in _VALUE.findall(m.group(1)):
                defs[value] = ("", []) if value in seen else (m.group(2), _operands(m.group(3)))
                seen.add(value)
    return defs


def _scan(funcs, name: str, constant_args: frozenset, seen: set, found: list) -> None:
    """Findings of function `name` called with arguments `constant_args` (their positions)
    known from shapes alone; calls are followed with their own arguments' constancy."""
    if (name, constant_args) in seen:
        return
    seen.add((name, constant_args))
    defs = _definitions(funcs[name])
    memo: dict[str, bool] = {}

    def constant(value: str) -> bool:
        if value not in memo:
            memo[value] = False  # a cycle (none in SSA) or a block argument: not constant
            op, args = defs.get(value, ("", []))
            if not op and value.startswith("%arg") and value[4:].isdigit():
                memo[value] = int(value[4:]) in constant_args
            elif op in _SOURCES:
                memo[value] = True
            elif op and op not in _OPAQUE and args:
                memo[value] = all(constant(a) for a in args)
        return memo[value]

    for line in funcs[name]:
        m = _DEF.match(line)
        op, rest = (m.group(2), m.group(3)) if m else ("", line)
        args = _operands(rest)
        if any(f'"{banned}"' in line or f"{banned}(" in line for banned in _ALWAYS):
            found.append(line.strip())
        elif _CUMULATIVE.search(line):
            found.append(line.strip())
        elif op in _INDICES and len(args) > _INDICES[op] and constant(args[_INDICES[op]]):
            found.append(line.strip())
        elif op == _SCATTER:
            found.append("data-indexed " + line.strip())
        if op == "call" and _CALLEE.match(rest):
            callee = _CALLEE.match(rest).group(1)
            const = frozenset(i for i, a in enumerate(args) if constant(a))
            _scan(funcs, callee, const, seen, found)


def findings(text: str, data_scatter_ok: bool = False) -> list[str]:
    """The lines of StableHLO `text` a GPU compiler would fold or that sort (module docstring).
    `data_scatter_ok`: a scatter whose indices are not constant (an embedding gradient) passes.
    """
    found: list[str] = []
    _scan(_functions(text), "main", frozenset(), set(), found)
    if data_scatter_ok:
        found = [line for line in found if not line.startswith("data-indexed ")]
    return list(dict.fromkeys(found))


def _cuda_text(fn, *args, device: str | None = None, platform: str = "cuda") -> str:
    """`jax.jit(fn)` traced for `device`'s kernels ("gpu", "tpu"; None: this host's) and
    lowered for `platform` on this host."""
    return lowered_text(fn, *args, platform=platform, device=device)


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


# ---- the scan finds what it should -------------------------------------------------------------


def test_scan_finds_shape_only_index_arithmetic_and_passes_data_indices():
    x = jax.ShapeDtypeStruct((4,), jnp.float32)
    ids = jax.ShapeDtypeStruct((6,), jnp.int32)
    table = jax.ShapeDtypeStruct((16, 3), jnp.float32)
    repeat = _cuda_text(lambda a: jnp.repeat(a, 64, total_repeat_length=256), x)
    assert any("scatter" in f for f in findings(repeat))
    assert any("cumsum" in f for f in findings(repeat))
    arange = _cuda_text(lambda a: a[jnp.arange(8) // 2], x)
    assert any("gather" in f for f in findings(arange))

    @jax.jit  # an index built outside, used inside a private function
    def lookup(t, i):
        return jnp.take(t, i, axis=0)

    inside = _cuda_text(lambda t: lookup(t, jnp.arange(5)), table)
    assert any("gather" in f for f in findings(inside))
    grad = _cuda_text(jax.grad(lambda t, i: lookup(t, i).sum()), table, ids)
    assert findings(grad, data_scatter_ok=True) == []
    assert any("scatter" in f for f in findings(grad))  # by data: allowed only when asked
    assert findings(_cuda_text(lambda t, i: t[i], table, ids)) == []
    assert any("sort" in f for f in findings(_cuda_text(jnp.sort, x)))


# ---- NF4 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(160, 128), (7, 9)], ids=["two-groups", "odd-ragged"])
def test_nf4_format_lowers_without_index_arithmetic(shape):
    """quantize, dequantize and the block scales; (160, 128) has 320 blocks, two double-quant
    groups; (7, 9) has 63 weights, one partial block and a padding nibble."""
    qw = nf4.quantize(np.asarray(jax.random.normal(jax.random.key(0), shape)))
    spec = _abstract(qw)
    assert findings(_cuda_text(nf4.quantize, jax.ShapeDtypeStruct(shape, jnp.bfloat16))) == []
    assert findings(_cuda_text(nf4.dequantize, spec)) == []
    assert findings(_cuda_text(nf4.block_absmax, spec)) == []


@pytest.mark.parametrize("kernel, platform", [("gpu", "cuda"), ("tpu", "tpu")])
def test_nf4_kernel_forward_and_dx_lower_without_index_arithmetic(kernel, platform):
    """The public `nf4_matmul` traced for its compiled kernel (the wrapper decodes the block
    scales; the custom VJP's backward is the dx kernel): both kernels, nothing folded."""
    qw = _abstract(nf4.quantize(np.asarray(jax.random.normal(jax.random.key(0), (160, 256)))))
    x = jax.ShapeDtypeStruct((3, 5, 256), jnp.bfloat16)

    def loss(x, qw):
        return nf4_matmul(x, qw, backend=kernel, interpret=False).astype(jnp.float32).sum()

    # value_and_grad: from jax 0.12 the lowering drops a forward whose value is unused.
    text = _cuda_text(jax.value_and_grad(loss), x, qw, device=kernel, platform=platform)
    assert text.count(CUSTOM_CALL[kernel]) == 2  # forward and dx
    assert findings(text) == []


@pytest.mark.parametrize("shape", [(40, 100), (96, 128)], ids=["ragged", "aligned"])
def test_nf4_tiled_lowers_without_index_arithmetic(shape):
    """The XLA path (CPU, and GPU weights whose in-features are not a multiple of 64)."""
    qw = _abstract(nf4.quantize(np.asarray(jax.random.normal(jax.random.key(0), shape))))
    x = jax.ShapeDtypeStruct((3, shape[1]), jnp.float32)
    grad = jax.grad(lambda x, qw: nf4_matmul_tiled(x, qw, tile_rows=16).sum())
    assert findings(_cuda_text(grad, x, qw)) == []


# ---- train steps ---------------------------------------------------------------------------------

TX = optax.adamw(1e-3)
LLAMA = models.preset("llama", n_heads=4, n_kv_heads=2, d_model=64, vocab_size=64)


def _batch(b: int, t: int) -> dict:
    tokens = jax.ShapeDtypeStruct((1, b, t), jnp.int32)
    return {"inputs": tokens, "targets": tokens}


@pytest.mark.parametrize("device", ["gpu", None], ids=["kernel", "tiled"])
def test_qlora_train_step_lowers_without_index_arithmetic(device):
    """LoRA over an NF4 grouped-query Llama (every projection quantized, in-features 64): the
    NF4 kernel's path when traced for a GPU, the tiled path otherwise. The embeddings are
    frozen, so not even a data-indexed scatter is left."""
    frozen = quant_params.quantize_params(models.init(jax.random.key(0), LLAMA))
    lcfg = lora.LoraConfig(r=4, alpha=8, targets="all-linear")
    state = jax.eval_shape(
        lambda k: init_state(k, LLAMA, TX, lambda k2: lora.init(k2, frozen, lcfg)),
        jax.random.key(1),
    )
    step = make_train_step(LLAMA, TX, lambda s: 1e-3, loss=lora.objective(LLAMA, lcfg))
    text = _cuda_text(step, state, _batch(2, 16), _abstract(frozen), device=device)
    assert (CUSTOM_CALL["gpu"] in text) == (device == "gpu")
    assert findings(text) == []


@pytest.mark.parametrize(
    "name, attention, t, device",
    [
        ("gpt", "materialized", 16, None),
        ("llama", "materialized", 160, None),  # T > 64: attention by causal query blocks
        ("llama", "flash", 16, "gpu"),
    ],
)
def test_train_step_lowers_without_index_arithmetic(name, attention, t, device):
    """Plain GPT (learned positions) and grouped-query Llama train steps; the only scatter
    left is the token embedding's gradient, indexed by the tokens (lmjax.ops.embedding)."""
    base = LLAMA if name == "llama" else models.preset("gpt")
    cfg = base.replace(attention=attention, context_length=t)
    state = jax.eval_shape(lambda k: init_state(k, cfg, TX), jax.random.key(0))
    text = _cuda_text(make_train_step(cfg, TX, lambda s: 1e-3), state, _batch(2, t), device=device)
    assert (CUSTOM_CALL["gpu"] in text) == (attention == "flash")
    assert findings(text, data_scatter_ok=True) == []


# ---- decoding from NF4 weights (issue 32, item 4) --------------------------------------------


@pytest.mark.parametrize("device", ["gpu", None], ids=["kernel", "tiled"])
def test_qlora_decode_step_lowers_to_the_nf4_kernel_on_a_gpu(device):
    """What `lmjax generate` decodes a QLoRA run with (NF4 base, adapters attached): one token a
    row against a KV cache runs the NF4 kernel when traced for a GPU and the tiled path
    otherwise, with no index arithmetic on shapes alone (its scatters are the cache writes, at
    each row's length: data)."""
    frozen = quant_params.quantize_params(models.init(jax.random.key(0), LLAMA))
    lcfg = lora.LoraConfig(r=4, alpha=8, targets="all-linear")
    params = lora.attach(frozen, lora.init(jax.random.key(1), frozen, lcfg), lcfg)
    cache = jax.eval_shape(lambda: init_cache(LLAMA, 2, 16))
    token = jax.ShapeDtypeStruct((2,), jnp.int32)
    step = lambda p, t, c: decode_logits(p, t, LLAMA, c)  # noqa: E731
    text = _cuda_text(step, _abstract(params), token, cache, device=device)
    assert (CUSTOM_CALL["gpu"] in text) == (device == "gpu")
    assert findings(text, data_scatter_ok=True) == []


# ---- sampling: only top-k and top-p sort, by the logits' values ----------------------------------


def test_sampling_sorts_only_for_top_k_and_top_p():
    logits = jax.ShapeDtypeStruct((2, 64), jnp.float32)

    def lowered(sampling):
        return findings(_cuda_text(lambda z, k: sample(z, k, sampling), logits, jax.random.key(0)))

    assert lowered(Sampling()) == [] and lowered(Sampling(temperature=0.7)) == []
    top_k = lowered(Sampling(temperature=0.7, top_k=5))
    assert len(top_k) == 1 and "chlo.top_k" in top_k[0]
    top_p = lowered(Sampling(temperature=0.7, top_p=0.9))
    assert any("chlo.top_k" in f for f in top_p) and any("cumsum" in f for f in top_p)
    assert all(re.search(r"top_k|cumsum|reduce_window", f) for f in top_p)
