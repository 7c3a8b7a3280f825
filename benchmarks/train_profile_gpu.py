"""The GPT-2 124M train step on a GPU: tokens/s per attention, and where a step's time goes.

    python benchmarks/train_profile_gpu.py [--config CONFIG] [key=value ...] --results-dir DIR

For each of `--attention` (default cudnn, flash, xla) the config's jitted train step is timed as
`lmjax bench` times it (`lmjax.train.bench.time_train_step`: random ids, the config's optimizer
at a constant rate, each step synchronised; compile separately). The first attention that runs
then takes `--profile-steps` more steps under `jax.profiler.trace`, and the Perfetto trace is
reduced to the kernels that took the device's time: per kernel name, total time, calls and share of
the device's busy time, the top `--top` of them. Writes DIR/gpu_profile.json (rewritten after
every attention, so a run stopped at its limit keeps what it measured) and prints the tables.
The first attention that runs is timed again right after with its blocks unrolled
(`model.scan_layers=false`; the other runs scan them, the default): compile and step time of
the scan against the loop on this GPU (issue 44; `--no-unrolled` skips it).

On a CPU (`--allow-cpu`, the dry run of scripts/gpu_check.sh) the kernels are XLA's host
threads' ops, so the script can be checked without a GPU; without a GPU and without
--allow-cpu it says so and exits 0 (1 under --require-gpu).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
from _gpu import error_text, no_gpu_exit, write_json

ROOT = Path(__file__).resolve().parents[1]


def kernel_table(trace_dir: Path, top: int) -> dict:
    """The Perfetto trace under `trace_dir` reduced to `top` kernels by device time.

    Device kernels are the complete ("X") events of processes named /device:...; a trace with
    none (a CPU) falls back to the events of the host's threads other than Python's."""
    path = next(Path(trace_dir).rglob("perfetto_trace.json.gz"))
    data = json.load(gzip.open(path))
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}  # fmt: skip
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}  # fmt: skip
    device = {pid for pid, name in names.items() if name.startswith("/device:")}
    source = "device" if device else "host threads (no device in the trace)"

    def counted(e) -> bool:
        if e.get("ph") != "X":
            return False
        if device:
            return e["pid"] in device
        return threads.get((e["pid"], e.get("tid")), "") != "python"

    total_us, calls = collections.Counter(), collections.Counter()
    for e in filter(counted, events):
        total_us[e["name"]] += float(e.get("dur", 0.0))
        calls[e["name"]] += 1
    busy = sum(total_us.values())
    rows = [
        {"kernel": name, "total_ms": round(us / 1e3, 3), "calls": calls[name],
         "share": round(us / busy, 4) if busy else None}
        for name, us in total_us.most_common(top)
    ]  # fmt: skip
    return {"source": source, "busy_ms": round(busy / 1e3, 3), "kernels": rows}


def main(argv=None) -> int:
    from lmjax.config import load_run_config
    from lmjax.train.bench import run_config_model, time_train_step

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "gpt2-124m.yaml"))
    p.add_argument("overrides", nargs="*", help="section.field=value")
    p.add_argument("--attention", nargs="+", default=["cudnn", "flash", "xla"])
    p.add_argument("--steps", type=int, default=5, help="timed steps per attention")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--top", type=int, default=15, help="kernels in the table")
    p.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--budget-s", type=float, default=1e9, help="no new attention after this")
    p.add_argument("--allow-cpu", action="store_true", help="run on a CPU (a dry run)")
    p.add_argument("--no-unrolled", action="store_true", help="skip the unrolled-blocks run")
    p.add_argument("--require-gpu", action="store_true", help="exit 1 without a GPU")
    args = p.parse_args(argv)
    code = no_gpu_exit("train_profile_gpu", args.require_gpu, args.allow_cpu)
    if code is not None:
        return code
    start = time.perf_counter()
    run = load_run_config(args.config, args.overrides)
    out = Path(args.results_dir) / "gpu_profile.json"
    result = {"config": Path(args.config).name, "overrides": args.overrides,
              "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
              "runs": [], "profile": None}  # fmt: skip
    plan = [(attention, True) for attention in args.attention]
    for position, (attention, scan) in enumerate(plan):
        if time.perf_counter() - start > args.budget_s:
            result["runs"].append({"attention": attention, "scan_layers": scan,
                                   "error": "skipped: budget spent"})  # fmt: skip
            continue
        model = run_config_model(run).replace(attention=attention, scan_layers=scan)
        # The first attention that runs is profiled.
        trace_dir = tempfile.mkdtemp(prefix="lmjax-profile-") if result["profile"] is None else None
        try:
            timed = time_train_step(
                model, batch_size=run.train.batch_size, seq_len=run.train.seq_len,
                steps=args.steps, grad_accum=run.train.grad_accum, optimizer=run.optimizer,
                profile_dir=trace_dir, profile_steps=args.profile_steps,
            )  # fmt: skip
        except Exception as e:  # one attention failing must not lose the others' figures
            result["runs"].append(
                {"attention": attention, "scan_layers": scan, "error": error_text(e)}
            )
            write_json(out, result)
            continue
        keep = ("compile_s", "median_step_s", "tokens_per_s", "mfu", "peak_flops_source")
        result["runs"].append(
            {"attention": attention, "scan_layers": scan, **{k: timed[k] for k in keep}}
        )
        if scan and not args.no_unrolled and not any(not s for _, s in plan):
            plan.insert(position + 1, (attention, False))  # the first that ran, unrolled next
        if trace_dir is not None:
            table = kernel_table(Path(trace_dir), args.top)
            result["profile"] = {"attention": attention, "steps": args.profile_steps, **table}
        write_json(out, result)
    write_json(out, result)
    _print(result)
    return 0 if any("error" not in r for r in result["runs"]) else 1


def _print(result: dict) -> None:
    print(f"train step, {result['config']} on {result['device_kind']} (jax {result['jax']}):")
    for r in result["runs"]:
        name = r["attention"] + ("" if r.get("scan_layers", True) else " unrolled")
        if "error" in r:
            print(f"  {name:>15}: {r['error']}")
        else:
            print(f"  {name:>15}: {r['tokens_per_s']:12,.0f} tokens/s, step "
                  f"{r['median_step_s'] * 1e3:8.1f} ms, MFU {r['mfu']:.1%}, compile "
                  f"{r['compile_s']:.1f} s")  # fmt: skip
    prof = result["profile"]
    if prof:
        print(f"top kernels over {prof['steps']} {prof['attention']} steps ({prof['source']}, "
              f"busy {prof['busy_ms']:.1f} ms):")  # fmt: skip
        for k in prof["kernels"]:
            print(f"  {k['share'] or 0:6.1%} {k['total_ms']:10.3f} ms {k['calls']:6d}x  "
                  f"{k['kernel'][:90]}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
