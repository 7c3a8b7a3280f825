"""GPU timing: the Pallas NF4 matmul vs a bf16 matmul at the same shapes.

For the projections of GPT-2 124M (`[O, I]` = 768x768 for query/key/value/output, 3072x768
expand, 768x3072 project) at `--tokens` rows of x (default 4096 = batch 8 x 512, and 16, a
decoding-sized batch where reading the weight dominates), times, in bfloat16:
  nf4        pallas_kernels.nf4_matmul (GPU kernel, compiled): decodes the 4-bit weight on chip
  nf4_xla    nf4_matmul_reference: XLA dequantizes the whole weight, then one matmul
  bf16       x @ W^T with the bf16 weight (what NF4 replaces)
the forward and the forward + input gradient (dx, the only gradient a frozen weight needs).
For the kernel it first times each `CANDIDATES` block size on the forward at that point and
keeps the fastest. It records each impl's time, the weight bytes it reads (NF4: 0.5 byte per
weight plus the scales; bf16: 2), and the kernel's max |difference| from nf4_xla.

A time is the best, over `--samples`, of the mean of `--calls` back-to-back calls.

    python benchmarks/nf4_matmul_gpu.py [--require-gpu] [--results-dir DIR] [--budget-s S]
    # -> DIR/nf4_matmul_gpu.json (default benchmarks/results), rewritten after every point

Without a GPU it prints a note and exits 0 (1 with --require-gpu). `--allow-cpu` runs the flow
on CPU with the kernel interpreted, only to check this script, e.g.
    --allow-cpu --tokens 16 --shapes 64x128 --calls 1 --samples 1
Exit status: 0, or 2 when the kernel failed somewhere (recorded in the JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import platform
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from benchmarks._gpu import error_text, no_gpu_exit, seconds_per_call, write_json  # noqa: E402
from lmjax.quant import quantize, storage_bytes  # noqa: E402
from pallas_kernels.nf4_matmul import BlockSizes, nf4_matmul, nf4_matmul_reference  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FILENAME = "nf4_matmul_gpu.json"
SHAPES = ((768, 768), (3072, 768), (768, 3072))  # GPT-2 124M: attention, expand, project
TOKENS = (4096, 16)
CANDIDATES = (
    BlockSizes(64, 64, 128),  # the default
    BlockSizes(128, 128, 64, num_warps=8),
    BlockSizes(64, 128, 128, num_warps=4, num_stages=4),
    BlockSizes(16, 64, 256, num_warps=4),  # few rows (decoding): wide K steps
)
IMPLS = ("nf4", "nf4_xla", "bf16")


def parse_shape(text: str) -> tuple[int, int]:
    try:
        out, inp = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected OUTxIN such as 768x3072, got {text!r}"
        ) from None
    if out <= 0 or inp <= 0 or inp % 64:
        raise argparse.ArgumentTypeError(f"{text}: need OUT, IN > 0 and IN a multiple of 64")
    return out, inp


@functools.cache
def jitted(impl: str, sizes: BlockSizes | None, interpret: bool):
    """(forward, forward + dx) of one impl; x, the weight (QuantizedWeight or bf16) are args."""
    if impl == "nf4":
        options = dict(block_sizes=sizes, backend="gpu", interpret=interpret)

        def mm(x, w):
            return nf4_matmul(x, w, **options)
    elif impl == "nf4_xla":
        mm = nf4_matmul_reference
    else:

        def mm(x, w):
            return x @ w.T

    forward = jax.jit(mm)
    fwd_dx = jax.jit(lambda x, w, g: jax.vjp(lambda x: mm(x, w), x)[1](g)[0])
    return forward, fwd_dx


def measure_point(m: int, o: int, i: int, args, deadline: float) -> dict:
    key_x, key_w, key_g = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key_x, (m, i), jnp.bfloat16)
    w = (0.02 * jax.random.normal(key_w, (o, i), jnp.float32)).astype(jnp.bfloat16)
    g = jax.random.normal(key_g, (m, o), jnp.bfloat16)
    qw = quantize(w)
    row = {
        "tokens": m,
        "out": o,
        "in": i,
        "weight_bytes": {"nf4": storage_bytes(o * i), "bf16": 2 * o * i},
        "flops_fwd": 2 * m * o * i,
    }
    timing = dict(calls=args.calls, samples=args.samples)
    # Block-size choice for the kernel: forward time per candidate, the fastest kept.
    tried = []
    for sizes in CANDIDATES:
        entry = dataclasses.asdict(sizes)
        if time.perf_counter() > deadline and tried:
            entry["skipped"] = "budget used up"
        else:
            try:
                forward, _ = jitted("nf4", sizes, args.interpret)
                entry["fwd_ms"] = 1e3 * seconds_per_call(forward, (x, qw), **timing)[0]
            except Exception as e:  # a candidate that does not compile is recorded
                entry["error"] = error_text(e)
        tried.append(entry)
    timed = [e for e in tried if "fwd_ms" in e]
    fields = [f.name for f in dataclasses.fields(BlockSizes)]
    best = (
        BlockSizes(**{k: min(timed, key=lambda e: e["fwd_ms"])[k] for k in fields})
        if timed
        else None
    )
    row["nf4_candidates"] = tried
    row["nf4_block_sizes"] = None if best is None else dataclasses.asdict(best)
    outs = {}
    for impl in IMPLS:
        weight = w if impl == "bf16" else qw
        if impl == "nf4" and best is None:
            row[impl] = {"error": "no block size compiled"}
            continue
        try:
            forward, fwd_dx = jitted(impl, best if impl == "nf4" else None, args.interpret)
            fwd_s, outs[impl] = seconds_per_call(forward, (x, weight), **timing)
            dx_s, _ = seconds_per_call(fwd_dx, (x, weight, g), **timing)
            row[impl] = {
                "fwd_ms": 1e3 * fwd_s,
                "fwd_dx_ms": 1e3 * dx_s,
                "fwd_tflops": row["flops_fwd"] / fwd_s / 1e12,
            }
        except Exception as e:
            row[impl] = {"error": error_text(e)}
    for impl in IMPLS:
        row[f"t_{impl}_fwd_ms"] = row[impl].get("fwd_ms")
        row[f"t_{impl}_fwd_dx_ms"] = row[impl].get("fwd_dx_ms")
    if row["t_nf4_fwd_ms"] and row["t_bf16_fwd_ms"]:
        row["ratio_bf16_over_nf4_fwd"] = row["t_bf16_fwd_ms"] / row["t_nf4_fwd_ms"]
        row["ratio_bf16_over_nf4_fwd_dx"] = row["t_bf16_fwd_dx_ms"] / row["t_nf4_fwd_dx_ms"]
    if "nf4" in outs and "nf4_xla" in outs:
        diff = jnp.abs(outs["nf4"].astype(jnp.float32) - outs["nf4_xla"].astype(jnp.float32))
        row["max_abs_diff_nf4_vs_nf4_xla"] = float(jnp.max(diff))
    return row


def print_row(row: dict) -> None:
    def cell(impl, key):
        value = row[impl].get(key)
        return f"{value:8.3f}" if value is not None else f"{'ERR':>8}"

    fwd = " ".join(cell(i, "fwd_ms") for i in IMPLS)
    dx = " ".join(cell(i, "fwd_dx_ms") for i in IMPLS)
    ratio = row.get("ratio_bf16_over_nf4_fwd", float("nan"))
    print(f"{row['tokens']:6d} {row['out']:5d}x{row['in']:<5d} | {fwd} | {dx} | {ratio:5.2f}")


def environment() -> dict:
    device = jax.devices()[0]
    return {
        "device": device.device_kind,
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "python": platform.python_version(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--require-gpu", action="store_true", help="exit 1 when there is no GPU")
    parser.add_argument(
        "--allow-cpu", action="store_true", help="run on CPU, kernel interpreted (script check)"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="rows of x")
    parser.add_argument(
        "--shapes", type=parse_shape, nargs="+", default=list(SHAPES), help="OUTxIN weights"
    )
    parser.add_argument("--budget-s", type=float, default=120.0, help="no new point after this")
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help=f"writes {FILENAME}")
    parser.add_argument("--calls", type=int, default=20, help="back-to-back calls per sample")
    parser.add_argument("--samples", type=int, default=5, help="samples; the best is kept")
    args = parser.parse_args(argv)

    status = no_gpu_exit("nf4_matmul_gpu", args.require_gpu, args.allow_cpu)
    if status is not None:
        return status
    args.interpret = jax.default_backend() != "gpu"

    started = time.perf_counter()
    deadline = started + args.budget_s
    path = args.results_dir / FILENAME
    result = {
        "status": "running",
        **environment(),
        "nf4_interpreted": args.interpret,
        "dtype": "bfloat16",
        "timing": f"best of {args.samples} samples of the mean of {args.calls} calls",
        "t_fields": "t_<impl>_fwd_ms: forward; t_<impl>_fwd_dx_ms: forward + dx; "
        "ratio_bf16_over_nf4_fwd = t_bf16_fwd_ms / t_nf4_fwd_ms (> 1: NF4 faster)",
        "budget_s": args.budget_s,
        "rows": [],
    }

    def save():
        result["elapsed_s"] = round(time.perf_counter() - started, 1)
        write_json(path, result)

    save()
    print(f"device {result['device']}, jax {result['jax']}, budget {args.budget_s:.0f}s")
    print("tokens   OUTxIN     | fwd ms: nf4  nf4_xla  bf16     | fwd+dx ms: same      | bf16/nf4")
    points = [(m, o, i) for m in args.tokens for o, i in args.shapes]
    try:
        for n, (m, o, i) in enumerate(points):
            if time.perf_counter() > deadline:
                result["skipped_points"] = [dict(tokens=m, out=o, inp=i) for m, o, i in points[n:]]
                result["status"] = "truncated_by_budget"
                break
            row = measure_point(m, o, i, args, deadline)
            result["rows"].append(row)
            print_row(row)
            save()
        else:
            result["status"] = "done"
    except BaseException as e:  # the script's timeout (SIGINT) too: keep the rows
        result["status"] = f"aborted: {error_text(e)}"
        result["traceback"] = traceback.format_exc()[-3000:]
        raise
    finally:
        save()
        print(f"wrote {path} ({time.perf_counter() - started:.0f}s, {result['status']})")
    failed = any("error" in row["nf4"] for row in result["rows"])
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
