"""Timing the jitted train step: compile time, tokens/s and MFU (`lmjax bench`, benchmarks/).

    tokens/s = B * T / median(step seconds)
    MFU      = flops_per_token(cfg, T) * tokens/s / peak FLOP/s

One function, `time_train_step`, times lmjax's own step for a model config; `lmjax bench CONFIG`
and `benchmarks/train_step.py --scaling` both call it. The batches are random ids (the speed of
a step does not depend on the text), the optimizer is the config's with a constant learning
rate, and every timed step is synchronised (`jax.block_until_ready`) on its own, so the median
ignores a slow outlier. The first step (tracing plus XLA compilation plus one run) is reported
separately as `compile_s`.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from lmjax.config import OptimizerConfig, RunConfig, ScheduleConfig
from lmjax.data.prepared import known_vocab_size
from lmjax.errors import ConfigError
from lmjax.models import ModelConfig
from lmjax.train import optim
from lmjax.train.metrics import flops_per_token, measured_peak_flops
from lmjax.train.step import init_state, make_train_step

# Dense bf16 tensor-core peaks (FLOP/s) by device-kind substring, from the vendors' data sheets
# (without sparsity). MFU on a GPU is quoted against these, not a measured matmul.
BF16_PEAK_FLOPS = {
    "H200": 989.4e12,
    "H100": 989.4e12,  # SXM; the PCIe card is lower (756e12): pass --peak-tflops for it
    "A100": 312e12,
}


def device_peak_flops(dtype: str) -> tuple[float, str]:
    """(peak FLOP/s, where it came from) for the default device and compute dtype."""
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", "") or ""
    if device.platform == "gpu" and dtype == "bfloat16":
        for name, peak in BF16_PEAK_FLOPS.items():
            if name in kind:
                return peak, f"{name} dense bf16 data-sheet peak"
    n = 2048 if device.platform == "cpu" else 8192
    return measured_peak_flops(dtype, n=n), f"best {n}^3 {dtype} jnp matmul on {kind or device}"


def random_batch(rng: np.random.Generator, vocab: int, accum: int, batch: int, seq: int) -> dict:
    """`{"inputs", "targets"}`: int32 `[A, B, T]` uniform ids."""
    shape = (accum, batch, seq)
    return {
        "inputs": jnp.asarray(rng.integers(0, vocab, shape, dtype=np.int32)),
        "targets": jnp.asarray(rng.integers(0, vocab, shape, dtype=np.int32)),
    }


def time_train_step(
    cfg: ModelConfig,
    *,
    batch_size: int,
    seq_len: int,
    steps: int = 10,
    grad_accum: int = 1,
    optimizer: OptimizerConfig | None = None,
    peak_flops: float | None = None,
    seed: int = 0,
    n_batches: int = 4,
    profile_dir: str | None = None,
    profile_steps: int = 3,
) -> dict:
    """Time `steps` train steps of `cfg` on `batch_size` sequences of `seq_len` tokens.

    `batch_size` sequences make one optimizer step, split into `grad_accum` micro-batches;
    `optimizer` defaults to `OptimizerConfig()` (AdamW), at a constant learning rate.
    Returns a JSON-able dict: compile_s, step_s (each timed step), median_step_s,
    tokens_per_step, tokens_per_s, flops_per_token, peak_flops (+ its source) and mfu.
    `profile_dir`: afterwards, `profile_steps` more steps under `jax.profiler.trace` (with a
    Perfetto trace) into that directory; they are not timed.
    """
    if steps < 1 or batch_size < 1 or seq_len < 1 or grad_accum < 1:
        raise ConfigError.describe(
            "(steps, batch_size, seq_len, grad_accum)",
            (steps, batch_size, seq_len, grad_accum),
            "all >= 1",
            "pass positive sizes",
        )
    if batch_size % grad_accum:
        raise ConfigError.describe(
            "batch_size",
            batch_size,
            f"a multiple of grad_accum = {grad_accum}",
            "make the batch split evenly into micro-batches",
        )
    if seq_len > cfg.context_length:
        raise ConfigError.describe(
            "seq_len",
            seq_len,
            f"<= context_length = {cfg.context_length}",
            "lower the sequence length or raise model.context_length",
        )
    optimizer = optimizer or OptimizerConfig()
    lr = optim.schedule(ScheduleConfig(warmup_steps=0, decay="constant"), optimizer.lr, 1)
    tx = optim.optimizer(optimizer, lr)
    rng = np.random.default_rng(seed)
    micro = batch_size // grad_accum
    batches = [
        random_batch(rng, cfg.vocab_ids, grad_accum, micro, seq_len) for _ in range(n_batches)
    ]
    state = init_state(jax.random.PRNGKey(seed), cfg, tx)
    train_step = make_train_step(cfg, tx, lr)

    start = time.perf_counter()
    state, metrics = train_step(state, batches[0])
    jax.block_until_ready((state, metrics))
    compile_s = time.perf_counter() - start
    step_s = []
    for i in range(steps):
        start = time.perf_counter()
        state, metrics = train_step(state, batches[(i + 1) % n_batches])
        jax.block_until_ready((state, metrics))
        step_s.append(time.perf_counter() - start)
    if profile_dir is not None:
        with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
            for i in range(profile_steps):
                state, metrics = train_step(state, batches[i % n_batches])
                jax.block_until_ready((state, metrics))

    if peak_flops is None:
        peak_flops, peak_source = device_peak_flops(jnp.dtype(cfg.compute_dtype).name)
    else:
        peak_source = "given"
    median = statistics.median(step_s)
    tokens = batch_size * seq_len
    fpt = flops_per_token(cfg, seq_len)
    return {
        "model": cfg.to_dict(),
        "batch_size": batch_size,
        "grad_accum": grad_accum,
        "seq_len": seq_len,
        "device": str(jax.devices()[0]),
        "device_kind": getattr(jax.devices()[0], "device_kind", None),
        "compile_s": compile_s,
        "step_s": step_s,
        "median_step_s": median,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / median,
        "flops_per_token": fpt,
        "peak_flops": peak_flops,
        "peak_flops_source": peak_source,
        "mfu": fpt * tokens / median / peak_flops,
        "final_loss": float(metrics["loss"]),
        "finite": bool(metrics["finite"]),
    }


def run_config_model(run: RunConfig, vocab_size: int | None = None) -> ModelConfig:
    """The run's model config; a vocabulary left to the data (null) needs `vocab_size`, or the
    size the tokenizer has without data (`data.known_vocab_size`: byte, gpt2, bpe): no data is
    read to time a step."""
    if run.vocab_from_data or vocab_size is not None:
        size = vocab_size if vocab_size is not None else known_vocab_size(run.data)
        if size is None:
            raise ConfigError.describe(
                "model.vocab_size",
                None,
                f"an int (data.tokenizer={run.data.tokenizer!r} decides it from the corpus)",
                "pass model.vocab_size=N to time the step without preparing the data",
            )
        run = run.with_vocab_size(size)
    return run.model_config()
