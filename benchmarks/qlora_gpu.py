"""A QLoRA train step on a GPU, timed, beside LoRA over bfloat16 weights (issue 32, item 3).

For a SmolLM2-135M-shaped and a Llama-3.2-1B-shaped model (the `smollm2-135m` and `llama-3.2-1b`
presets: random weights, bfloat16 params and compute, attention "auto"), one jitted train step
of adapters r 16, alpha 32 on every block projection (all-linear), AdamW, over a frozen base
that is either
  qlora   the block projections in NF4 (`quantize_params`), run by `models.project`'s NF4 path
          (the Pallas kernel on a GPU, the tiled path on a CPU)
  lora    the bfloat16 weights themselves
and records, per (model, method): compile seconds (lower + compile of the step), the median
step seconds over `--steps` timed steps after one warm-up, tokens/s (batch x seq_len / step),
the final loss, and device memory: `peak_bytes_in_use` of `device.memory_stats()` (None where
the platform keeps none, e.g. a CPU) and the compiled step's own `memory_analysis()` (argument,
output and temporary bytes).

Each (model, method) runs in a fresh subprocess of this script (`--worker`), so its peak is its
own; the base is built one leaf at a time on the device (N(0, 0.02) weights, norm scales 1) and
a QLoRA leaf is quantized as soon as it exists, so the float base is never whole in memory and
the peak is the step's. A worker not started before `--budget-s` is recorded as skipped, and a
running one is stopped at the budget (recorded as a timeout); the JSON is rewritten after every
worker.

    python benchmarks/qlora_gpu.py [--require-gpu] [--results-dir DIR] [--budget-s S]
    # -> DIR/qlora_gpu.json (default benchmarks/results)
    python benchmarks/qlora_gpu.py --allow-cpu --quick --results-dir /tmp/q   # script check

Without a GPU it prints a note and exits 0 (1 with --require-gpu); `--allow-cpu` runs it on
CPU (`--quick`: tiny shapes of the same two families). Exit status 0, or 2 when a worker failed
(a worker skipped or stopped by the budget is not a failure: the status says
"truncated_by_budget").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import jax  # noqa: E402

from benchmarks._gpu import environment, error_text, no_gpu_exit, write_json  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FILENAME = "qlora_gpu.json"
MODELS = ("smollm2-135m", "llama-3.2-1b")
METHODS = ("qlora", "lora")
# --quick: the same families at a few thousand parameters (in-features multiples of 64, so a GPU
# would take the kernel, as at full size).
QUICK = dict(vocab_size=256, context_length=64, d_model=64, n_heads=4, n_kv_heads=2, n_layers=1,
             d_ff=128, head_dim=None)  # fmt: skip
R, ALPHA, LR = 16, 32, 1e-4
MIN_WORKER_S = 20  # a worker is not started with less budget than this left


# ---- one worker: build, compile, time ------------------------------------------------------------


def model_config(name: str, quick: bool):
    from lmjax import models

    sizes = QUICK if quick else {}
    return models.preset(name, dtype="bfloat16", param_dtype="bfloat16", **sizes)


def frozen_base(cfg, method: str, seed: int = 0) -> dict:
    """The random base, leaf by leaf on the device; with "qlora" each block projection is
    quantized as soon as it is made (its float copy freed), so the float base is never whole."""
    import jax.numpy as jnp

    from lmjax import models
    from lmjax import params as ptree
    from lmjax.quant.params import is_linear_weight, quantize_leaf

    leaves = {}
    for i, (name, spec) in enumerate(ptree.flatten(models.abstract_params(cfg)).items()):
        if name.endswith(".scale"):  # norm scales
            leaves[name] = jnp.ones(spec.shape, spec.dtype)
            continue
        key = jax.random.fold_in(jax.random.key(seed), i)
        leaf = (0.02 * jax.random.normal(key, spec.shape, jnp.float32)).astype(spec.dtype)
        quantized = method == "qlora" and is_linear_weight(name, leaf)
        leaves[name] = jax.block_until_ready(quantize_leaf(name, leaf) if quantized else leaf)
    return ptree.unflatten(leaves)


def memory_analysis(compiled) -> dict | None:
    """The compiled step's own bytes (None where the backend gives no analysis)."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # not every backend implements it
        return None
    if m is None:
        return None
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
              "alias_size_in_bytes", "generated_code_size_in_bytes")  # fmt: skip
    return {f: int(getattr(m, f)) for f in fields if hasattr(m, f)}


def device_peak() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return None if not stats else int(stats.get("peak_bytes_in_use", 0)) or None


