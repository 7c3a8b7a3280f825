"""GPU timing: the Pallas NF4 matmul vs a bf16 matmul at the same shapes (issue 32, item 2).

For GPT-2 124M's and Llama-7B's projections (`[O, I]` = 768x768 attention, 3072x768 expand,
4096x4096 attention, 11008x4096 gate/up) at `--tokens` rows of x (16: decoding, where reading
the weight dominates and NF4 reads 4.13 bits a weight against bf16's 16; 4096: training), times,
in bfloat16:
  nf4        pallas_kernels.nf4_matmul (GPU kernel, compiled): decodes the 4-bit weight on chip
  nf4_xla    nf4_matmul_reference: XLA dequantizes the whole weight, then one matmul
  bf16       x @ W^T with the bf16 weight (what NF4 replaces)
the forward and the forward + input gradient (dx, the only gradient a frozen weight needs).
For the kernel it first times each `CANDIDATES` block size on the forward at that point and
keeps the fastest. It records each impl's time, the weight bytes it reads (NF4: 0.5 byte per
weight plus the scales; bf16: 2), the kernel's max |difference| from nf4_xla, and the kernel's
compile seconds at the chosen block size (the forward's first compile, during the block-size
choice, plus the forward + dx's).

Targets (`TARGETS`, issue 32, on an H200), recorded beside each ratio as "met", "not met" or
"not measured" (an error, a point the budget skipped, or the kernel interpreted on a CPU):
  bf16 time / nf4 time >= 2.5 at 16 rows and >= 0.8 at 4096 rows, forward and forward + dx;
  the kernel's compile under 5 s per shape.

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
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from benchmarks._gpu import environment, error_text, no_gpu_exit, seconds_per_call, write_json  # noqa: E402
from lmjax.quant import quantize, storage_bytes  # noqa: E402
from pallas_kernels.nf4_matmul import BlockSizes, nf4_matmul, nf4_matmul_reference  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FILENAME = "nf4_matmul_gpu.json"
SHAPES = ((768, 768), (3072, 768), (4096, 4096), (11008, 4096))  # GPT-2 124M, Llama-7B
TOKENS = (16, 4096)  # decoding first: its points are the cheap ones
# Issue 32's targets on an H200: the least bf16 time / nf4 time at a number of rows, and the
# most seconds the kernel may take to compile per shape.
TARGETS = {"ratio_bf16_over_nf4": {16: 2.5, 4096: 0.8}, "compile_s": 5.0}
CANDIDATES = (
    BlockSizes(64, 64, 128),  # the default
    BlockSizes(128, 128, 64, num_warps=8),
    BlockSizes(64, 128, 128, num_warps=4, num_stages=4),
    BlockSizes(16, 64, 256, num_warps=4),  # few rows (decoding): wide K steps
)
IMPLS = ("nf4", "nf4_xla", "bf16")
PARTS = ("fwd", "fwd_dx")  # the forward, and the forward + input gradient
MARKS = {"met": "ok", "not met": "LOW", "not measured": "--", "no target": "  "}


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


def matmul(impl: str, sizes: BlockSizes | None, interpret: bool):
    """`mm(x, w) = x W^T` of one impl (w a QuantizedWeight, or the bf16 weight for "bf16")."""
    if impl == "nf4":
        return functools.partial(nf4_matmul, block_sizes=sizes, backend="gpu", interpret=interpret)
    if impl == "nf4_xla":
        return nf4_matmul_reference
    return lambda x, w: x @ w.T


def with_dx(mm):
    """`(x, w, g) -> dx`: the forward and the input gradient `g W` (the weight gets none)."""
    return lambda x, w, g: jax.vjp(lambda x: mm(x, w), x)[1](g)[0]


def compile_timed(fn, args) -> tuple:
    """(the compiled `jax.jit(fn)` for `args`, seconds to lower and compile it)."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - start


def choose_blocks(x, qw, args, deadline: float) -> tuple[list, dict | None]:
    """Each `CANDIDATES` block size's forward compiled and timed (after the deadline, only the
    first): `(entries, best)`, best = {sizes, forward, compile_s} of the fastest, or None."""
    tried, best = [], None
    for sizes in CANDIDATES:
        entry = dataclasses.asdict(sizes)
        if time.perf_counter() > deadline and tried:
            entry["skipped"] = "budget used up"
        else:
            try:  # a candidate that does not compile is recorded
                forward, entry["compile_s"] = compile_timed(matmul("nf4", sizes, args.interpret),
                                                            (x, qw))  # fmt: skip
                seconds = seconds_per_call(forward, (x, qw), args.calls, args.samples)[0]
                entry["fwd_ms"] = 1e3 * seconds
                if best is None or seconds < best["seconds"]:
                    best = dict(sizes=sizes, forward=forward, compile_s=entry["compile_s"],
                                seconds=seconds)  # fmt: skip
            except Exception as e:
                entry["error"] = error_text(e)
        tried.append(entry)
    return tried, best


