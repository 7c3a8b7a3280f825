"""GPU timing: the Pallas flash kernel vs cuDNN and XLA attention, bf16, causal.

For T = 1k .. 16k and head dims 64 and 128 (B*T = 16384 tokens and H*D = 2048 per step, as
in the FlashAttention-2 paper's benchmarks), times the forward and the forward+backward of
  flash   pallas_kernels.flash_attention (GPU kernel, compiled)
  cudnn   jax.nn.dot_product_attention(implementation="cudnn")
  xla     jax.nn.dot_product_attention(implementation="xla") (skipped when its [B,H,T,T]
          scores would not fit comfortably)
and records flash's speed relative to cuDNN (t_cudnn / t_flash; the target is >= 0.8).
Before the sweep over T it tries two flash block sizes at T = 4096 and keeps the faster.

    python benchmarks/attention_gpu.py [--require-gpu]   # -> benchmarks/results/attention_gpu.json

Without a GPU it prints a note and exits 0 (1 with --require-gpu), so `make bench` stays green.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from pallas_kernels.flash_attention import BlockSizes, flash_attention  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
TOKENS, HIDDEN = 16384, 2048
XLA_MAX_SCORES = 2**31  # B*H*T*T: the XLA path keeps several f32 [B,H,T,T] tensors (8 GiB each)
TARGET = 0.8
CANDIDATES = (
    BlockSizes(128, 64, 64, 64),  # the default
    BlockSizes(64, 64, 64, 32, num_warps=4),
)


def shapes(t: int, d: int) -> tuple[int, int]:
    return max(1, TOKENS // t), HIDDEN // d


def attention_fn(impl: str, sizes: BlockSizes | None = None):
    if impl == "flash":
        options = dict(block_sizes=sizes, backend="gpu", interpret=False)
        return lambda q, k, v: flash_attention(q, k, v, causal=True, **options)
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation=impl
    )


def seconds_per_call(fn, args, calls: int = 10, samples: int = 5) -> float:
    """Back-to-back calls (dispatch overlaps the previous kernel), best of a few samples."""
    jax.block_until_ready(fn(*args))  # compile and warm up
    best = float("inf")
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def inputs(t: int, d: int, seed: int = 0):
    b, h = shapes(t, d)
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    return [jax.random.normal(key, (b, t, h, d), jnp.bfloat16) for key in keys]


def fwd_bwd_fn(attend):
    return jax.jit(lambda q, k, v, g: jax.vjp(attend, q, k, v)[1](g))


def time_impl(impl: str, t: int, d: int, sizes=None) -> dict:
    q, k, v, g = inputs(t, d)
    attend = attention_fn(impl, sizes)
    b, h = shapes(t, d)
    flops = 4 * b * h * t * t * d / 2  # two matmuls of 2*T*S*D each, half of them causal
    fwd_s = seconds_per_call(jax.jit(attend), (q, k, v))
    fwd_bwd_s = seconds_per_call(fwd_bwd_fn(attend), (q, k, v, g))
    return {
        "fwd_ms": 1e3 * fwd_s,
        "fwd_bwd_ms": 1e3 * fwd_bwd_s,
        "fwd_tflops": flops / fwd_s / 1e12,
        "fwd_bwd_tflops": 3.5 * flops / fwd_bwd_s / 1e12,  # backward = 2.5x forward
    }


def max_abs_diff(t: int, d: int, sizes) -> float:
    q, k, v, _ = inputs(t, d, seed=1)
    ours = jax.jit(attention_fn("flash", sizes))(q, k, v).astype(jnp.float32)
    theirs = jax.jit(attention_fn("cudnn"))(q, k, v).astype(jnp.float32)
    return float(jnp.max(jnp.abs(ours - theirs)))


def pick_block_sizes(d: int, t: int = 4096) -> tuple[BlockSizes, list]:
    """The candidate with the fastest forward+backward at one T (compiles fwd+bwd only)."""
    args = inputs(t, d)
    tried = []
    for sizes in CANDIDATES:
        try:
            seconds = seconds_per_call(fwd_bwd_fn(attention_fn("flash", sizes)), args)
            tried.append((1e3 * seconds, sizes))
        except Exception as e:  # a candidate that does not compile is recorded, not fatal
            print(f"  block sizes {sizes} failed: {type(e).__name__}: {str(e)[:200]}")
    if not tried:
        raise RuntimeError(f"no flash block-size candidate compiled for d={d}")
    report = [{"fwd_bwd_ms": ms, **dataclasses.asdict(s)} for ms, s in tried]
    return min(tried, key=lambda pair: pair[0])[1], report


def measure_point(t: int, d: int, sizes: BlockSizes) -> dict:
    b, h = shapes(t, d)
    row = {"T": t, "d": d, "B": b, "H": h, "flash_block_sizes": dataclasses.asdict(sizes)}
    for impl in ("flash", "cudnn", "xla"):
        if impl == "xla" and b * h * t * t > XLA_MAX_SCORES:
            row[impl] = {"skipped": f"B*H*T*T = {b * h * t * t} > {XLA_MAX_SCORES}"}
            continue
        try:
            row[impl] = time_impl(impl, t, d, sizes)
        except Exception as e:  # e.g. cuDNN missing: recorded and reported
            row[impl] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    if "fwd_ms" in row["flash"] and "fwd_ms" in row["cudnn"]:
        for key in ("fwd_ms", "fwd_bwd_ms"):
            row[f"speed_vs_cudnn_{key[:-3]}"] = row["cudnn"][key] / row["flash"][key]
        row["max_abs_diff_vs_cudnn"] = max_abs_diff(t, d, sizes)
    return row


def cell(result: dict, key: str) -> str:
    if key in result:
        return f"{result[key]:8.3f}"
    return f"{'skip' if 'skipped' in result else 'ERR':>8}"


def print_row(row: dict) -> None:
    times = " ".join(cell(row[i], "fwd_bwd_ms") for i in ("flash", "cudnn", "xla"))
    speed = row.get("speed_vs_cudnn_fwd_bwd", float("nan"))
    fwd = row.get("speed_vs_cudnn_fwd", float("nan"))
    tflops = row["flash"].get("fwd_bwd_tflops", float("nan"))
    print(
        f"{row['T']:6d} {row['d']:4d} {row['B']:3d} {row['H']:3d} | {times} | "
        f"{fwd:5.2f} {speed:5.2f} | {tflops:6.1f}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--require-gpu", action="store_true", help="exit 1 when there is no GPU")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS))
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting new points")
    parser.add_argument("--out", type=Path, default=RESULTS / "attention_gpu.json")
    args = parser.parse_args(argv)

    if jax.default_backend() != "gpu":
        print(f"attention_gpu: no GPU (jax.default_backend() = {jax.default_backend()!r}); skipped")
        return 1 if args.require_gpu else 0

    started = time.perf_counter()
    result = {
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "dtype": "bfloat16",
        "causal": True,
        "tokens_per_step": TOKENS,
        "hidden": HIDDEN,
        "target_speed_vs_cudnn": TARGET,
        "block_size_search": {},
        "rows": [],
    }
    print(f"device {result['device']}, jax {result['jax']}")
    print("     T    d   B   H | fwd+bwd ms: flash    cudnn      xla | speed/cudnn fwd f+b | TF/s")
    chosen = {}
    for d in args.head_dims:
        chosen[d], result["block_size_search"][str(d)] = pick_block_sizes(d)
    # T outer, d inner: if the time budget runs out, both head dims lose the same largest T.
    points = [(t, d) for t in sorted(args.seq_lens) for d in args.head_dims]
    truncated = False
    for t, d in points:
        if time.perf_counter() - started > args.budget_s:
            truncated = True
            break
        row = measure_point(t, d, chosen[d])
        result["rows"].append(row)
        print_row(row)
        save(result, args.out)  # after every point, so a run cut short by a timeout keeps them
    summarize(result, truncated)
    save(result, args.out)
    print(f"wrote {args.out} ({time.perf_counter() - started:.0f}s)")
    flash_failed = any("error" in row["flash"] for row in result["rows"])
    return 2 if flash_failed else 0


def save(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def summarize(result: dict, truncated: bool) -> None:
    speeds = [r["speed_vs_cudnn_fwd_bwd"] for r in result["rows"] if "speed_vs_cudnn_fwd_bwd" in r]
    result["truncated_by_budget"] = truncated
    if speeds:
        result["speed_vs_cudnn_fwd_bwd_geomean"] = float(np.exp(np.mean(np.log(speeds))))
        result["speed_vs_cudnn_fwd_bwd_min"] = float(min(speeds))
        result["meets_target_everywhere"] = bool(min(speeds) >= TARGET)
        print(
            f"flash/cuDNN speed (fwd+bwd): geomean {result['speed_vs_cudnn_fwd_bwd_geomean']:.2f},"
            f" min {min(speeds):.2f}; target >= {TARGET}"
        )


if __name__ == "__main__":
    sys.exit(main())
