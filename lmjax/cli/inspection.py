"""`lmjax inspect`: a preset's, a run directory's or a config's parameter table, counts and
memory estimate (per device on a mesh, and for LoRA / QLoRA fine-tuning), traced with nothing
allocated."""

from __future__ import annotations

import argparse

from lmjax.cli.args import add_mesh
from lmjax.errors import LMJaxError


def add_inspect(sub) -> None:
    from lmjax.models.config import PRESETS

    insp = sub.add_parser(
        "inspect",
        help="print a model's parameter table, total count and memory estimate",
        description="Print every parameter (name, shape, count) of a preset with optional "
        "key=value overrides, the total, and a memory estimate for the parameters, gradients, "
        "AdamW state and the activations the backward pass keeps (traced, nothing is "
        "allocated).",
    )
    insp.add_argument(
        "preset",
        help=f"a preset ({', '.join(PRESETS)}), a run directory (RUN, RUN/checkpoints/STEP: its "
        "model) or a run config CONFIG.yaml",
    )
    insp.add_argument(
        "overrides",
        nargs="*",
        help="model fields for a preset (n_layers=4 dtype=bfloat16), section.field for a "
        "config (model.n_layers=4)",
    )
    insp.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="batch for the activation estimate (default 1, or the config's micro-batch)",
    )
    insp.add_argument(
        "--seq-len", type=int, default=None, help="sequence length (default: context_length)"
    )
    add_mesh(
        insp,
        "also print the per-device memory on this device mesh (default: the config's "
        "parallel.mesh); nothing is allocated, so pick a mesh before renting hardware",
    )
    insp.add_argument(
        "--lora",
        nargs="?",
        const="",
        default=None,
        metavar="K=V,...",
        help="also print LoRA fine-tuning memory: trainable adapter, gradient, optimizer-state "
        "and frozen-weight bytes (optional fields as for finetune --lora, e.g. r=8,alpha=16)",
    )
    insp.add_argument(
        "--qlora",
        action="store_true",
        help="as --lora with the base's linear weights in NF4 (their stored bytes)",
    )
    insp.set_defaults(run=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    from lmjax import models
    from lmjax.config import parse_overrides

    for name, value in (("--batch-size", args.batch_size), ("--seq-len", args.seq_len)):
        if value is not None and value < 1:
            raise LMJaxError(f"{name} = {value}; expected an int >= 1. Fix: pass e.g. {name} 8.")
    if args.mesh:  # checked before anything is printed
        from lmjax.parallel import check_batch, parse_mesh_arg

        shape = parse_mesh_arg(args.mesh)
        if args.batch_size is not None:
            check_batch(args.batch_size, shape, where="--batch-size")
    lcfg = _inspect_lora_config(args)  # checked before anything is printed
    if args.preset.endswith((".yaml", ".yml")):
        return _inspect_config(args)
    spec = _adapter_run(args.preset)
    if spec is not None:  # a LoRA / QLoRA run: its own adapters, not full training
        return _inspect_adapter_run(args, spec)
    cfg = _model_named(args.preset, parse_overrides(args.overrides))
    if args.seq_len is not None and args.seq_len > cfg.context_length:
        raise LMJaxError(
            f"--seq-len = {args.seq_len}; expected <= context_length = {cfg.context_length}. "
            "Fix: lower --seq-len or override context_length."
        )
    _check_lora_targets(cfg, lcfg)
    print(f"{args.preset}: " + ", ".join(f"{k}={v}" for k, v in cfg.to_dict().items()))
    print(models.format_summary(cfg, args.batch_size or 1, args.seq_len))
    if args.mesh:
        _print_mesh_memory(args.mesh, cfg, None, args.batch_size, args.seq_len, "AdamW state")
    if lcfg is not None:
        import optax

        _print_lora_memory(cfg, lcfg, args.qlora, optax.adamw(1e-3), "adamw")
    return 0


def _model_named(name: str, overrides: dict):
    """The model of a preset, or of a run directory (`RUN` or `RUN/checkpoints/STEP`, as
    `lmjax train`, `finetune` or `import-hf` wrote it: its config.yaml), with model-field
    `overrides`; anything else is one error line naming the three."""
    from pathlib import Path

    from lmjax import models
    from lmjax.errors import ConfigError
    from lmjax.models.config import PRESETS
    from lmjax.train.rundir import RunDir

    if name in PRESETS:
        return models.preset(name, **overrides)
    if Path(name).is_dir():
        run, _ = RunDir.parse(name)
        return run.read_config().model_config().replace(**overrides)
    raise ConfigError.describe(
        "model preset",
        name,
        f"one of ({', '.join(PRESETS)}), a run directory (with config.yaml) or a CONFIG.yaml",
        "pick a listed preset, or check the path (no such directory)",
    )


def _inspect_lora_config(args: argparse.Namespace):
    """`--lora [r=8,...]` / `--qlora`: the LoRA config to report (None: neither flag)."""
    if args.lora is None and not args.qlora:
        return None
    from lmjax.lora import LoraConfig

    return LoraConfig.parse(args.lora or "")


def _check_lora_targets(model, lcfg) -> None:
    """--lora's targets and rank against the model, before anything is printed."""
    if lcfg is not None:
        from lmjax.lora import target_layers

        target_layers(model, lcfg)


def _print_lora_memory(model, lcfg, qlora: bool, tx, optimizer: str) -> None:
    from lmjax import finetune

    print()
    print(finetune.format_memory(finetune.memory(model, lcfg, qlora, tx), lcfg, qlora, optimizer))


def _print_mesh_memory(mesh_text, model, opt_state, batch, seq_len, label) -> None:
    """`inspect --mesh`: per-device bytes (default batch: one sequence per data x fsdp device)."""
    import jax
    import optax

    from lmjax import models
    from lmjax.parallel import memory, parse_mesh_arg

    shape = parse_mesh_arg(mesh_text)
    if opt_state is None:  # a preset: AdamW, as the summary above assumes
        opt_state = jax.eval_shape(optax.adamw(1e-3).init, models.abstract_params(model))
    batch = batch or shape["data"] * shape["fsdp"]
    seq_len = seq_len or model.context_length
    print()
    print(memory.format_device_memory(model, opt_state, batch, seq_len, shape, label))


def _inspect_config(args: argparse.Namespace) -> int:
    """`lmjax inspect CONFIG.yaml [section.key=value ...]`: the run's model and optimizer."""
    import jax

    from lmjax import models, train
    from lmjax.config import load_run_config

    if _is_finetune_config(args.preset):
        return _inspect_finetune_config(args)
    cfg = load_run_config(args.preset, args.overrides)
    batch = args.batch_size or cfg.train.batch_size // cfg.train.grad_accum
    seq_len = args.seq_len or cfg.seq_len
    mesh = args.mesh or (
        ",".join(f"{k}={v}" for k, v in cfg.parallel.mesh.items()) if cfg.parallel.mesh else None
    )
    if mesh:  # refused before anything is printed, and before the corpus is fetched for a vocab
        from lmjax.parallel import check_batch, parse_mesh_arg

        check_batch(batch, parse_mesh_arg(mesh), where="batch (sequences per micro-batch)")
    lcfg = _inspect_lora_config(args)
    if cfg.vocab_from_data:  # the tokenizer decides it; only a char vocabulary needs the data
        from lmjax.data.prepared import known_vocab_size

        known = known_vocab_size(cfg.data)
        cfg = (
            cfg.with_vocab_size(known)
            if known
            else train.loop.resolve(cfg, train.prepare_data(cfg, progress=False))
        )
    model = cfg.model_config()
    tx, _ = train.optim.from_config(cfg)
    state = jax.eval_shape(tx.init, models.abstract_params(model))
    nbytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state))
    _check_lora_targets(model, lcfg)
    print(f"{args.preset}: " + ", ".join(f"{k}={v}" for k, v in model.to_dict().items()))
    label = f"{cfg.optimizer.name} state"
    print(models.format_summary(model, batch, seq_len, optimizer=(label, nbytes)))
    if mesh:
        _print_mesh_memory(mesh, model, state, batch, seq_len, label)
    if lcfg is not None:
        _print_lora_memory(model, lcfg, args.qlora, tx, cfg.optimizer.name)
    return 0


