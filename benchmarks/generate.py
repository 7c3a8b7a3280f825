"""Greedy decoding speed: lmjax's KV-cached `generate` vs Hugging Face `transformers` (CPU torch).

Both sides run the same GPT-2-shaped model (the `gpt2` preset layout: V 50257, C 1024, D 768,
H 12, F 3072, tied head; `--layers` of them, 12 by default): a `transformers.GPT2LMHeadModel`
is built offline from a seeded `GPT2Config` and its weights are copied into lmjax's layout with
`lmjax.io.hf_gpt2.to_lmjax` (the importer's mapping). The initializer range is
0.2 instead of 0.02 so that the random model's next-token distribution is peaked: greedy ties
within float rounding would otherwise make the two implementations' tokens diverge for reasons
that say nothing about either.

lmjax runs twice: as `generate` lays the blocks out by default (`layers="auto"`: per-layer
arrays on a CPU) and with them stacked and scanned (`layers="stacked"`, the layout off a CPU),
so `lmjax_over_stacked` is what the split buys here.

For each batch size, after one warm-up call each (compilation, allocator warm-up), the two are
timed alternately `--repeats` times on the same prompts (equal lengths, so transformers needs
no padding), each producing exactly `--new-tokens` tokens per row; the figure is the median
end-to-end `generate` call, as batch * new_tokens / seconds. The tokens of both sides are
compared (a correctness witness). The CPU may be shared with other work: alternating and
medians keep that fair, not quiet.

    python benchmarks/generate.py   # -> benchmarks/results/generate.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from benchmarks._harness import alternate, machine, parser, rates, write_result  # noqa: E402
from lmjax import generate as G  # noqa: E402
from lmjax import models  # noqa: E402
from lmjax import params as ptree  # noqa: E402
from lmjax.io import hf_gpt2  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TITLE = "greedy decoding tokens/s, lmjax generate vs transformers generate"  # decode.py's too


def build_models(layers: int, seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    hf_cfg = transformers.GPT2Config(n_layer=layers, initializer_range=0.2)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    cfg = models.preset("gpt2", n_layers=layers)
    return hf, cfg, from_hf(hf.state_dict(), cfg)


def from_hf(state: dict, cfg: models.ModelConfig) -> dict:
    """lmjax params from a GPT2LMHeadModel state dict, through lmjax's own importer mapping."""
    prefix = "transformer."
    arrays = {
        k[len(prefix) :]: np.asarray(v.detach().numpy(), np.float32)
        for k, v in state.items()
        if k.startswith(prefix)
    }
    flat = hf_gpt2.to_lmjax(arrays, cfg)
    # The importer's per-layer names, stacked as lmjax stores the blocks.
    return ptree.stack(ptree.unflatten({name: jax.numpy.asarray(a) for name, a in flat.items()}))


def run_lmjax(params, cfg, prompts, new_tokens, layers="auto"):
    tokens = G.generate(params, prompts.tolist(), cfg, max_new_tokens=new_tokens, layers=layers)
    return np.asarray(tokens)


def run_hf(model, prompts, new_tokens):
    import torch

    with torch.inference_mode():
        out = model.generate(
            torch.as_tensor(prompts),
            attention_mask=torch.ones(prompts.shape, dtype=torch.long),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    return out[:, prompts.shape[1] :].numpy()


def token_rates(times: dict[str, list[float]], generated: int) -> dict:
    """The figures of a batch size, this benchmark's and decode.py's: every round's seconds,
    tokens/s at the median (the headline) and at the best round (less sensitive to other work
    on a shared CPU), and lmjax's median over transformers'."""
    r = rates(times, generated)
    tps = r["per_second"]
    return {
        "seconds": times,
        "median_seconds": r["median_seconds"],
        "tokens_per_second": tps,
        "lmjax_over_transformers": tps["lmjax"] / tps["transformers"],
        "best_tokens_per_second": r["best_per_second"],
    }


def print_row(row: dict, tail: str) -> None:
    """One batch size's line: both sides' tokens/s, their ratio, then `tail`."""
    tps = row["tokens_per_second"]
    print(
        f"batch {row['batch']}: lmjax {tps['lmjax']:.1f} tok/s, transformers "
        f"{tps['transformers']:.1f} tok/s (x{row['lmjax_over_transformers']:.2f}), {tail}",
        flush=True,
    )


def batch_rows(bench, batches: list[int], tail) -> list[dict]:
    """`bench(batch)` of each batch size, printed as it is done (`tail(row)` ends its line)."""
    rows = []
    for batch in batches:
        rows.append(bench(batch))
        print_row(rows[-1], tail(rows[-1]))
    return rows


def bench_batch(hf, cfg, params, batch, args) -> dict:
    prompts = np.random.default_rng(batch).integers(0, cfg.vocab_size, (batch, args.prompt_len))
    calls = {
        "lmjax": lambda: run_lmjax(params, cfg, prompts, args.new_tokens),
        "transformers": lambda: run_hf(hf, prompts, args.new_tokens),
        # The blocks stacked and scanned, what "auto" does off a CPU (G.decoding_params).
        "lmjax_stacked": lambda: run_lmjax(params, cfg, prompts, args.new_tokens, "stacked"),
    }
    tokens = {name: fn() for name, fn in calls.items()}  # warm-up: compile, first allocations
    times = alternate(calls, args.repeats)
    same = tokens["lmjax"] == tokens["transformers"]
    rates_ = token_rates(times, batch * args.new_tokens)
    tps = rates_["tokens_per_second"]
    return {
        "batch": batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        **rates_,
        # "layers" (per-layer arrays) where "auto" split them, "stacked" where it did not.
        "lmjax_blocks": ptree.blocks_layout(G.decoding_params(params, cfg)),
        "lmjax_over_stacked": tps["lmjax"] / tps["lmjax_stacked"],
        "stacked_tokens_identical": bool((tokens["lmjax_stacked"] == tokens["lmjax"]).all()),
        "tokens_identical": bool(same.all()),
        "tokens_matching_fraction": float(same.mean()),
    }


def environment(hf) -> dict:
    """The versions, threads and machine a decoding figure was measured with."""
    import torch
    import transformers

    return machine(
        jax=jax.__version__,
        backend=jax.default_backend(),
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        transformers=transformers.__version__,
        hf_attention=hf.config._attn_implementation,
    )


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "generate.json")
    args = ap.parse_args()

    hf, cfg, params = build_models(args.layers, args.seed)
    rows = batch_rows(
        lambda batch: bench_batch(hf, cfg, params, batch, args),
        args.batches,
        lambda row: (
            f"tokens identical: {row['tokens_identical']}, lmjax over its stacked "
            f"blocks x{row['lmjax_over_stacked']:.2f}"
        ),
    )
    result = {
        "benchmark": TITLE,
        "model": {
            "layout": "gpt2",
            "n_layers": cfg.n_layers,
            "d_model": cfg.d_model,
            "n_heads": cfg.n_heads,
            "vocab_size": cfg.vocab_size,
            "parameters": models.param_count(cfg),
            "initializer_range": 0.2,
        },
        "repeats": args.repeats,
        "results": rows,
        "environment": environment(hf),
    }
    write_result(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
