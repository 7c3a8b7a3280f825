"""Memory and speed of full fine-tuning vs LoRA vs QLoRA (SPEC section 6).

1. Memory of `gpt2-124m` (the `gpt2` preset, float32 master weights, AdamW), traced with
   `jax.eval_shape` (nothing is allocated, nothing trains): trainable parameters, their gradients,
   the optimizer state, and the frozen weights (none for full fine-tuning; the float base for
   LoRA; NF4 linear weights plus the float embeddings, norms and head for QLoRA). Activations
   are the same in all three and are left out.
2. A small measured CPU run: a tiny GPT-2-style model on real English text (Python's own
   documentation topics, as bytes), a few AdamW steps of each method from the same random base,
   reporting the median seconds per step after the compiling step and the first and last loss.

    python benchmarks/qlora.py                # -> benchmarks/results/qlora.json
    python benchmarks/qlora.py --quick        # tiny shapes, 3 steps (what the test runs)

Timings on a shared machine are noisy; the memory figures are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pydoc_data.topics
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmjax import finetune, lora, models  # noqa: E402
from lmjax.train.step import init_state, make_train_step  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("full", "lora", "qlora")
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


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes and 3 steps (for tests)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per method")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    lcfg = lora.LoraConfig(r=8, alpha=16, targets="all-linear")
    big = models.preset("gpt2")
    if args.quick:
        tiny = models.preset("gpt2", vocab_size=256, context_length=16, d_model=64, n_heads=4,
                             n_layers=1, d_ff=128)  # fmt: skip
        steps, batch, seq_len = args.steps or 3, 2, 16
    else:
        tiny = models.preset("gpt2", vocab_size=256, context_length=128, d_model=256,
                             n_heads=8, n_layers=4, d_ff=1024)  # fmt: skip
        steps, batch, seq_len = args.steps or 30, 8, 128
    result = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "note": "timings on a shared machine are noisy; memory figures are exact",
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
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / ("qlora_quick.json" if args.quick else "qlora.json")
    path.write_text(json.dumps(result, indent=2) + "\n")
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
    return "\n".join(lines)


if __name__ == "__main__":
    main()