def _is_finetune_config(path: str) -> bool:
    from lmjax.config import read_yaml

    data = read_yaml(path)
    return isinstance(data, dict) and "finetune" in data


def _inspect_finetune_config(args: argparse.Namespace) -> int:
    """`lmjax inspect configs/finetune-*.yaml`: the base's model and the adapters' memory (the
    config's LoRA and optimizer; --lora fields and --qlora override it). Reads the base's config
    only, not its weights."""
    from lmjax import finetune, models, train
    from lmjax.checks import require

    qlora = True if args.qlora else None
    cfg, spec, _ = finetune.load_config(
        args.preset, args.overrides, args.lora, qlora, weights=False
    )
    model = cfg.model_config()
    context = model.context_length  # the base's: a fine-tune config can't raise it
    ok = args.seq_len is None or args.seq_len <= context
    require(ok, "--seq-len", args.seq_len, f"<= the base's context_length = {context}", "lower it")
    batch = args.batch_size or cfg.train.batch_size // cfg.train.grad_accum
    print(
        f"{args.preset} (base {spec.base}): "
        + ", ".join(f"{k}={v}" for k, v in model.to_dict().items())
    )
    print(models.format_summary(model, batch, args.seq_len or cfg.seq_len))
    if spec.lora is not None:  # a full fine-tune: the summary above is its estimate
        tx, _ = train.optim.from_config(cfg)
        _print_lora_memory(model, spec.lora, spec.qlora, tx, cfg.optimizer.name)
    return 0


