"""`lmjax gradcheck`, `lmjax bench` and `lmjax compile`: commands that measure rather than
train (gradients against references, a train step's speed, a TPU compile's memory)."""

from __future__ import annotations

import argparse
import fnmatch
import time

from lmjax.cli.args import add_config_command, add_mesh, add_output
from lmjax.cli.common import check_output_file, write_json
from lmjax.errors import LMJaxError

# ---- lmjax gradcheck -----------------------------------------------------------------------------


def add_gradcheck(sub) -> None:
    grad = sub.add_parser(
        "gradcheck",
        help="check every primitive's hand-written VJP against jax.grad and finite differences",
        description="Compare each op's custom VJP with jax.grad of its plain-jnp reference "
        "(float32) and with centered finite differences (float64). Exits 1 if any disagrees.",
    )
    grad.add_argument("--ops", default="*", help="glob over op-case names (default: all)")
    grad.add_argument("--seed", type=int, default=0, help="PRNG seed for the inputs")
    grad.set_defaults(run=run_gradcheck)


def run_gradcheck(args: argparse.Namespace) -> int:
    import jax

    from lmjax import testing

    cases = [c for c in testing.OP_CASES if fnmatch.fnmatchcase(c.name, args.ops)]
    if not cases:
        names = ", ".join(c.name for c in testing.OP_CASES)
        raise LMJaxError(
            f"--ops = {args.ops!r} matches no op case; expected a glob over: "
            f"{names}. Fix: e.g. --ops 'attention*'."
        )
    header = f"{'op case':34} {'|value diff|':>12} {'|grad diff|':>12} {'FD rel err':>11}  ok"
    print("custom VJP vs jax.grad(reference) in float32, and vs finite differences in float64")
    print(header)
    print("-" * len(header))
    failures, start = 0, time.perf_counter()
    for case in cases:
        report = testing.compare_with_reference(case, args.seed, transform=jax.jit)
        fd = testing.finite_difference_error(case, args.seed)
        ok = report.ok and fd <= testing.FD_RTOL
        failures += not ok
        print(
            f"{case.name:34} {report.value_error:12.2e} {report.grad_error:12.2e} "
            f"{fd:11.2e}  {'yes' if ok else 'NO'}",
            flush=True,
        )
    print(
        f"{len(cases) - failures}/{len(cases)} op cases agree "
        f"(float32 rtol {testing.F32_RTOL:g}, finite-difference rtol {testing.FD_RTOL:g}) "
        f"in {time.perf_counter() - start:.1f}s"
    )
    return 1 if failures else 0


# ---- lmjax bench ---------------------------------------------------------------------------------


def add_bench(sub) -> None:
    bench = add_config_command(
        sub,
        "bench",
        help="time the train step of a run config (compile time, tokens/s, MFU)",
        description="Build CONFIG's model and optimizer (with section.field=value overrides, "
        "e.g. model.n_layers=2 train.batch_size=8), then time its jitted train step on random "
        "token ids: the first step (compile) separately, then --steps steps, each synchronised. "
        "Prints compile seconds, median step seconds, tokens/s and MFU (model FLOPs per token "
        "x tokens/s over the peak: a data-sheet bf16 peak on known GPUs, else a measured "
        "matmul). No data is read; a vocabulary left to the data needs model.vocab_size=N "
        "(GPT-2's tokenizer is known).",
        config_help="a YAML run config, e.g. configs/tiny-shakespeare.yaml",
    )
    bench.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    bench.add_argument(
        "--peak-tflops", type=float, default=None, help="peak TFLOP/s for MFU (default: see above)"
    )
    add_output(bench, "result")
    bench.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from lmjax.checks import require
    from lmjax.config import load_run_config
    from lmjax.train import bench

    require(args.steps >= 1, "--steps", args.steps, ">= 1", "time at least one step")
    peak_ok = args.peak_tflops is None or 0 < args.peak_tflops < float("inf")
    require(peak_ok, "--peak-tflops", args.peak_tflops, "> 0", "pass a peak")
    if args.output:  # checked before the minutes of timing, not after
        check_output_file(args.output)
    run = load_run_config(args.config, args.overrides)
    cfg = bench.run_config_model(run)
    peak = None if args.peak_tflops is None else args.peak_tflops * 1e12
    result = bench.time_train_step(
        cfg,
        batch_size=run.train.batch_size,
        grad_accum=run.train.grad_accum,
        seq_len=run.seq_len,
        steps=args.steps,
        optimizer=run.optimizer,
        peak_flops=peak,
        seed=run.train.seed,
    )
    result["config"] = str(args.config)
    result["overrides"] = list(args.overrides)
    print(
        f"{args.config}: {result['tokens_per_step']:,} tokens/step on {result['device']}: "
        f"compile {result['compile_s']:.1f} s, step {result['median_step_s'] * 1e3:.1f} ms "
        f"(median of {args.steps}), {result['tokens_per_s']:,.0f} tokens/s, "
        f"MFU {result['mfu']:.1%} of {result['peak_flops'] / 1e12:.3g} TFLOP/s "
        f"({result['peak_flops_source']})"
    )
    if args.output:
        write_json(args.output, result)
    return 0


