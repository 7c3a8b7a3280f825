"""The GPU kernel's default BlockSizes table (issue 33 item 1) and a jax without Triton (item 4).

The table (`pallas_kernels.flash_attention.defaults`) is checked for its lookup, for saying how
each entry was chosen, for its JSON form (what benchmarks/attention_gpu.py writes), and for
every entry: lowered to Triton IR on this CPU host with the launch settings it names, and
correct interpreted against the reference. A jax without the Pallas Triton backend is
simulated by clearing the module `_triton` imports it from.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re

import jax
import jax.numpy as jnp
import pytest
from _pallas import lowered_text
from test_flash_attention import Case, assert_matches_reference

import pallas_kernels.flash_attention as fa
from lmjax.errors import ConfigError
from pallas_kernels import _backend, _triton
from pallas_kernels.flash_attention import BlockSizes, blocks, defaults, gpu, plan

KINDS = {
    "NVIDIA H200": "hopper",
    "NVIDIA H100 80GB HBM3": "hopper",
    "NVIDIA H100 PCIe": "hopper",
    "NVIDIA GH200 480GB": "hopper",
    "NVIDIA H800": "hopper",
    "NVIDIA A100-SXM4-80GB": "ampere",
    "NVIDIA A100 80GB PCIe": "ampere",
    "NVIDIA A10G": "ampere",
    "NVIDIA RTX A6000": "ampere",
    "NVIDIA GeForce RTX 3090": "ampere",
    "Tesla V100-SXM2-16GB": "other",
    "NVIDIA L4": "other",
    "NVIDIA GeForce RTX 4090": "other",
    "cpu": "other",
}
EXAMPLE_KIND = {"hopper": "NVIDIA H200", "ampere": "NVIDIA A100-SXM4-80GB", "other": "NVIDIA L4"}
# (entry's sizes, head key) once each: entries that share sizes compile the same kernels.
DISTINCT = sorted({(e.sizes, e.head_dim) for e in defaults.TABLE}, key=lambda x: (x[1], repr(x[0])))


@pytest.mark.parametrize("kind", list(KINDS))
def test_generation_from_device_kind(kind):
    assert defaults.generation(kind) == KINDS[kind]


def test_lookup_has_one_entry_per_generation_and_head_key():
    keys = [(e.generation, e.head_dim) for e in defaults.TABLE]
    assert sorted(keys) == sorted((g, d) for g in defaults.GENERATIONS for d in defaults.HEAD_KEYS)
    for d, key in [(16, 64), (40, 64), (64, 64), (80, 128), (128, 128), (256, 128)]:
        assert defaults.head_key(d) == key
        for kind, gen in KINDS.items():
            entry = defaults.lookup(kind, d)
            assert (entry.generation, entry.head_dim) == (gen, key)


def test_every_entry_says_how_it_was_chosen():
    """A measured entry names machine, jax and what it measured; the rest say "not yet
    measured". Every entry spells out its launch (warps and stages, forward and backward)."""
    for e in defaults.TABLE:
        assert None not in dataclasses.asdict(e.sizes).values(), e
        if e.measured is None:
            assert e.status == "not yet measured"
            continue
        assert e.status == "measured"
        m = e.measured
        assert m.machine and m.jax and (m.fwd_bwd_tflops or m.cudnn_ratio), e
        assert defaults.generation(m.machine) == e.generation, e
    # Issue 33's H200 numbers were taken with the default sizes: only Hopper is measured.
    assert {e.generation for e in defaults.TABLE if e.measured} == {"hopper"}


@pytest.mark.parametrize("d", [64, 128])
def test_the_entries_spell_out_what_an_unset_launch_picks(d):
    """The table's sizes are today's defaults, launch included, so the kernels that issue 33
    measured with `BlockSizes()` are the ones the measured Hopper entry holds; the one
    exception, Hopper at head 128, is checked below."""
    unset = plan.make_plan(
        (1, 256, 1, d), (1, 256, 1, d), BlockSizes(), "gpu", False, True, 0, False
    )
    for gen in defaults.GENERATIONS:
        if (gen, d) == ("hopper", 128):
            continue
        sizes = defaults.lookup(EXAMPLE_KIND[gen], d).sizes
        assert sizes.blocks == BlockSizes().blocks
        spelled = dataclasses.replace(unset, **_launch_fields(sizes))
        for backward in (False, True):
            assert gpu.launch(spelled, backward) == gpu.launch(unset, backward)


def test_hopper_head_128_takes_the_flashattention_2_backward():
    """Issue 33 item 2: dk/dv 32 queries x 128 keys, dq 128 x 32 and 5 stages (Triton's tutorial
    06 backward), 8 warps (defaults.py: the accumulators' registers), the forward unchanged;
    not yet measured, and the note keeps what the 64 x 64 backward it replaced measured."""
    entry = defaults.lookup("NVIDIA H200", 128)
    assert entry.sizes.blocks == dict(
        block_q=128, block_k=64, block_q_bwd=32, block_k_bwd=128, block_q_dq=128, block_k_dq=32
    )
    assert _launch_fields(entry.sizes) == dict(
        num_warps=8, num_stages=3, num_warps_bwd=8, num_stages_bwd=5
    )
    assert entry.measured is None and entry.status == "not yet measured"
    assert "tutorial 06" in entry.note and "0.43x" in entry.note and "T=4096" in entry.note
    assert defaults.lookup("NVIDIA H200", 64).measured is not None  # head 64 keeps its figures


def _launch_fields(sizes: BlockSizes) -> dict:
    names = ("num_warps", "num_stages", "num_warps_bwd", "num_stages_bwd")
    return {n: getattr(sizes, n) for n in names}


