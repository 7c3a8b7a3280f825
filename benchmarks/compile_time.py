"""Compile time and program size against depth: scanned layers (`model.scan_layers`, the
default) against the same blocks unrolled (issue 44).

Two parts, one JSON (`benchmarks/results/compile_time.json`):

  cpu   GPT-2-124M-shaped train steps (configs/gpt2-124m.yaml: D 768, H 12, F 3072, V 50257,
        AdamW; batch `--batch` x `--seq`) at N = 1, 2, 4, 8, 12, 24 layers, scanned and
        unrolled: seconds to trace, lower and compile for this host's CPU (XLA:CPU; nothing
        runs), the StableHLO line count, and the compiled program's generated code bytes.
        Abstract arguments: nothing is allocated.
  tpu   `lmjax compile` (the real TPU compiler, libtpu; lmjax.train.tpu_compile) of
        configs/tpu-gpt2-124m.yaml on v5e:2x2 at 2 and 12 layers and of
        configs/tpu-llama3-8b.yaml on v5p:2x2x2, scanned and unrolled: compile seconds,
        per-device generated code and memory.

The two sides of each row run back to back in one process, so machine load hits both alike;
run it on a quiet machine for absolute seconds. Targets (issue 44, 2-core host): GPT-2 124M's
TPU compile <= 25 s and the 8B's <= 40 s, the 12-layer compile <= 1.3x the 2-layer one, and
generated code per device <= 64 MB for both.

    JAX_PLATFORMS=cpu python benchmarks/compile_time.py                # both parts
    JAX_PLATFORMS=cpu python benchmarks/compile_time.py --part cpu --layers 1,2,4
    JAX_PLATFORMS=cpu python benchmarks/compile_time.py --quick        # tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu is installed with lmjax[tpu]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

from lmjax.config import load_run_config  # noqa: E402
from lmjax.train import optim  # noqa: E402
from lmjax.train.bench import run_config_model  # noqa: E402
from lmjax.train.step import init_state, make_train_step  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "compile_time.json"
LAYERS = (1, 2, 4, 8, 12, 24)
TPU_ROWS = (
    ("configs/tpu-gpt2-124m.yaml", "v5e:2x2", 2),
    ("configs/tpu-gpt2-124m.yaml", "v5e:2x2", 12),
    ("configs/tpu-llama3-8b.yaml", "v5p:2x2x2", 32),
)


def cpu_row(config: str, n_layers: int, scan: bool, batch: int, seq: int, extra=()) -> dict:
    """Trace, lower and compile one train step for this host's CPU; abstract arguments."""
    overrides = [f"model.n_layers={n_layers}", f"model.scan_layers={str(scan).lower()}"]
    overrides += [f"train.batch_size={batch}", f"train.seq_len={seq}", "train.grad_accum=1", *extra]
    run = load_run_config(ROOT / config, overrides)
    model = run_config_model(run)
    tx, lr = optim.from_config(run)
    state = jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), model, tx))
    tokens = jax.ShapeDtypeStruct((1, batch, seq), jnp.int32)
    batch_ = {"inputs": tokens, "targets": tokens, "step": jax.ShapeDtypeStruct((), jnp.int32)}
    step = make_train_step(model, tx, lr)
    t0 = time.perf_counter()
    traced = step.trace(state, batch_)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    memory = compiled.memory_analysis()
    return {
        "layers": n_layers,
        "scan_layers": scan,
        "trace_s": round(t1 - t0, 3),
        "lower_s": round(t2 - t1, 3),
        "compile_s": round(t3 - t2, 3),
        "stablehlo_lines": lowered.as_text().count("\n"),
        "generated_code_bytes": int(memory.generated_code_size_in_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes),
    }


def tpu_row(config: str, topology: str, n_layers: int, scan: bool) -> dict:
    from lmjax.train import tpu_compile

    overrides = [f"model.n_layers={n_layers}", f"model.scan_layers={str(scan).lower()}"]
    run = load_run_config(ROOT / config, overrides)
    report = tpu_compile.compile_train_step(run, topology, count_layers=False)
    mem = report.memory
    return {
        "config": config,
        "topology": topology,
        "layers": n_layers,
        "scan_layers": scan,
        "compile_s": round(report.compile_s, 2),
        "generated_code_bytes": mem.generated_code,
        "device_total_bytes": mem.total,
        "fits": report.fits,
    }


def _pairs(rows):
    """Scanned over unrolled for each (config, layers): compile seconds and code bytes."""
    out = []
    by = {(r.get("config", "cpu"), r["layers"], r["scan_layers"]): r for r in rows}
    for (config, n, scan), r in by.items():
        other = by.get((config, n, False))
        if scan and other:
            out.append(
                {
                    "config": config,
                    "layers": n,
                    "compile_ratio_scanned_over_unrolled": round(
                        r["compile_s"] / other["compile_s"], 3
                    ),
                    "code_ratio_scanned_over_unrolled": round(
                        r["generated_code_bytes"] / max(other["generated_code_bytes"], 1), 3
                    ),
                }
            )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("cpu", "tpu", "both"), default="both")
    parser.add_argument("--layers", default=",".join(map(str, LAYERS)))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, CPU only")
    parser.add_argument("--output", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    layers = [int(n) for n in args.layers.split(",")]
    result = {"machine": _harness.machine(), "argv": sys.argv[1:]}
    config, extra = "configs/gpt2-124m.yaml", ()
    if args.quick:
        layers, args.part = [1, 2, 4], "cpu"
        extra = ("model.d_model=64", "model.n_heads=4", "model.d_ff=128", "model.vocab_size=256")
        args.batch, args.seq = 2, 64
    if args.part in ("cpu", "both"):
        rows = []
        for n in layers:
            for scan in (True, False):
                rows.append(cpu_row(config, n, scan, args.batch, args.seq, extra))
                print(rows[-1], flush=True)
        result["cpu"] = {"config": config, "batch": args.batch, "seq": args.seq, "rows": rows}
        result["cpu"]["ratios"] = _pairs(rows)
    if args.part in ("tpu", "both"):
        rows = []
        for cfg, topology, n in TPU_ROWS:
            for scan in (True, False):
                rows.append(tpu_row(cfg, topology, n, scan))
                print(rows[-1], flush=True)
        result["tpu"] = {"rows": rows, "ratios": _pairs(rows)}
    _harness.write_result(args.output, result)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
