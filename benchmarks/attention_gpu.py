"""GPU timing: the Pallas flash kernel vs cuDNN and XLA attention, bf16, causal.

For T = 1k .. 16k and head dims 64 and 128 (B*T = 16384 tokens and H*D = 2048 per step, as
in the FlashAttention-2 paper's benchmarks), times the forward and the forward+backward of
  flash   pallas_kernels.flash_attention (GPU kernel, compiled)
  cudnn   jax.nn.dot_product_attention(implementation="cudnn")
  xla     jax.nn.dot_product_attention(implementation="xla") (skipped when its [B,H,T,T]
          scores would not fit comfortably)
and records flash's speed relative to cuDNN (ratio = t_cudnn / t_flash; the target is >= 0.8).
Before the sweep over T it times every flash block-size candidate (`CANDIDATES`) at T = 4096
for each head dim and keeps the fastest forward+backward for that head dim.

A time is the best, over `--samples` samples, of the mean of `--calls` back-to-back calls
(dispatch overlaps the previous kernel). The forward outputs of the timed calls (same inputs
for every impl) also give flash's max |difference| from cuDNN and XLA, so checking values
compiles nothing extra; jitted functions are cached per (impl, block sizes), so the search's
compile at T = 4096 is reused by the sweep.

    python benchmarks/attention_gpu.py [--require-gpu] [--results-dir DIR]
    # -> DIR/attention_gpu.json (default benchmarks/results), rewritten after every
    #    candidate and every point, so a run cut short keeps what it measured ("status")

Without a GPU it prints a note and exits 0 (1 with --require-gpu), so `make bench` stays green.
`--allow-cpu` instead runs the whole flow on CPU with the flash kernel interpreted (cuDNN then
fails and is recorded): only for checking this script, with tiny sizes, e.g.
    --allow-cpu --seq-lens 64 128 --head-dims 32 --tokens 256 --hidden 64 --search-t 128 \\
        --calls 1 --samples 1
Exit status: 0, or 2 when the flash kernel failed somewhere (recorded in the JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import platform
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from benchmarks import _gpu  # noqa: E402
from benchmarks._gpu import error_text, write_json  # noqa: E402
from pallas_kernels.flash_attention import BlockSizes, flash_attention  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FILENAME = "attention_gpu.json"
SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
TOKENS, HIDDEN = 16384, 2048
SEARCH_T = 4096
XLA_MAX_SCORES = 2**31  # B*H*T*T: the XLA path keeps several f32 [B,H,T,T] tensors (8 GiB each)
TARGET = 0.8
# The block-size search may use this share of --budget-s; the rest is for the sweep over T.
SEARCH_SHARE = 0.5
CANDIDATES = (
    BlockSizes(128, 64, 64, 64),  # the default
    BlockSizes(128, 128, 64, 128, num_warps=8),  # wide key blocks, forward and dk/dv
    BlockSizes(128, 128, 32, 128, num_warps=4),  # dk/dv over 128 keys in 32-row query steps
    BlockSizes(64, 64, 64, 32, num_warps=4),
)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every measurement shares (from the command line)."""

    tokens: int
    hidden: int
    interpret: bool  # only with --allow-cpu on a host without a GPU
    calls: int
    samples: int

    def shapes(self, t: int, d: int) -> tuple[int, int]:
        return max(1, self.tokens // t), max(1, self.hidden // d)

    def inputs(self, t: int, d: int, seed: int = 0):
        b, h = self.shapes(t, d)
        keys = jax.random.split(jax.random.PRNGKey(seed), 4)
        return [jax.random.normal(key, (b, t, h, d), jnp.bfloat16) for key in keys]


def attention_fn(impl: str, sizes: BlockSizes | None = None, interpret: bool = False):
    if impl == "flash":
        options = dict(block_sizes=sizes, backend="gpu", interpret=interpret)
        return lambda q, k, v: flash_attention(q, k, v, causal=True, **options)
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation=impl
    )