def time_impl(impl: str, x, weight, g, args, best: dict | None) -> tuple[dict, object]:
    """`(timings, forward output)` of one impl: fwd and fwd + dx milliseconds, compile seconds."""
    mm = matmul(impl, best["sizes"] if impl == "nf4" else None, args.interpret)
    if impl == "nf4":  # its forward was compiled while its block size was chosen
        forward, fwd_compile_s = best["forward"], best["compile_s"]
    else:
        forward, fwd_compile_s = compile_timed(mm, (x, weight))
    fwd_dx, dx_compile_s = compile_timed(with_dx(mm), (x, weight, g))
    fwd_s, out = seconds_per_call(forward, (x, weight), args.calls, args.samples)
    dx_s, _ = seconds_per_call(fwd_dx, (x, weight, g), args.calls, args.samples)
    timings = {"fwd_ms": 1e3 * fwd_s, "fwd_dx_ms": 1e3 * dx_s,
               "compile_s": {"fwd": fwd_compile_s, "fwd_dx": dx_compile_s}}  # fmt: skip
    return timings, out


def verdict(value: float | None, target: float | None, at_least: bool, interpreted: bool) -> str:
    """ "met" / "not met" / "not measured" (no value, or an interpreted kernel) / "no target"."""
    if target is None:
        return "no target"
    if value is None or interpreted:
        return "not measured"
    return "met" if (value >= target if at_least else value <= target) else "not met"


def targets(row: dict, interpreted: bool) -> dict:
    """Issue 32's targets beside the point's ratios and compile time, each with its verdict."""
    least = TARGETS["ratio_bf16_over_nf4"].get(row["tokens"])
    out = {}
    for part in PARTS:
        ratio = row.get(f"ratio_bf16_over_nf4_{part}")
        judged = verdict(ratio, least, True, interpreted)
        out[f"ratio_bf16_over_nf4_{part}"] = {"value": ratio, "at_least": least, "verdict": judged}
    seconds = list((row["nf4"].get("compile_s") or {}).values())
    total = sum(seconds) if seconds else None
    most = TARGETS["compile_s"]
    judged = verdict(total, most, False, interpreted)
    out["nf4_compile_s"] = {"value": total, "at_most": most, "verdict": judged}
    return out


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
    row["nf4_candidates"], best = choose_blocks(x, qw, args, deadline)
    row["nf4_block_sizes"] = None if best is None else dataclasses.asdict(best["sizes"])
    outs = {}
    for impl in IMPLS:
        if impl == "nf4" and best is None:
            row[impl] = {"error": "no block size compiled"}
            continue
        try:
            row[impl], outs[impl] = time_impl(impl, x, w if impl == "bf16" else qw, g, args, best)
            row[impl]["fwd_tflops"] = row["flops_fwd"] / row[impl]["fwd_ms"] / 1e9
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
    row["targets"] = targets(row, args.interpret)
    return row


def print_row(row: dict) -> None:
    def cell(impl, key):
        value = row[impl].get(key)
        return f"{value:8.3f}" if value is not None else f"{'ERR':>8}"

    fwd = " ".join(cell(i, "fwd_ms") for i in IMPLS)
    dx = " ".join(cell(i, "fwd_dx_ms") for i in IMPLS)
    ratios = " ".join(f"{row.get(f'ratio_bf16_over_nf4_{p}', float('nan')):5.2f}" for p in PARTS)
    marks = " ".join(MARKS[row["targets"][f"ratio_bf16_over_nf4_{p}"]["verdict"]] for p in PARTS)
    compile_s = row["targets"]["nf4_compile_s"]
    seconds = float("nan") if compile_s["value"] is None else compile_s["value"]
    print(
        f"{row['tokens']:6d} {row['out']:5d}x{row['in']:<5d} | {fwd} | {dx} | {ratios} {marks} "
        f"| {seconds:5.1f} {MARKS[compile_s['verdict']]}"
    )


def target_verdicts(rows: list[dict], points: list[tuple]) -> dict:
    """Every target of every point asked for, measured or not: `{verdict: count}` and the list."""
    measured = {(r["tokens"], r["out"], r["in"]): r["targets"] for r in rows}
    listed = []
    for m, o, i in points:
        found = measured.get((m, o, i))
        for name in (*(f"ratio_bf16_over_nf4_{p}" for p in PARTS), "nf4_compile_s"):
            verdict_ = "not measured" if found is None else found[name]["verdict"]
            listed.append({"tokens": m, "out": o, "in": i, "target": name, "verdict": verdict_})
    counts = {}
    for entry in listed:
        counts[entry["verdict"]] = counts.get(entry["verdict"], 0) + 1
    return {"counts": counts, "points": listed}


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
        "targets": {
            "ratio_bf16_over_nf4": "at least, by rows: " + str(TARGETS["ratio_bf16_over_nf4"]),
            "nf4_compile_s": f"at most {TARGETS['compile_s']} s a shape (fwd + fwd_dx)",
            "where": "an H200 (issue 32); verdicts on an interpreted kernel: not measured",
        },
        "rows": [],
    }
    points = [(m, o, i) for m in args.tokens for o, i in args.shapes]

    def save():
        result["target_verdicts"] = target_verdicts(result["rows"], points)
        result["elapsed_s"] = round(time.perf_counter() - started, 1)
        write_json(path, result)

    save()
    print(f"device {result['device']}, jax {result['jax']}, budget {args.budget_s:.0f}s")
    print("tokens   OUTxIN     | fwd ms: nf4  nf4_xla  bf16     | fwd+dx ms: same      | bf16/nf4 "
          "fwd, fwd+dx | compile s")  # fmt: skip
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
