"""What a fine-tune tells the user about itself (issue 47 item 7), each in one line:

adapters_line    the adapters it trains and, for QLoRA, that the base is NF4 (at the start)
finished         a `--resume` with nothing left to do: said, and nothing touched
decoding_line    `generate` / `chat` decoding through NF4 projections (a QLoRA run's base)
"""

from __future__ import annotations

import jax

from lmjax import lora, parallel
from lmjax.models.summary import human_bytes
from lmjax.quant.params import weight_bytes
from lmjax.train.finetuned import FinetuneSpec, read_spec
from lmjax.train.metrics import MetricsLog
from lmjax.train.rundir import RunDir
from lmjax.train.trainer import RunResult


def _adapters(model, lcfg, init) -> str:
    """ "14 adapters (r 16, alpha 32), 12,345 trainable parameters" of `init(key)`'s tree."""
    shapes = jax.eval_shape(init, jax.random.PRNGKey(0))
    layers = len(lora.target_layers(model, lcfg))
    return (
        f"{layers} adapters (r {lcfg.r}, alpha {lcfg.alpha:g}), "
        f"{lora.count(shapes, lcfg):,} trainable parameters"
    )


def adapters_line(spec: FinetuneSpec, model, init, frozen) -> str:
    """The line a LoRA / QLoRA fine-tune starts with: what trains, and over what base. For
    QLoRA, how many of the base's weights are NF4 and their bytes (as stored, and unquantized)."""
    what = _adapters(model, spec.lora, init)
    if not spec.qlora:
        return f"LoRA: {what} over {spec.base}'s {model.params_dtype} weights"
    counts = weight_bytes(frozen)
    return (
        f"QLoRA: {what} over {spec.base} with its block projections in NF4 "
        f"({counts['quantized_params']:,} weights in {human_bytes(counts['quantized'])}; "
        f"{human_bytes(counts['quantized_as_float'])} unquantized)"
    )


def finished(run: RunDir, steps: int, full: bool) -> RunResult | None:
    """When resuming `run` to `steps` has nothing to do, say so on stdout and return the run as
    it stands (its step, last validation loss); nothing is read beyond that or written. That is
    when its newest checkpoint is at `steps` or past and its outputs are there (`merged/`, and
    the adapters unless `full`); a run stopped between its last checkpoint and those files
    (None here) resumes to write them."""
    step = run.latest_step()
    written = run.merged_dir.is_dir() and (full or run.adapters_file.is_file())
    if step is None or step < steps or not written:
        return None
    if parallel.is_main():
        print(
            f"nothing to do: {run.path} is at step {step} and train.steps = {steps}; nothing "
            f"was changed (to train on, resume with train.steps=N, N > {step})",
            flush=True,
        )
    losses = [r["val_loss"] for r in MetricsLog(run.metrics_file).read() if "val_loss" in r]
    return RunResult(run.path, step, losses[-1] if losses else None, None)


def decoding_line(run) -> str:
    """What `generate` / `chat` decode through when a run is loaded with NF4 projections: a
    QLoRA run's own NF4 base with its adapters attached, or another run's weights quantized."""
    where = RunDir(run.directory)
    spec = read_spec(where) if where.is_finetune() else None
    if spec is None or not spec.qlora:
        return f"decoding with {run.directory}'s block projections in NF4 (--quantize nf4)"
    return (
        f"decoding from {run.directory}'s NF4 base with its "
        f"{len(lora.target_layers(run.model, spec.lora))} adapters attached, as it trained "
        "(QLoRA; --quantize none decodes the merged float model)"
    )


__all__ = ["adapters_line", "decoding_line", "finished"]
