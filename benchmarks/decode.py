"""Greedy decoding of a SmolLM2-135M-shaped Llama: lmjax `generate` vs `transformers` `generate`.

Both sides run the same weights: a `transformers.LlamaForCausalLM` is built offline from a
seeded `LlamaConfig` with SmolLM2-135M's shapes (V 49152, D 576, 30 layers, H 9, Hkv 3 (GQA),
F 1536, tied head, rope_theta 1e5), saved with `save_pretrained` into a temporary directory and
read back into lmjax by `lmjax.io.hf.load` (the importer users run), so the benchmark also
exercises the import. The initializer range is 0.1 instead of 0.02 so the random model's
next-token distribution is peaked: near-ties within float rounding would otherwise make the two
sides' greedy tokens diverge for reasons that say nothing about either.

For each batch size the first call of each side is timed apart (lmjax: tracing + XLA
compilation of the prefill and decode step for this (B, T, S) bucket; torch: first
allocations), then the two are timed alternately `--rounds` times on the same prompts (equal
lengths, no padding), each producing exactly `--new-tokens` tokens per row; the figure is the
median end-to-end `generate` call, as batch * new_tokens / seconds. The tokens of both sides
must be identical (asserted, and recorded). The CPU may be shared: alternating and medians keep
that fair, not quiet, so the load average before and after is recorded beside the figures.

    JAX_PLATFORMS=cpu python benchmarks/decode.py           # -> benchmarks/results/decode.json
    python benchmarks/decode.py --quick --output /tmp/d.json  # tiny shapes (the smoke test)
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu is installed in the venv; CPU here

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout, no install
sys.path.insert(0, str(HERE))  # the sibling GPT-2 decoding benchmark's runners

from generate import TITLE, batch_rows, environment, run_hf, run_lmjax, token_rates  # noqa: E402

from benchmarks._harness import (  # noqa: E402
    add_output,
    alternate,
    load_average,
    parser,
    timed,
    write_result,
)
from lmjax import models  # noqa: E402
from lmjax.io import hf as hf_io  # noqa: E402

RESULTS = HERE / "results"
INIT_RANGE = 0.1
# SmolLM2-135M's config.json fields that set the shapes and the maths (lmjax's preset).
SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
QUICK = dict(
    SMOLLM2,
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def build_models(fields: dict, seed: int, workdir: Path):
    """`(hf_model, params, cfg)`: a seeded LlamaForCausalLM and lmjax's import of its save."""
    import torch
    import transformers

    torch.manual_seed(seed)
    hf_cfg = transformers.LlamaConfig(**fields, initializer_range=INIT_RANGE)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(workdir, safe_serialization=True)
    params, cfg = hf_io.load(workdir)
    return hf, params, cfg


def bench_batch(hf, params, cfg, batch: int, args) -> dict:
    """One batch size: first calls timed apart, then `args.rounds` alternating timed calls."""
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, cfg.vocab_size, (batch, args.prompt_len))
    calls = {
        "lmjax": lambda: run_lmjax(params, cfg, prompts, args.new_tokens),
        "transformers": lambda: run_hf(hf, prompts, args.new_tokens),
    }
    first, tokens = {}, {}
    for name, fn in calls.items():
        first[name], tokens[name] = timed(fn)
    same = tokens["lmjax"] == tokens["transformers"]
    if not same.all():
        raise AssertionError(
            f"batch {batch}: greedy tokens differ at {int((~same).sum())} of {same.size} places"
        )

    def unchanged(name, out):
        assert (out == tokens[name]).all(), f"{name}: greedy tokens changed between calls"

    figures = token_rates(alternate(calls, args.rounds, unchanged), batch * args.new_tokens)
    return {
        "batch": batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "first_call_s": first,
        # The first call less a warm one: lmjax's tracing + compilation for this bucket.
        "lmjax_compile_s": first["lmjax"] - figures["median_seconds"]["lmjax"],
        **figures,
        "tokens_identical": True,  # asserted above
        "first_tokens_row0": tokens["lmjax"][0, :8].tolist(),
    }


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny Llama shapes (the smoke test)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch-threads", type=int, default=None, help="default: torch's own")
    add_output(ap, None, "default results/decode.json")
    return ap.parse_args(argv)


def model_summary(quick: bool, fields: dict, parameters: int) -> dict:
    """The JSON "model" entry of this benchmark and qlora_llama.py."""
    return {
        "shape": "tiny llama (--quick)" if quick else "SmolLM2-135M",
        "hf_config": fields,
        "initializer_range": INIT_RANGE,
        "parameters": parameters,
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    fields = QUICK if args.quick else SMOLLM2
    if args.torch_threads:  # on a shared CPU torch's spinning OpenMP threads may lose time
        import torch

        torch.set_num_threads(args.torch_threads)
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        hf, params, cfg = build_models(fields, args.seed, Path(tmp))
    rows = batch_rows(
        lambda batch: bench_batch(hf, params, cfg, batch, args),
        args.batches,
        lambda row: f"lmjax compile {row['lmjax_compile_s']:.1f} s, tokens identical",
    )
    result = {
        "benchmark": TITLE,
        "model": {
            **model_summary(args.quick, fields, models.param_count(cfg)),
            "loaded_by": "lmjax.io.hf.load of LlamaForCausalLM.save_pretrained",
        },
        "rounds": args.rounds,
        "load_average": {"before": load_before, "after": load_average()},
        "results": rows,
        "environment": environment(hf),
    }
    out = args.output or RESULTS / ("decode_quick.json" if args.quick else "decode.json")
    write_result(out, result)
    print(f"wrote {out} (load average before {load_before}, after {load_average()})")
    return {**result, "path": str(out)}


if __name__ == "__main__":
    main()
