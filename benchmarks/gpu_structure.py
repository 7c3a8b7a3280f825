"""The train step's GPU program, read on a CPU host: what a profile would otherwise be needed for.

    python benchmarks/gpu_structure.py [--config CONFIG] [key=value ...]
        -> benchmarks/results/gpu_structure.json

Builds the config's jitted train step (default configs/gpt2-124m.yaml: GPT-2 124M, bfloat16 over
float32 master weights, 4 micro-batches of 16 x 1024) on abstract arrays, so nothing the size of
the model is allocated, and reports:

- matmul FLOPs per step by operand dtypes, counted on the step's jaxpr (2 x output size x
  contracted size per `dot_general`, times the trip count of every `scan` around it);
- loops: each `scan`/`while` with its trip count and the matmul FLOPs inside one trip;
- the largest intermediates, and float32 conversions of large arrays;
- custom calls and optimization barriers in the program lowered for CUDA
  (`jax.jit(step).trace(...).lower(lowering_platforms=("cuda",))`): cuDNN's fused attention is
  `__cudnn$fmha...`, a Pallas Triton kernel `__gpu$xla.gpu.triton`.

jax's cuDNN attention asks for cuDNN when it traces; on a host without it, `--fake-cudnn`
answers as cuDNN 9.8 on compute capability 9.0 would (only the trace-time checks: nothing runs).
"""

from __future__ import annotations

import collections
import math
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))  # run from a checkout, no install

from benchmarks._harness import parser, write_result  # noqa: E402

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
BIG = 2**20  # elements: a float32 conversion of at least this many is reported


def _size(aval) -> int:
    return int(np.prod(aval.shape)) if hasattr(aval, "shape") else 0