def _adapter_run(path: str):
    """The `FinetuneSpec` of a LoRA / QLoRA fine-tune run directory at `path` (or one of its
    checkpoints); None for anything else (a preset, a trained run, a full fine-tune)."""
    from pathlib import Path

    from lmjax.train.finetuned import read_spec
    from lmjax.train.rundir import RunDir

    if not Path(path).is_dir():
        return None
    run = RunDir.parse(path)[0]
    spec = read_spec(run) if run.is_finetune() else None
    return spec if spec is not None and spec.lora is not None else None


def _inspect_adapter_run(args: argparse.Namespace, spec) -> int:
    """`lmjax inspect RUN` of a LoRA / QLoRA run: the base model's parameter table, then what
    the run trains, its own adapters with their gradients and optimizer state and the frozen
    base (float or NF4), not a full-training estimate. --lora fields and --qlora override the
    run's, as for a config."""
    from lmjax import models, train
    from lmjax.config import parse_overrides
    from lmjax.lora import LoraConfig
    from lmjax.train.rundir import RunDir

    cfg = RunDir.parse(args.preset)[0].read_config()
    model = cfg.model_config().replace(**parse_overrides(args.overrides))
    lcfg = LoraConfig.parse(args.lora, spec.lora) if args.lora else spec.lora
    _check_lora_targets(model, lcfg)
    fields = ", ".join(f"{k}={v}" for k, v in model.to_dict().items())
    print(f"{args.preset} ({spec.kind} fine-tune of {spec.base}): {fields}")
    table = models.format_summary(model, 1, args.seq_len).split("\n\nmemory estimate")[0]
    print(table)  # the parameters; the memory below is the fine-tune's, not full training's
    tx, _ = train.optim.from_config(cfg)
    _print_lora_memory(model, lcfg, spec.qlora or args.qlora, tx, cfg.optimizer.name)
    return 0