def worker(model: str, method: str, args) -> dict:
    """In a fresh process: the base, the adapters, the compiled step, the timed steps."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    from lmjax import lora, models
    from lmjax.quant.params import weight_bytes
    from lmjax.train.step import init_state, make_train_step

    cfg = model_config(model, args.quick)
    frozen = frozen_base(cfg, method)
    lcfg = lora.LoraConfig(r=R, alpha=ALPHA, targets="all-linear")
    tx = optax.adamw(LR, weight_decay=0.0)
    state = init_state(jax.random.PRNGKey(1), cfg, tx, lambda k: lora.init(k, frozen, lcfg))
    step = make_train_step(cfg, tx, lambda s: LR, loss=lora.objective(cfg, lcfg))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, args.batch, args.seq_len + 1))
    batch = {"inputs": jnp.asarray(ids[..., :-1]), "targets": jnp.asarray(ids[..., 1:])}
    start = time.perf_counter()
    compiled = step.lower(state, batch, frozen).compile()
    compile_s = time.perf_counter() - start
    times, loss = [], None
    for _ in range(1 + args.steps):  # the first is a warm-up
        start = time.perf_counter()
        state, metrics = compiled(state, batch, frozen)
        loss = float(metrics["loss"])  # waits for the step
        times.append(time.perf_counter() - start)
    median = statistics.median(times[1:])
    return {
        "compile_s": compile_s,
        "warmup_s": times[0],
        "step_s": times[1:],
        "median_step_s": median,
        "tokens_per_s": args.batch * args.seq_len / median,
        "loss": loss,
        "finite": bool(metrics["finite"]),
        "parameters": int(sum(s.size for s in jax.tree.leaves(models.abstract_params(cfg)))),
        "adapter_params": int(sum(a.size for a in jax.tree.leaves(state.params))),
        "frozen_bytes": weight_bytes(frozen),
        "peak_device_bytes": device_peak(),
        "compiled_memory": memory_analysis(compiled),
    }


# ---- the parent: one subprocess per (model, method), within the budget -----------------------


def run_worker(model: str, method: str, args, seconds: float) -> dict:
    """`worker` in a fresh subprocess, stopped after `seconds`; its JSON, or what went wrong."""
    sizes = ["--batch", str(args.batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    argv = [sys.executable, __file__, "--worker", f"{model}:{method}", *sizes]
    argv += ["--quick"] if args.quick else []
    argv += ["--allow-cpu"] if args.allow_cpu else []
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout: stopped at the budget, after {seconds:.0f} s"}
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-1500:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(runs: dict) -> dict:
    """Per model, QLoRA over LoRA: speed (tokens/s) and peak memory, where both ran."""
    out = {}
    for model, by_method in runs.items():
        q, lo = by_method.get("qlora", {}), by_method.get("lora", {})
        row = {}
        if q.get("tokens_per_s") and lo.get("tokens_per_s"):
            row["qlora_over_lora_tokens_per_s"] = q["tokens_per_s"] / lo["tokens_per_s"]
        if q.get("peak_device_bytes") and lo.get("peak_device_bytes"):
            row["qlora_over_lora_peak_bytes"] = q["peak_device_bytes"] / lo["peak_device_bytes"]
        out[model] = row
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--require-gpu", action="store_true", help="exit 1 when there is no GPU")
    ap.add_argument("--allow-cpu", action="store_true", help="run on CPU (a script check)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes of the same families")
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--batch", type=int, default=None, help="sequences a step (default 4; 2 quick)")
    ap.add_argument("--seq-len", type=int, default=None, help="default 1024 (32 with --quick)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 2 quick)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="the whole run's seconds")
    ap.add_argument("--results-dir", type=Path, default=RESULTS, help=f"writes {FILENAME}")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    defaults = (2, 32, 2) if args.quick else (4, 1024, 10)
    for field, default in zip(("batch", "seq_len", "steps"), defaults, strict=True):
        if getattr(args, field) is None:
            setattr(args, field, default)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:  # one (model, method), in the fresh process run_worker started
        model, method = args.worker.split(":")
        print(json.dumps(worker(model, method, args)))
        return 0
    status = no_gpu_exit("qlora_gpu", args.require_gpu, args.allow_cpu)
    if status is not None:
        return status
    started = time.perf_counter()
    path = args.results_dir / FILENAME
    result = {
        "status": "running",
        **environment(machine_cpus=os.cpu_count()),
        "benchmark": "QLoRA (NF4 base) vs LoRA (bf16 base) train step, all-linear adapters",
        "quick": args.quick,
        "lora": {"r": R, "alpha": ALPHA, "targets": "all-linear", "optimizer": f"adamw lr {LR}"},
        "dtype": "bfloat16 params and compute; adapters and AdamW state float32",
        "batch": args.batch,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "budget_s": args.budget_s,
        "runs": {m: {} for m in args.models},
    }

    def save():
        result["comparison"] = compare(result["runs"])
        result["elapsed_s"] = round(time.perf_counter() - started, 1)
        write_json(path, result)

    save()
    failed = False
    for model in args.models:
        for method in args.methods:
            left = args.budget_s - (time.perf_counter() - started)
            if left < min(MIN_WORKER_S, args.budget_s / 4):
                result["runs"][model][method] = {"skipped": f"budget used up ({left:.0f} s left)"}
                continue
            try:
                run = run_worker(model, method, args, left)
            except Exception as e:  # an unreadable worker output is recorded, the rest go on
                run = {"error": error_text(e)}
            # A worker the budget stopped is a truncated run (status), not a failure.
            failed |= "error" in run and not run["error"].startswith("timeout")
            result["runs"][model][method] = run
            print(f"{model} {method}: " + summary_line(run), flush=True)
            save()
    cut = [r for by in result["runs"].values() for r in by.values()]
    cut = [r for r in cut if "skipped" in r or str(r.get("error", "")).startswith("timeout")]
    result["status"] = "truncated_by_budget" if cut else "done"
    save()
    print(f"wrote {path} ({time.perf_counter() - started:.0f}s, {result['status']})")
    return 2 if failed else 0


def summary_line(run: dict) -> str:
    if "error" in run:
        cut = run["error"].startswith("timeout")
        return f"{'not finished' if cut else 'ERROR'}: {run['error'][:200]}"
    peak = run["peak_device_bytes"]
    memory = "n/a" if peak is None else f"{peak / 2**30:.2f} GiB"
    return (f"{run['tokens_per_s']:,.0f} tokens/s, step {1e3 * run['median_step_s']:.1f} ms, "
            f"compile {run['compile_s']:.1f} s, peak {memory}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