def _dot_flops(eqn) -> int:
    """2 x (output elements) x (product of the contracted dims of the left operand)."""
    (contract_lhs, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    k = math.prod(lhs.shape[d] for d in contract_lhs)
    return 2 * _size(eqn.outvars[0].aval) * k


def _cuda_branch(eqn):
    """The branch of a `lax.platform_dependent` cond that a CUDA lowering keeps."""
    platforms = eqn.params["branches_platforms"]
    index = next(i for i, p in enumerate(platforms) if p is None or "cuda" in p)
    return eqn.params["branches"][index]


def _sub_jaxprs(eqn):
    """(jaxpr, trip count) of every jaxpr inside `eqn` (scan bodies run `length` times; the
    branches of a cond are each counted once, an upper bound for the one that runs, except a
    platform-dependent one: only its CUDA branch is lowered)."""
    if eqn.primitive.name == "cond" and eqn.params.get("branches_platforms"):
        return [(_cuda_branch(eqn).jaxpr, 1)]
    found = []
    for value in eqn.params.values():
        items = value if isinstance(value, tuple | list) else (value,)
        for item in items:
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                found.append(inner)
    trips = int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else 1
    return [(j, trips) for j in found]


def walk(jaxpr, report: dict, times: int = 1, loop: str | None = None) -> int:
    """Add `jaxpr`'s matmuls, loops, intermediates and conversions (run `times` times) to
    `report`; returns the matmul FLOPs of one run of `jaxpr`."""
    flops_here = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        for v in eqn.outvars:
            aval = v.aval
            if hasattr(aval, "dtype") and _size(aval) >= BIG:
                report["large"].append((_size(aval), str(aval.dtype), list(aval.shape), name))
        if name == "dot_general":
            f = _dot_flops(eqn)
            dtypes = "x".join(str(v.aval.dtype) for v in eqn.invars[:2])
            report["flops_by_dtype"][f"{dtypes}->{eqn.outvars[0].aval.dtype}"] += f * times
            flops_here += f
        elif name == "convert_element_type":
            src, dst = eqn.invars[0].aval, eqn.outvars[0].aval
            if str(dst.dtype) == "float32" and _size(dst) >= BIG and str(src.dtype) != "float32":
                report["f32_converts"][f"{src.dtype}{list(src.shape)}"] += times
        elif name in ("optimization_barrier", "pallas_call"):
            report["primitives"][name] += times
        if name == "pallas_call":  # a kernel: its body is the kernel's, not XLA's program
            continue
        for inner, trips in _sub_jaxprs(eqn):
            is_loop = name in ("scan", "while")
            label = f"{name}[{trips if name == 'scan' else '?'}]" if is_loop else loop
            inner_flops = walk(inner, report, times * trips, label)
            flops_here += inner_flops * trips
            if is_loop:
                report["loops"].append(
                    {"kind": name, "trips": trips if name == "scan" else None,
                     "runs": times, "matmul_gflops_per_trip": round(inner_flops / 1e9, 3),
                     "inside": loop}
                )  # fmt: skip
    return flops_here


CUSTOM_CALL = re.compile(r"call_target_name\s*=\s*\"([^\"]+)\"|stablehlo\.custom_call\s+@([\w$.]+)")


def lowered_facts(text: str) -> dict:
    """Custom call targets and optimization barriers in StableHLO text."""
    targets = collections.Counter(a or b for a, b in CUSTOM_CALL.findall(text))
    return {
        "custom_calls": dict(targets),
        "optimization_barriers": text.count("stablehlo.optimization_barrier"),
        "while_loops": len(re.findall(r"stablehlo\.while", text)),
    }


def abstract_step(cfg):
    """(the jitted step, abstract state, abstract batch) for a RunConfig, nothing allocated."""
    from lmjax.train import optim
    from lmjax.train.step import init_state, make_train_step

    model = cfg.model_config()
    tx, lr = optim.from_config(cfg)
    state = jax.eval_shape(lambda k: init_state(k, model, tx), jax.random.PRNGKey(0))
    a = cfg.train.grad_accum
    shape = (a, cfg.train.batch_size // a, cfg.train.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("inputs", "targets")}
    return make_train_step(model, tx, lr), state, batch


def audit(cfg) -> dict:
    """The report for a RunConfig (see the module docstring)."""
    from lmjax import compat

    step, state, batch = abstract_step(cfg)
    start = time.perf_counter()
    # Traced for a GPU: the kernels (and `auto` attention) follow the default device's platform,
    # which a string sets without a GPU here (pallas_kernels._backend.platform), but only while
    # tracing (jax 0.12 would look for a real GPU while lowering); for an abstract H100 where
    # this jax's Triton lowering asks for one (lmjax.compat.lowering_for).
    traced, lowered = compat.lowering_for(step, state, batch, platform="cuda", trace_device="gpu")
    text = lowered.as_text()
    report = {
        "flops_by_dtype": collections.Counter(),
        "f32_converts": collections.Counter(),
        "primitives": collections.Counter(),
        "loops": [],
        "large": [],
    }
    total = walk(traced.jaxpr.jaxpr, report)
    largest = sorted(set(map(tuple, (tuple(x[:2]) + (tuple(x[2]), x[3]) for x in report["large"]))))
    model = cfg.model_config()
    return {
        "model": {"d_model": model.d_model, "n_layers": model.n_layers, "dtype": model.dtype,
                  "attention": model.attention, "vocab_size": model.vocab_size},
        "batch": list(batch["inputs"].shape),
        "matmul_tflops_per_step": round(total / 1e12, 3),
        "matmul_tflops_by_operand_dtypes": {
            k: round(v / 1e12, 4) for k, v in report["flops_by_dtype"].most_common()
        },
        "loops": report["loops"],
        "largest_intermediates": [
            {"elements": n, "dtype": d, "shape": list(s), "op": op}
            for n, d, s, op in sorted(largest, reverse=True)[:12]
        ],
        "f32_converts_of_large_arrays": dict(report["f32_converts"]),
        "primitives": dict(report["primitives"]),
        "cuda_lowering": lowered_facts(text),
        "seconds": round(time.perf_counter() - start, 1),
    }  # fmt: skip


def fake_cudnn() -> None:
    """jax's cuDNN attention trace-time checks answered as cuDNN 9.8 on compute capability 9.0
    (the same stand-in as tests/_cudnn.py): for lowering on a host without a GPU."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    fa.check_cudnn_version = lambda *a, **k: 90800
    fa.check_compute_capability = lambda cc, *a, **k: float(cc) <= 9.0
    fa.is_cuda_compute_capability_equal = lambda cc, *a, **k: float(cc) == 9.0


def main(argv=None) -> int:
    from lmjax.config import load_run_config

    p = parser(__doc__)
    p.add_argument("--config", default=str(ROOT / "configs" / "gpt2-124m.yaml"))
    p.add_argument("overrides", nargs="*", help="section.field=value")
    p.add_argument("--attention", nargs="+", default=["cudnn", "flash"], help="one report for each")
    p.add_argument("--fake-cudnn", action="store_true", help="stand in for cuDNN (no GPU here)")
    p.add_argument("--out", default=str(RESULTS / "gpu_structure.json"))
    args = p.parse_args(argv)
    if args.fake_cudnn:
        fake_cudnn()
    # The vocabulary is the tokenizer's: give it, so no tokenizer is fetched for a shape.
    overrides = ["model.vocab_size=50257", *args.overrides]
    result = {"config": Path(args.config).name, "overrides": overrides, "jax": jax.__version__}
    for attention in args.attention:
        cfg = load_run_config(args.config, [*overrides, f"model.attention={attention}"])
        result[attention] = audit(cfg)
    write_result(Path(args.out), result, indent=1)
    for attention in args.attention:
        r = result[attention]
        print(f"{attention}: {r['matmul_tflops_per_step']} TFLOP of matmuls a step "
              f"{r['matmul_tflops_by_operand_dtypes']}; loops "
              f"{[(x['kind'], x['trips']) for x in r['loops']]}; custom calls "
              f"{r['cuda_lowering']['custom_calls']}; barriers "
              f"{r['cuda_lowering']['optimization_barriers']}")  # fmt: skip
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