# ---- lmjax compile -------------------------------------------------------------------------------


def _compile_config(path, overrides) -> tuple:
    """`(run config, fine-tune Trainable or None, its kind or None)`: a fine-tune config (one
    with a `finetune` section) is read as `lmjax finetune` reads it, its model the base's (only
    the base's config.yaml is read, no weights); any other as `lmjax train`'s."""
    from lmjax.config import load_run_config, read_yaml

    data = read_yaml(path)
    if isinstance(data, dict) and "finetune" in data:
        from lmjax import finetune

        cfg, spec, _ = finetune.load_config(path, overrides, weights=False)
        return cfg, finetune.abstract_trainable(cfg, spec), spec.kind
    return load_run_config(path, overrides), None, None


def add_compile(sub) -> None:
    comp = add_config_command(
        sub,
        "compile",
        help="compile a run or fine-tune config's sharded train step for a TPU topology "
        "(no TPU needed)",
        description="Build CONFIG's train step (with section.field=value overrides) sharded "
        "over a mesh of TOPOLOGY's devices, and compile it with the real TPU compiler (libtpu: "
        "pip install 'lmjax[tpu]'); nothing is allocated or run, so any machine will do. Prints "
        "the compiled step's per-device memory (arguments, outputs, temporaries, generated "
        "code) against the HBM a device may use, its FLOPs (XLA's cost analysis, every layer "
        "counted: a scanned model's one layer from a second compile, see --no-flops; and the "
        "6N model FLOPs) and the compile time. Exits 0 only "
        "if the step compiled and fits: check a config this way before creating a TPU VM. "
        "A fine-tune config (configs/finetune-*.yaml) compiles lmjax finetune's step: the "
        "base's model (its config.yaml alone is read), LoRA adapters or the unfrozen leaves "
        "trained, the frozen base (NF4 with finetune.qlora=true) sharded too.",
        config_help="a YAML run or fine-tune config, e.g. configs/tpu-gpt2-124m.yaml",
    )
    comp.add_argument(
        "--topology",
        required=True,
        metavar="NAME",
        help="a TPU slice as GENERATION:SHAPE: v2:2x2, v3:2x2, v4:2x2x1, v5e:2x2, v5e:4x4, "
        "v5p:2x2x1, v6e:2x2, ... (v4 and v5p in megacore mode: one device per chip)",
    )
    add_mesh(
        comp,
        "the device mesh (default: the config's parallel.mesh, else fsdp over every "
        "device); its product must be the topology's device count",
    )
    comp.add_argument(
        "--no-flops",
        action="store_true",
        help="skip XLA's FLOP count of a scanned model (model.scan_layers): XLA counts the "
        "layer loop's body once, so the count compiles the step a second time with more "
        "layers a trip (about as long again); without it no XLA FLOPs are printed",
    )
    add_output(comp, "report")
    comp.set_defaults(run=run_compile)


def run_compile(args: argparse.Namespace) -> int:
    import os

    import jax

    from lmjax.parallel.mesh import parse_mesh_text
    from lmjax.train import tpu_compile

    # jax itself stays on the CPU on a host without a TPU (jax's import set TPU_SKIP_MDS_QUERY):
    # probing for one with libtpu installed logs errors and is slow. The compile needs no backend.
    if "JAX_PLATFORMS" not in os.environ and os.environ.get("TPU_SKIP_MDS_QUERY"):
        jax.config.update("jax_platforms", "cpu")
    tpu_compile.parse_topology(args.topology)  # the cheap checks first, in the order of the line
    mesh = parse_mesh_text(args.mesh) if args.mesh else None
    if args.output:
        check_output_file(args.output)
    run, trainable, kind = _compile_config(args.config, args.overrides)
    report = tpu_compile.compile_train_step(
        run, args.topology, mesh, trainable, kind, count_layers=not args.no_flops
    )
    print(f"{args.config}: " + tpu_compile.format_report(report))
    if args.output:
        write_json(args.output, report.to_dict())
    tpu_compile.check_fits(report)
    return 0
