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

The sides of each row run back to back (the TPU compiles each in a fresh process,
`_tpu_row.py`), so machine load hits them alike; run it on a quiet machine for absolute
seconds. `--baseline-tree DIR` adds a third side to each TPU row: the same config compiled by
an older checkout's lmjax (before the blocks were stacked: `git worktree add DIR caddb00`),
giving `ratios_over_baseline` that hold on a host of any speed. Targets (issue 44, 2-core
host, where caddb00 compiled 2 GPT-2 layers in 18.8 s, 12 in 45.4 and the 8B in 136.8): GPT-2
124M's TPU compile <= 25 s and the 8B's <= 40 s, the 12-layer compile <= 1.3x the 2-layer
one, and generated code per device <= 64 MB for both.

    JAX_PLATFORMS=cpu python benchmarks/compile_time.py                # both parts
    JAX_PLATFORMS=cpu python benchmarks/compile_time.py --part cpu --layers 1,2,4
    JAX_PLATFORMS=cpu python benchmarks/compile_time.py --quick        # tiny shapes, seconds
    JAX_PLATFORMS=cpu python benchmarks/compile_time.py --part tpu --baseline-tree /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
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


def tpu_row(config: str, topology: str, n_layers: int, scan: bool | None, tree: Path = ROOT):
    """One `lmjax compile` (`_tpu_row.py`) in a fresh process with `tree`'s lmjax, so every row
    pays the same first-compile costs; `scan` None for a baseline tree, which cannot scan."""
    overrides = [f"model.n_layers={n_layers}"]
    if scan is not None:
        overrides.append(f"model.scan_layers={str(scan).lower()}")
    env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, str(ROOT / "benchmarks" / "_tpu_row.py"), config, topology]
    out = subprocess.run(
        [*command, *overrides], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {config} at {n_layers} layers failed:\n{out.stderr[-2000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(row.pop("lmjax")).resolve() == tree.resolve(), (row, tree)  # the tree asked for
    return {
        "config": config,
        "topology": topology,
        "layers": n_layers,
        "scan_layers": scan,
        "tree": "this" if tree == ROOT else "baseline",
        **row,
    }


def _commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True)
    return out.stdout.decode().strip()


def _baseline_ratios(rows):
    """This tree's compile seconds over the baseline's, per (config, layers)."""
    base = {(r["config"], r["layers"]): r for r in rows if r["tree"] == "baseline"}
    out = []
    for r in rows:
        b = base.get((r["config"], r["layers"]))
        if r["tree"] == "this" and b:
            out.append(
                {
                    "config": r["config"],
                    "layers": r["layers"],
                    "scan_layers": r["scan_layers"],
                    "compile_ratio_over_baseline": round(r["compile_s"] / b["compile_s"], 3),
                    "code_ratio_over_baseline": round(
                        r["generated_code_bytes"] / max(b["generated_code_bytes"], 1), 3
                    ),
                }
            )
    return out


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
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="a checkout of lmjax from before the blocks were stacked (git worktree add DIR "
        "caddb00): its unrolled TPU compiles run beside this tree's, for ratios that do not "
        "depend on the host's speed",
    )
    parser.add_argument("--output", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    layers = [int(n) for n in args.layers.split(",")]
    result = {}
    if args.part != "both" and args.output.exists():  # one part replaces its own section only
        result = json.loads(args.output.read_text())
    result["machine"] = _harness.machine()
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
        result["cpu"]["argv"] = sys.argv[1:]
        result["cpu"]["ratios"] = _pairs(rows)
    if args.part in ("tpu", "both"):
        rows = []
        for cfg, topology, n in TPU_ROWS:
            sides = [(True, ROOT), (False, ROOT)]
            if args.baseline_tree:
                sides.insert(0, (None, args.baseline_tree))
            for scan, tree in sides:
                rows.append(tpu_row(cfg, topology, n, scan, tree))
                print(rows[-1], flush=True)
        result["tpu"] = {"rows": rows, "ratios": _pairs(rows), "argv": sys.argv[1:]}
        if args.baseline_tree:
            result["tpu"]["baseline_commit"] = _commit(args.baseline_tree)
            result["tpu"]["ratios_over_baseline"] = _baseline_ratios(rows)
    _harness.write_result(args.output, result)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