@pytest.mark.parametrize("entry", defaults.TABLE, ids=lambda e: f"{e.generation}-{e.head_dim}")
def test_entries_round_trip_through_their_json_form(entry):
    """What the benchmark writes as "winners" reads back as the same entry."""
    text = json.dumps(defaults.entry_to_dict(entry))
    assert defaults.entry_from_dict(json.loads(text)) == entry


def _triton_calls(text: str) -> dict[str, dict[str, int]]:
    """{kernel name: {grid_x, num_warps, num_stages}} of each Triton custom call in `text`."""
    calls = {}
    for line in text.splitlines():
        if "__gpu$xla.gpu.triton" not in line:
            continue
        name = re.search(r'name = "([^"]+)"', line).group(1)
        calls[name] = {
            f: int(re.search(rf"{f} = (\d+)", line).group(1))
            for f in ("grid_x", "num_warps", "num_stages")
        }
    return calls


@pytest.mark.parametrize("gen", defaults.GENERATIONS)
@pytest.mark.parametrize("d", [64, 128])
def test_every_entry_lowers_to_triton_with_its_launch(monkeypatch, gen, d):
    """With block_sizes=None, the compiled GPU kernel on a `gen` GPU takes the table's entry:
    forward + backward lower to three Triton calls whose grids and launch settings are the
    entry's (traced for a GPU on this CPU host: the default device's platform is "gpu")."""
    monkeypatch.setattr(_backend, "device_kind", lambda: EXAMPLE_KIND[gen])
    sizes = defaults.lookup(EXAMPLE_KIND[gen], d).sizes
    t = 256
    x = jax.ShapeDtypeStruct((1, t, 2, d), jnp.bfloat16)

    def loss(q, k, v):
        return fa.flash_attention(q, k, v, causal=True).astype(jnp.float32).sum()

    grad = jax.grad(loss, (0, 1, 2))
    calls = _triton_calls(lowered_text(grad, x, x, x, platform="cuda", device="gpu"))
    assert calls == {
        "flash_attention_fwd_gpu": dict(
            grid_x=t // sizes.block_q, num_warps=sizes.num_warps, num_stages=sizes.num_stages
        ),
        "flash_attention_dq_gpu": dict(
            grid_x=t // sizes.dq_blocks[0],
            num_warps=sizes.num_warps_bwd,
            num_stages=sizes.num_stages_bwd,
        ),
        "flash_attention_dkdv_gpu": dict(
            grid_x=t // sizes.block_k_bwd,
            num_warps=sizes.num_warps_bwd,
            num_stages=sizes.num_stages_bwd,
        ),
    }


@pytest.mark.parametrize("sizes, d", DISTINCT, ids=lambda x: str(x) if isinstance(x, int) else "")
def test_every_entry_is_correct_interpreted(sizes, d):
    """Each distinct entry's blocks, interpreted, against the reference (out, lse, dq, dk, dv):
    T = 256 and S = 200 hold whole blocks of 128 and a ragged last key block."""
    assert_matches_reference(Case(1, 256, 200, 2, d, causal=True, offset=-56), "gpu", sizes)


def test_interpreted_calls_keep_todays_defaults(monkeypatch):
    """On a CPU (the kernel interpreted) block_sizes=None is `BlockSizes.default("gpu")`, whatever
    the table holds."""
    seen = []
    real = fa.make_plan
    monkeypatch.setattr(fa, "make_plan", lambda *a, **k: seen.append(a[2]) or real(*a, **k))
    monkeypatch.setattr(defaults, "TABLE", ())  # a lookup would now fail
    x = jnp.ones((1, 32, 1, 16), jnp.float32)
    fa.flash_attention(x, x, x, causal=True)
    assert seen == [BlockSizes.default("gpu")]


# ---- a jax without the Pallas Triton backend -----------------------------------------------------


@pytest.fixture
def no_triton(monkeypatch):
    """This jax as one without `jax.experimental.pallas.triton`."""
    monkeypatch.setattr(_triton, "_pltriton", None)
    assert not fa.triton_available()


def test_without_triton_a_compiled_gpu_call_is_one_config_error(no_triton):
    x = jax.ShapeDtypeStruct((1, 64, 1, 64), jnp.bfloat16)
    with jax.default_device("gpu"), pytest.raises(ConfigError) as caught:
        jax.jit(lambda q: fa.flash_attention(q, q, q, causal=True)).trace(x)
    message = str(caught.value)
    assert len(message.splitlines()) == 1, message
    assert "Triton" in message and "attention=cudnn" in message and "attention=xla" in message


def test_without_triton_the_kernel_still_runs_interpreted(no_triton):
    """Interpret mode needs no Triton: the kernel's math stays testable on any jax."""
    case = Case(1, 40, 40, 1, 16, causal=True)
    assert_matches_reference(case, "gpu", BlockSizes(16, 16, 16, 16))


def test_the_kernel_math_imports_nothing_triton_specific():
    """`plan`, `blocks`, `defaults` and the `_backend` helpers they use import no Triton (nor
    Mosaic) module, so a Mosaic GPU kernel can reuse them; only `_triton` (for `gpu`) and `tpu`
    hold backend imports."""
    for module in (plan, blocks, defaults, _backend):
        tree = ast.parse(inspect.getsource(module))
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [
            f"{n.module}.{a.name}"
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)
            for a in n.names
        ]
        assert names, module.__name__
        bad = [n for n in names if re.search(r"triton|mosaic|pallas\.tpu|pallas\.gpu", n)]
        assert not bad, (module.__name__, bad)
    assert not [m for m in (plan, blocks, defaults, gpu, _backend) if hasattr(m, "pltriton")]
