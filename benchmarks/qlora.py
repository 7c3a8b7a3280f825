"""Memory and speed of full fine-tuning vs LoRA vs QLoRA (docs/fine-tuning.md).

1. Memory of `gpt2-124m` (the `gpt2` preset, float32 master weights, AdamW), traced with
   `jax.eval_shape` (nothing is allocated, nothing trains): trainable parameters, their gradients,
   the optimizer state, and the frozen weights (none for full fine-tuning; the float base for
   LoRA; NF4 linear weights plus the float embeddings, norms and head for QLoRA). Activations
   are the same in all three and are left out.
2. A small measured CPU run: a tiny GPT-2-style model on real English text (Python's own
   documentation topics, as bytes), a few AdamW steps of each method from the same random base,
   reporting the median seconds per step after the compiling step and the first and last loss.
3. Measured peak memory of one train step of `gpt2-124m` on CPU, LoRA against QLoRA (and
   QLoRA through the dequantize-then-matmul reference, the fallback before
   `nf4_matmul_tiled`, which kept a float copy of every NF4 weight for the backward): each in
   a fresh process that builds its frozen base (QLoRA: quantizes it and frees the float one)
   and adapters, compiles the step, then resets the kernel's peak-RSS counter
   (`/proc/self/clear_refs`) and runs one step; the peak resident set (VmHWM) is then the
   step's, with the frozen base, the adapters and their AdamW state resident. Linux only.
   glibc's mmap threshold is pinned (MALLOC_MMAP_THRESHOLD_) so freed buffers go back to the
   system and a freed float base does not stay resident by accident.

    python benchmarks/qlora.py                # -> benchmarks/results/qlora.json
    python benchmarks/qlora.py --quick        # tiny shapes, 3 steps (what the test runs)

Timings on a shared machine are noisy; the traced memory figures are exact, the measured RSS
ones are what the kernel reports (they include the JAX runtime, the same in every process).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pydoc_data.topics
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _rss

from _rss import RSS_ENV, release_freed_memory, status_bytes  # noqa: E402

from benchmarks._harness import write_result  # noqa: E402
from lmjax import finetune, lora, models  # noqa: E402
from lmjax.train.step import init_state, make_train_step  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("full", "lora", "qlora")
RSS_METHODS = ("lora", "qlora", "qlora_dequantize")
TEXT = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))


def memory_table(model, lcfg: lora.LoraConfig) -> dict[str, dict[str, int]]:
    """Bytes per method: params (trainable), gradients, optimizer, frozen, total."""
    tx = optax.adamw(1e-4)
    params = models.abstract_params(model)
    nbytes = lambda tree: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))  # noqa: E731
    full = {
        "trainable_params": sum(a.size for a in jax.tree.leaves(params)),
        "params": nbytes(params),
        "gradients": nbytes(params),
        "optimizer": nbytes(jax.eval_shape(tx.init, params)),
        "frozen": 0,
    }
    full["total"] = full["params"] + full["gradients"] + full["optimizer"]
    table = {"full": full}
    for method in ("lora", "qlora"):
        mem = finetune.memory(model, lcfg, method == "qlora", tx)
        table[method] = {
            "trainable_params": mem["adapter_params"],
            **{k: mem[k] for k in ("params", "gradients", "optimizer", "frozen", "total")},
        }
        if method == "qlora":
            table[method]["nf4_weights"] = mem["nf4_weights"]
            table[method]["nf4_bytes"] = mem["frozen_nf4"]
    return table


def _batches(rng, data: np.ndarray, n: int, batch: int, seq_len: int):
    starts = rng.integers(0, len(data) - seq_len - 1, size=(n, batch))
    windows = np.stack([[data[s : s + seq_len + 1] for s in row] for row in starts])
    return windows[..., :-1].astype(np.int32), windows[..., 1:].astype(np.int32)


def measured_run(model, lcfg, steps: int, batch: int, seq_len: int, lr: float) -> dict:
    """Median s/step (after the compiling step) and losses of each method from one base."""
    from lmjax.quant.params import quantize_params

    data = np.frombuffer(TEXT.encode("utf-8"), np.uint8)
    inputs, targets = _batches(np.random.default_rng(0), data, steps, batch, seq_len)
    base = models.init(jax.random.PRNGKey(0), model)
    tx = optax.adam(lr)
    out = {}
    for method in METHODS:
        if method == "full":
            # A copy: the step donates its state, and the base serves the other methods too.
            copy = lambda k: jax.tree.map(jnp.copy, base)  # noqa: E731
            state = init_state(jax.random.PRNGKey(1), model, tx, copy)
            step, frozen = make_train_step(model, tx, lambda s: lr), None
        else:
            frozen = quantize_params(base) if method == "qlora" else base
            init = lambda k, frozen=frozen: lora.init(k, frozen, lcfg)  # noqa: E731
            state = init_state(jax.random.PRNGKey(1), model, tx, init)
            step = make_train_step(model, tx, lambda s: lr, loss=lora.objective(model, lcfg))
        times, losses = [], []
        for i in range(steps):
            b = {"inputs": jnp.asarray(inputs[i][None]), "targets": jnp.asarray(targets[i][None])}
            start = time.perf_counter()
            state, metrics = step(state, b, frozen)
            losses.append(float(metrics["loss"]))  # waits for the step
            times.append(time.perf_counter() - start)
        out[method] = {
            "first_step_s": times[0],
            "median_s_per_step": statistics.median(times[1:]) if steps > 1 else None,
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "losses": losses,
        }
    return out


# ---- 3. measured peak RSS of one step, each method in its own process ---------------------------


def rss_step(method: str, model, lcfg, batch: int, seq_len: int) -> dict:
    """In this (fresh) process: frozen base + adapters of `method`, the step compiled, then the
    peak RSS of one step (bytes): `rss_before_step` (all state resident), `peak_step` (VmHWM
    after the reset, so the step's own peak), `peak_process` (ru_maxrss: the whole run,
    the float base before quantization included)."""
    import resource

    from lmjax.quant.params import quantize_params
    from pallas_kernels import nf4_matmul as nm

    if method == "qlora_dequantize":  # the fallback before nf4_matmul_tiled, for comparison
        nm.quantized_linear = nm.nf4_matmul_reference
    base = models.init(jax.random.PRNGKey(0), model)
    frozen = base if method == "lora" else quantize_params(base)
    del base  # for QLoRA the float projections go; the shared embeddings and norms stay
    jax.block_until_ready(frozen)
    tx = optax.adamw(1e-4)
    init = lambda k: lora.init(k, frozen, lcfg)  # noqa: E731
    state = init_state(jax.random.PRNGKey(1), model, tx, init)
    step = make_train_step(model, tx, lambda s: 1e-4, loss=lora.objective(model, lcfg))
    data = np.frombuffer(TEXT.encode("utf-8"), np.uint8)
    inputs, targets = _batches(np.random.default_rng(0), data, 1, batch, seq_len)
    b = {"inputs": jnp.asarray(inputs[0][None]), "targets": jnp.asarray(targets[0][None])}
    compiled = step.lower(state, b, frozen).compile()
    release_freed_memory()
    before = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
    start = time.perf_counter()
    state, metrics = compiled(state, b, frozen)
    loss = float(metrics["loss"])  # waits for the step
    seconds = time.perf_counter() - start
    return {
        "rss_before_step": before,
        "peak_step": status_bytes("VmHWM"),
        "peak_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_s": seconds,
        "loss": loss,
    }


def _tiny(quick: bool):
    """The small GPT-2-style model of the measured run (--quick: a smaller one)."""
    if quick:
        return models.preset("gpt2", vocab_size=256, context_length=16, d_model=64, n_heads=4,
                             n_layers=1, d_ff=128)  # fmt: skip
    return models.preset("gpt2", vocab_size=256, context_length=128, d_model=256,
                         n_heads=8, n_layers=4, d_ff=1024)  # fmt: skip


def _rss_shapes(quick: bool):
    """(model, batch, seq_len) of the RSS measurement: gpt2-124m, or a tiny model for --quick."""
    if quick:
        return _tiny(True), 1, 16
    return models.preset("gpt2"), 1, 256


def measured_rss(quick: bool) -> dict:
    """`rss_step` of each of RSS_METHODS, each in a fresh process (this script, --rss-worker)."""
    out = {}
    for method in RSS_METHODS:
        argv = [sys.executable, __file__, "--rss-worker", method] + (["--quick"] * quick)
        env = dict(os.environ, **RSS_ENV)
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"--rss-worker {method} failed:\n{done.stderr[-3000:]}")
        out[method] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes and 3 steps (for tests)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per method")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    ap.add_argument("--rss-worker", choices=RSS_METHODS, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


LCFG = lora.LoraConfig(r=8, alpha=16, targets="all-linear")


def main(argv=None) -> dict:
    args = parse_args(argv)
    lcfg = LCFG
    if args.rss_worker:  # one measurement, in the fresh process measured_rss started
        rss_model, rss_batch, rss_seq = _rss_shapes(args.quick)
        print(json.dumps(rss_step(args.rss_worker, rss_model, lcfg, rss_batch, rss_seq)))
        return {}
    big = models.preset("gpt2")
    tiny = _tiny(args.quick)
    if args.quick:
        steps, batch, seq_len = args.steps or 3, 2, 16
    else:
        steps, batch, seq_len = args.steps or 30, 8, 128
    rss_model, rss_batch, rss_seq = _rss_shapes(args.quick)
    result = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "note": "timings on a shared machine are noisy; traced memory figures are exact, "
            "RSS figures are measured (rss.note)",
        },
        "lora": lcfg.to_dict(),
        "memory": {"model": "gpt2 (124M)", "optimizer": "adamw", "bytes": memory_table(big, lcfg)},
        "run": {
            "model": tiny.to_dict(),
            "n_params": models.param_count(tiny),
            "steps": steps,
            "batch": batch,
            "seq_len": seq_len,
            "optimizer": "adam, lr 3e-3",
            "data": "Python documentation topics (pydoc_data), UTF-8 bytes",
            "methods": measured_run(tiny, lcfg, steps, batch, seq_len, 3e-3),
        },
        "rss": {
            "model": "gpt2 (124M)" if not args.quick else tiny.to_dict(),
            "batch": rss_batch,
            "seq_len": rss_seq,
            "optimizer": "adamw",
            "env": RSS_ENV,
            "note": "bytes; one step after compiling, each method in a fresh process; "
            "peak_step is VmHWM after resetting it just before the step",
            "methods": measured_rss(args.quick),
        },
    }
    path = args.results_dir / ("qlora_quick.json" if args.quick else "qlora.json")
    write_result(path, result)
    print(format_table(result))
    print(f"wrote {path}")
    return {**result, "path": str(path)}


def format_table(result: dict) -> str:
    mib = lambda n: f"{n / 2**20:,.1f}"  # noqa: E731
    lines = [
        "| gpt2-124m, AdamW | trainable params | params MiB | grads MiB | optimizer MiB | "
        "frozen MiB | total MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for method, m in result["memory"]["bytes"].items():
        lines.append(
            f"| {method} | {m['trainable_params']:,} | {mib(m['params'])} | {mib(m['gradients'])} "
            f"| {mib(m['optimizer'])} | {mib(m['frozen'])} | {mib(m['total'])} |"
        )
    lines += [
        "",
        "| tiny model, CPU | median s/step | first loss | last loss |",
        "| --- | ---: | ---: | ---: |",
    ]
    for method, r in result["run"]["methods"].items():
        med = r["median_s_per_step"]
        lines.append(
            f"| {method} | {'-' if med is None else f'{med:.4f}'} | {r['loss_first']:.3f} | "
            f"{r['loss_last']:.3f} |"
        )
    rss = result["rss"]
    name = rss["model"] if isinstance(rss["model"], str) else "tiny model"
    lines += [
        "",
        f"| {name}, CPU, batch {rss['batch']} x {rss['seq_len']} | RSS before the step MiB | "
        "peak of the step MiB | step s |",
        "| --- | ---: | ---: | ---: |",
    ]
    for method, r in rss["methods"].items():
        lines.append(
            f"| {method} | {mib(r['rss_before_step'])} | {mib(r['peak_step'])} | "
            f"{r['step_s']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