@functools.cache
def jitted(impl: str, sizes: BlockSizes | None, interpret: bool):
    """(forward, forward+backward), jitted once per (impl, block sizes): shapes seen before
    (the search's T = 4096) are not compiled again."""
    attend = attention_fn(impl, sizes, interpret)
    forward = jax.jit(attend)
    fwd_bwd = jax.jit(lambda q, k, v, g: jax.vjp(attend, q, k, v)[1](g))
    return forward, fwd_bwd


def seconds_per_call(fn, args, setup: Setup):
    """(best mean seconds per call, the last output), with the setup's calls and samples."""
    return _gpu.seconds_per_call(fn, args, setup.calls, setup.samples)


def causal_flops(t: int, d: int, setup: Setup) -> float:
    b, h = setup.shapes(t, d)
    return 4 * b * h * t * t * d / 2  # two matmuls of 2*T*S*D each, half of them causal


def time_impl(impl: str, t: int, d: int, args, setup: Setup, sizes=None):
    """(timings, forward output) of one impl on the point's inputs (q, k, v, g)."""
    forward, fwd_bwd = jitted(impl, sizes if impl == "flash" else None, setup.interpret)
    fwd_s, out = seconds_per_call(forward, args[:3], setup)
    fwd_bwd_s, _ = seconds_per_call(fwd_bwd, args, setup)
    flops = causal_flops(t, d, setup)
    timings = {
        "fwd_ms": 1e3 * fwd_s,
        "fwd_bwd_ms": 1e3 * fwd_bwd_s,
        "fwd_tflops": flops / fwd_s / 1e12,
        "fwd_bwd_tflops": 3.5 * flops / fwd_bwd_s / 1e12,  # backward = 2.5x forward
    }
    return timings, out


def search_block_sizes(result, head_dims, setup: Setup, search_t: int, deadline: float, save):
    """Times every candidate's forward+backward at T = search_t; returns {d: fastest}.

    Candidates go outer, head dims inner, so a search cut short by the deadline drops the same
    candidates for every head dim. A head dim with no candidate timed keeps the default.
    """
    search = result["block_size_search"]
    if not search_t:
        search["skipped"] = "--search-t 0: the default block sizes"
        return {d: CANDIDATES[0] for d in head_dims}
    search.update({str(d): {"T": search_t, "tried": [], "chosen": None} for d in head_dims})
    args = {d: setup.inputs(search_t, d) for d in head_dims}
    for sizes in CANDIDATES:
        for d in head_dims:
            entry = {**dataclasses.asdict(sizes)}
            if time.perf_counter() > deadline:
                entry["skipped"] = "search time used up"
            else:
                result["in_progress"] = f"block-size search d={d} {sizes}"
                save()
                try:
                    _, fwd_bwd = jitted("flash", sizes, setup.interpret)
                    entry["fwd_bwd_ms"] = 1e3 * seconds_per_call(fwd_bwd, args[d], setup)[0]
                except Exception as e:  # a candidate that does not compile is recorded
                    entry["error"] = error_text(e)
                    print(f"  d={d} block sizes {sizes} failed: {entry['error'][:200]}")
            search[str(d)]["tried"].append(entry)
    chosen = {}
    for d in head_dims:
        timed = [e for e in search[str(d)]["tried"] if "fwd_bwd_ms" in e]
        best = min(timed, key=lambda e: e["fwd_bwd_ms"]) if timed else None
        fields = {f.name for f in dataclasses.fields(BlockSizes)}
        chosen[d] = BlockSizes(**{k: best[k] for k in fields}) if best else CANDIDATES[0]
        search[str(d)]["chosen"] = dataclasses.asdict(chosen[d])
        if best is None:
            search[str(d)]["note"] = "no candidate timed: the default block sizes are used"
        line = ", ".join(
            f"{e['block_q']}x{e['block_k']}/{e['block_q_bwd']}x{e['block_k_bwd']}"
            f" w{e['num_warps']}: " + (f"{e['fwd_bwd_ms']:.3f}" if "fwd_bwd_ms" in e else "-")
            for e in search[str(d)]["tried"]
        )
        print(f"search d={d} T={search_t} fwd+bwd ms: {line}")
    return chosen


