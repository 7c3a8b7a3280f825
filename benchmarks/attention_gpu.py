"""GPU timing: the Pallas flash kernel vs cuDNN and XLA attention, bf16, causal.

For T = 1k .. 16k and head dims 64 and 128 (B*T = 16384 tokens and H*D = 2048 per step, as
in the FlashAttention-2 paper's benchmarks), times the forward and the forward+backward of
  flash   pallas_kernels.flash_attention (GPU kernel, compiled)
  cudnn   jax.nn.dot_product_attention(implementation="cudnn")
  xla     jax.nn.dot_product_attention(implementation="xla") (skipped when its [B,H,T,T]
          scores would not fit comfortably)
and records flash's speed relative to cuDNN (ratio = t_cudnn / t_flash; the target is >= 0.8).
Before the sweep over T it searches the flash launch at T = 4096 for each head dim, starting
from the default table's entry for this GPU (pallas_kernels/flash_attention/defaults.py): the
forward (block_q x block_k x warps x stages, 24 candidates, timed forward only), then the
backward (the dk/dv tile block_q_bwd x block_k_bwd with the dq tile block_q_dq x block_k_dq,
x warps x stages, 36, timed forward+backward over the forward's winner), nearest the entry
first, within `--search-share` of `--budget-s` (a third
of it for the forward). The winners go to the JSON's "winners" in the table's entry form
(`defaults.entry_to_dict`, with the measurement: machine, jax, date, TFLOP/s, cuDNN ratio at
T = 4096), ready to replace the table's entries (docs/kernels.md); the sweep uses them.

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
from pallas_kernels.flash_attention import BlockSizes, defaults, flash_attention  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FILENAME = "attention_gpu.json"
SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
TOKENS, HIDDEN = 16384, 2048
SEARCH_T = 4096
XLA_MAX_SCORES = 2**31  # B*H*T*T: the XLA path keeps several f32 [B,H,T,T] tensors (8 GiB each)
TARGET = 0.8
# The block-size search may use this share of --budget-s (--search-share); the rest is for the
# sweep over T. Of the search's time the forward candidates get FWD_SHARE, the backward the rest.
SEARCH_SHARE = 0.5
FWD_SHARE = 1 / 3
SEARCH_CALLS, SEARCH_SAMPLES = 5, 3  # at most, per candidate (the sweep uses --calls/--samples)
# The search: forward (block_q x block_k, warps, stages) and backward (tiles, warps, stages)
# separately; candidates nearest the table's entry first (`ordered`), so a search cut short by
# its time has tried the small changes.
FWD_BLOCKS = ((128, 64), (128, 128), (64, 64), (64, 128))
# Backward tiles: (dk/dv queries, dk/dv keys, dq queries, dq keys). Today's 64 x 64 for both
# kernels, the FlashAttention-2 layout of Triton's tutorial 06 (dk/dv 32 x 128, dq 128 x 32)
# and its half-size and 64-wide variants, and two symmetric tiles of the former search.
BWD_BLOCKS = (
    (64, 64, 64, 64),
    (32, 128, 128, 32),
    (32, 64, 64, 32),
    (64, 128, 128, 64),
    (32, 128, 32, 128),
    (64, 128, 64, 128),
)
# Backward stages: 5 is the tutorial's; 1 (no prefetch of the next query step) left the set to
# keep it at 36.
WARPS, FWD_STAGES, BWD_STAGES = (4, 8), (2, 3, 4), (2, 3, 5)
FWD_FIELDS = ("block_q", "block_k", "num_warps", "num_stages")
BWD_FIELDS = (
    "block_q_bwd",
    "block_k_bwd",
    "block_q_dq",
    "block_k_dq",
    "num_warps_bwd",
    "num_stages_bwd",
)


def candidates(backward: bool) -> list[tuple[int, ...]]:
    """Every (tiles..., warps, stages) of one pass: 24 forward (block q, block k), 36 backward
    (the four of `BWD_BLOCKS`)."""
    blocks, stages = (BWD_BLOCKS, BWD_STAGES) if backward else (FWD_BLOCKS, FWD_STAGES)
    return [(*b, w, st) for b in blocks for w in WARPS for st in stages]


def knobs(candidate: tuple) -> tuple:
    """(tiles, warps, stages): the tiles of a pass change together, as one knob."""
    return candidate[:-2], candidate[-2], candidate[-1]


def ordered(pool, start: tuple) -> list[tuple]:
    """`pool` with `start` first, then by how many knobs (`knobs`) differ from it (stable): a
    change of tiles counts once, so the backward layouts are the first steps from any entry."""

    def changed(c):
        return sum(x != y for x, y in zip(knobs(c), knobs(start), strict=True))

    return [start] + [c for c in sorted(pool, key=changed) if c != start]


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


def search_block_sizes(result, head_dims, setup: Setup, search_t: int, deadlines, save, limit=None):
    """Searches the forward, then the backward candidates at T = search_t; returns {d: sizes}.

    Starts from the table's entry for this GPU and head size (`defaults.lookup`): the forward
    candidates (`FWD_FIELDS`) are timed forward only, the fastest kept; then the backward ones
    (`BWD_FIELDS`) forward+backward over that forward, the fastest kept. Candidates go outer,
    head dims inner, so a search cut short by its deadline (`deadlines`: forward, backward)
    drops the same candidates for every head dim; `limit` keeps the first `limit` of each pass.
    cuDNN is timed once per head dim first, for the winners' ratio. Writes
    result["block_size_search"] and result["winners"] (table entries, `defaults.entry_to_dict`)
    for the head dims whose backward pass timed a candidate.
    """
    search = result["block_size_search"]
    sizes = {d: defaults.lookup(result["device"], d).sizes for d in head_dims}
    # Every field spelled out (the dq tile resolved), so a start is a candidate's tuple.
    sizes = {d: dataclasses.replace(s, **s.blocks) for d, s in sizes.items()}
    if not search_t:
        search["skipped"] = "--search-t 0: the table's block sizes"
        return sizes
    quick = dataclasses.replace(
        setup, calls=min(setup.calls, SEARCH_CALLS), samples=min(setup.samples, SEARCH_SAMPLES)
    )
    args = {d: setup.inputs(search_t, d) for d in head_dims}
    for d in head_dims:
        search[str(d)] = {"T": search_t, "start": dataclasses.asdict(sizes[d])}
        if time.perf_counter() > deadlines[0]:
            continue
        try:
            timings, _ = time_impl("cudnn", search_t, d, args[d], quick)
            search[str(d)]["cudnn_fwd_bwd_ms"] = timings["fwd_bwd_ms"]
        except Exception as e:  # no cuDNN (e.g. the CPU dry run): no ratio in the winners
            search[str(d)]["cudnn_error"] = error_text(e)
    for phase, fields, deadline in zip(
        ("forward", "backward"), (FWD_FIELDS, BWD_FIELDS), deadlines, strict=True
    ):
        pool = candidates(backward=phase == "backward")
        todo = {
            d: ordered(pool, tuple(getattr(sizes[d], f) for f in fields))[:limit] for d in head_dims
        }
        for d in head_dims:
            search[str(d)][phase] = []
            search[str(d)][f"{phase}_skipped"] = 0
        for n in range(max(len(c) for c in todo.values())):
            for d in head_dims:
                if n >= len(todo[d]):
                    continue
                values = dict(zip(fields, todo[d][n], strict=True))
                if time.perf_counter() > deadline:
                    search[str(d)][f"{phase}_skipped"] += 1
                    continue
                trial = dataclasses.replace(sizes[d], **values)
                result["in_progress"] = f"block-size search d={d} {phase} {values}"
                save()
                search[str(d)][phase].append(time_candidate(phase, trial, args[d], quick, values))
        for d in head_dims:
            key = "fwd_ms" if phase == "forward" else "fwd_bwd_ms"
            timed = [e for e in search[str(d)][phase] if key in e]
            if timed:
                best = min(timed, key=lambda e: e[key])
                sizes[d] = dataclasses.replace(sizes[d], **{f: best[f] for f in fields})
                search[str(d)][f"{phase}_best_ms"] = best[key]
            print(
                f"search d={d} T={search_t} {phase}: {len(timed)} timed, "
                f"{search[str(d)][f'{phase}_skipped']} skipped, best {timed and best}"
            )
    result["winners"], result["winners_missing"] = [], {}
    for d in head_dims:
        search[str(d)]["chosen"] = dataclasses.asdict(sizes[d])
        entry = winner(result, d, sizes[d], search[str(d)], setup)
        if entry is None:
            result["winners_missing"][str(d)] = "no backward candidate timed in the search time"
        else:
            result["winners"].append(defaults.entry_to_dict(entry))
    return sizes


def time_candidate(phase: str, sizes: BlockSizes, args, setup: Setup, values: dict) -> dict:
    """{fields..., fwd_ms or fwd_bwd_ms} of one candidate, or {fields..., error}."""
    entry = dict(values)
    try:
        forward, fwd_bwd = jitted("flash", sizes, setup.interpret)
        if phase == "forward":
            entry["fwd_ms"] = 1e3 * seconds_per_call(forward, args[:3], setup)[0]
        else:
            entry["fwd_bwd_ms"] = 1e3 * seconds_per_call(fwd_bwd, args, setup)[0]
    except Exception as e:  # a candidate that does not compile is recorded
        entry["error"] = error_text(e)
        print(f"  {phase} {values} failed: {entry['error'][:200]}")
    return entry


def winner(result, d: int, sizes: BlockSizes, search: dict, setup: Setup):
    """The table entry (`defaults.Entry`) the search chose for head dim d, measured at its T;
    None when no backward candidate was timed (the forward+backward is then unmeasured)."""
    ms = search.get("backward_best_ms")
    if ms is None:
        return None
    t = search["T"]
    cudnn = search.get("cudnn_fwd_bwd_ms")
    b, h = setup.shapes(t, d)
    note = (
        f"benchmarks/attention_gpu.py search at Dh={d}, B={b}, H={h}: "
        f"{len(search['forward'])} forward and {len(search['backward'])} backward candidates "
        f"tried, {search['forward_skipped'] + search['backward_skipped']} skipped for time"
    )
    if setup.interpret:
        note += "; flash interpreted on CPU: a check of the script, not a measurement"
    measured = defaults.Measurement(
        machine=result["device"],
        jax=result["jax"],
        date=time.strftime("%Y-%m-%d", time.gmtime()),
        t=t,
        # 4 significant digits, not 3 decimals: interpreted on a loaded CPU the rate is ~1e-4
        # TFLOP/s and rounded to 0.0 (the dry run's check then failed); on a GPU it is 100s.
        fwd_bwd_tflops=float(f"{3.5 * causal_flops(t, d, setup) / (ms / 1e3) / 1e12:.4g}"),
        cudnn_ratio=None if cudnn is None else round(cudnn / ms, 3),
        note=note,
    )
    gen, key = defaults.generation(result["device"]), defaults.head_key(d)
    return defaults.Entry(gen, key, sizes, measured)


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
    parser.add_argument(
        "--search-share",
        type=float,
        default=SEARCH_SHARE,
        help="share of --budget-s for the block-size search (the rest: the sweep over T)",
    )
    parser.add_argument(
        "--search-candidates",
        type=int,
        default=None,
        help="try only the first N candidates of each pass (default: all, 24 + 36)",
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
        "winners": [],  # table entries (pallas_kernels.flash_attention.defaults), see docs
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
        search_s = args.search_share * args.budget_s
        deadlines = (started + FWD_SHARE * search_s, started + search_s)
        chosen = search_block_sizes(
            result, args.head_dims, setup, args.search_t, deadlines, save, args.search_candidates
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