def max_abs_diff(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def measure_point(t: int, d: int, sizes: BlockSizes, setup: Setup) -> dict:
    b, h = setup.shapes(t, d)
    row = {"T": t, "d": d, "B": b, "H": h, "flash_block_sizes": dataclasses.asdict(sizes)}
    args = setup.inputs(t, d)
    outs = {}
    for impl in ("flash", "cudnn", "xla"):
        if impl == "xla" and b * h * t * t > XLA_MAX_SCORES:
            row[impl] = {"skipped": f"B*H*T*T = {b * h * t * t} > {XLA_MAX_SCORES}"}
            continue
        try:
            row[impl], outs[impl] = time_impl(impl, t, d, args, setup, sizes)
        except Exception as e:  # e.g. cuDNN missing: recorded and reported
            row[impl] = {"error": error_text(e)}
    for impl in ("flash", "cudnn", "xla"):
        row[f"t_{impl}_ms"] = row[impl].get("fwd_bwd_ms")  # None: skipped or failed
        row[f"t_{impl}_fwd_ms"] = row[impl].get("fwd_ms")
    if row["t_flash_ms"] and row["t_cudnn_ms"]:
        row["ratio_cudnn_over_flash"] = row["t_cudnn_ms"] / row["t_flash_ms"]
        row["ratio_cudnn_over_flash_fwd"] = row["t_cudnn_fwd_ms"] / row["t_flash_fwd_ms"]
        row["meets_target"] = row["ratio_cudnn_over_flash"] >= TARGET
    for other in ("cudnn", "xla"):
        if "flash" in outs and other in outs:
            row[f"max_abs_diff_vs_{other}"] = max_abs_diff(outs["flash"], outs[other])
    return row


def cell(result: dict, key: str) -> str:
    if key in result:
        return f"{result[key]:8.3f}"
    return f"{'skip' if 'skipped' in result else 'ERR':>8}"


def print_row(row: dict) -> None:
    times = " ".join(cell(row[i], "fwd_bwd_ms") for i in ("flash", "cudnn", "xla"))
    ratio = row.get("ratio_cudnn_over_flash", float("nan"))
    fwd = row.get("ratio_cudnn_over_flash_fwd", float("nan"))
    tflops = row["flash"].get("fwd_bwd_tflops", float("nan"))
    mark = {True: "ok", False: "LOW"}.get(row.get("meets_target"), "--")
    print(
        f"{row['T']:6d} {row['d']:4d} {row['B']:3d} {row['H']:3d} | {times} | "
        f"{fwd:5.2f} {ratio:5.2f} {mark:>3} | {tflops:6.1f}",
        flush=True,
    )


def environment() -> dict:
    device = jax.devices()[0]
    env = {
        "device": device.device_kind,
        "device_count": jax.device_count(),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "python": platform.python_version(),
    }
    for name in ("jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "jax-cuda12-pjrt"):
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    try:
        env["platform_version"] = device.client.platform_version
    except Exception:  # not every client reports one
        pass
    return env


def non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--require-gpu", action="store_true", help="exit 1 when there is no GPU")
    parser.add_argument(
        "--allow-cpu", action="store_true", help="run on CPU, flash interpreted (script check)"
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS))
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    parser.add_argument(
        "--budget-s", type=non_negative, default=240.0, help="stop starting new work after this"
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help=f"writes {FILENAME}")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="B*T per point")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="H*D per point")
    parser.add_argument(
        "--search-t", type=int, default=SEARCH_T, help="T of the block-size search (0: none)"
    )
    parser.add_argument("--calls", type=int, default=10, help="back-to-back calls per sample")
    parser.add_argument("--samples", type=int, default=5, help="samples; the best is kept")
    args = parser.parse_args(argv)

    status = _gpu.no_gpu_exit("attention_gpu", args.require_gpu, args.allow_cpu)
    if status is not None:
        return status
    backend = jax.default_backend()

    started = time.perf_counter()
    path = args.results_dir / FILENAME
    setup = Setup(args.tokens, args.hidden, backend != "gpu", args.calls, args.samples)
    result = {
        "status": "running",  # "done" or "truncated_by_budget" at the end; else cut short
        **environment(),
        "flash_interpreted": setup.interpret,
        "dtype": "bfloat16",
        "causal": True,
        "tokens_per_step": setup.tokens,
        "hidden": setup.hidden,
        "timing": f"best of {setup.samples} samples of the mean of {setup.calls} calls",
        "t_fields": "t_<impl>_ms: forward+backward ms (None: skipped or failed); "
        "t_<impl>_fwd_ms: forward; ratio_cudnn_over_flash = t_cudnn_ms / t_flash_ms",
        "target_ratio_cudnn_over_flash": TARGET,
        "budget_s": args.budget_s,
        "block_size_search": {},
        "rows": [],
    }

    def save():
        result["elapsed_s"] = round(time.perf_counter() - started, 1)
        write_json(path, result)  # atomic: a kill mid-write never leaves half a file

    save()
    print(
        f"device {result['device']}, jax {result['jax']}, budget {args.budget_s:.0f}s", flush=True
    )
    try:
        search_deadline = started + SEARCH_SHARE * args.budget_s
        chosen = search_block_sizes(
            result, args.head_dims, setup, args.search_t, search_deadline, save
        )
        save()
        print("                     | fwd+bwd ms                 | cudnn/flash     | flash")
        print("     T    d   B   H |    flash    cudnn      xla |   fwd   f+b >.8 |   TF/s")
        # T outer, d inner: if the time budget runs out, both head dims lose the same largest T.
        points = [(t, d) for t in sorted(args.seq_lens) for d in args.head_dims]
        for n, (t, d) in enumerate(points):
            if time.perf_counter() - started > args.budget_s:
                result["skipped_points"] = [{"T": t, "d": d} for t, d in points[n:]]
                result["status"] = "truncated_by_budget"
                break
            result["in_progress"] = f"T={t} d={d}"
            save()
            row = measure_point(t, d, chosen[d], setup)
            result["rows"].append(row)
            print_row(row)
            save()  # after every point, so a run cut short by a timeout keeps them
        else:
            result["status"] = "done"
    except BaseException as e:  # KeyboardInterrupt (the script's timeout) too: keep the rows
        result["status"] = f"aborted: {error_text(e)}"
        result["traceback"] = traceback.format_exc()[-3000:]
        raise
    finally:
        if result["status"] in ("done", "truncated_by_budget"):
            result.pop("in_progress", None)  # otherwise it names what was running
        summarize(result)
        save()
        print(f"wrote {path} ({time.perf_counter() - started:.0f}s, {result['status']})")
    flash_failed = any("error" in row["flash"] for row in result["rows"])
    return 2 if flash_failed else 0


def summarize(result: dict) -> None:
    ratios = [r["ratio_cudnn_over_flash"] for r in result["rows"] if "ratio_cudnn_over_flash" in r]
    result["points_measured"] = len(result["rows"])
    result["points_meeting_target"] = sum(bool(r.get("meets_target")) for r in result["rows"])
    if ratios:
        result["ratio_cudnn_over_flash_geomean"] = float(np.exp(np.mean(np.log(ratios))))
        result["ratio_cudnn_over_flash_min"] = float(min(ratios))
        result["meets_target_everywhere"] = bool(min(ratios) >= TARGET) and len(ratios) == len(
            result["rows"]
        )
        print(
            f"cuDNN/flash time ratio (fwd+bwd): geomean "
            f"{result['ratio_cudnn_over_flash_geomean']:.2f}, min {min(ratios):.2f}, "
            f"{result['points_meeting_target']}/{len(result['rows'])} points >= {TARGET}"
        )


if __name__ == "__main__":
    sys.exit(main())
