"""Full fine-tuning of a trained or imported model, parameters frozen by name (`lmjax finetune
--full [--freeze 'token_embedding.*,blocks.0.*']`; docs/fine-tuning.md).

Every base parameter trains except those matching a `freeze` glob, matched by per-layer names
(`lmjax.params.layer_matches`: `blocks.0.*` is layer 0 of every stacked block leaf). The split
is `lmjax.train.finetuned.partition`: the trained leaves are the loop's state (their optimizer
state and checkpoints hold nothing else), the frozen leaves are the step's `frozen` argument, so
they get no gradient, no optimizer state, and come out bit-identical:

    loss(trained; frozen) = CE(forward(join(trained, frozen), x), y)      d/d trained only

A stacked leaf that the globs freeze in some layers only (`blocks.0.*` freezes one slice of
each block leaf) trains as a whole leaf: its frozen slices are taken from the frozen copy in
`join`, so they get an exactly zero gradient (the global norm is that of the trained slices)
and come out bit-identical, but they cost what a trained slice costs (its optimizer state, a
zero slice in the trained leaf) plus the frozen copy of the leaf.

`lmjax.finetune` reads the settings (`full_fields`, `check_full`, `check_freeze`) and hands the
loop `full_trainable(...)`.
"""

from __future__ import annotations

from lmjax import params as ptree
from lmjax.checks import require
from lmjax.errors import ConfigError
from lmjax.models import abstract_params
from lmjax.models.loss import Loss, loss_fn
from lmjax.train import loop
from lmjax.train.finetuned import FinetuneSpec, join
from lmjax.train.rundir import FINETUNE_FILE


def full_fields(section: dict, full: bool | None, freeze: str | None):
    """`(full, freeze globs)` from the section and the flags (`--freeze` is comma-separated)."""
    value = section.get("full", False)
    require(isinstance(value, bool), "finetune.full", value, "true or false", "fix it")
    globs = section.get("freeze") or []
    if isinstance(globs, str):
        globs = globs.split(",")
    if freeze is not None:
        globs = freeze.split(",")
    ok = isinstance(globs, list | tuple) and all(isinstance(g, str) for g in globs)
    require(ok, "finetune.freeze", globs, "a list of name globs", "e.g. ['blocks.0.*']")
    globs = tuple(g.strip() for g in globs if g.strip())
    use_full = value if full is None else full
    fix = "add --full (freezing is for full fine-tuning; LoRA freezes the whole base)"
    require(use_full or not globs, "--freeze", ",".join(globs), "used with --full", fix)
    return use_full, globs


def check_full(qlora: bool, lora_section: dict, lora_text: str | None) -> None:
    fix = "drop --qlora / --lora and the lora section, or drop --full"
    require(not qlora, "--full with qlora", qlora, "qlora false (NF4 weights can't train)", fix)
    given = lora_text if lora_text is not None else (lora_section or None)
    expected = "no LoRA settings (a full fine-tune trains the base itself)"
    require(given is None, "--full with LoRA settings", given, expected, fix)


def check_freeze(model, globs: tuple[str, ...]) -> None:
    """Each glob must name a parameter of the base, by its per-layer name, and something must be
    left to train."""
    flat = ptree.flatten(abstract_params(model))  # traced: nothing allocated
    for glob in globs:
        if not any(any(_layers(name, leaf, glob)) for name, leaf in flat.items()):
            raise ConfigError.describe(
                "finetune.freeze glob",
                glob,
                f"a glob matching at least one parameter name (e.g. {_example(flat)!r})",
                "check the spelling against `lmjax inspect`'s parameter names",
            )
    if globs and all(all(_layers(name, leaf, globs)) for name, leaf in flat.items()):
        raise ConfigError.describe(
            "finetune.freeze",
            ",".join(globs),
            "globs leaving at least one parameter to train",
            "freeze fewer parameters",
        )


def _layers(name: str, leaf, globs) -> tuple[bool, ...]:
    chosen = ptree.layer_matches(name, leaf, globs)
    return chosen if isinstance(chosen, tuple) else (chosen,)


def _example(flat) -> str:
    """A per-layer name to show: `blocks.0.…` rather than the stacked one."""
    for name, leaf in flat.items():
        if ptree.is_stacked(name):
            return ptree.layer_names(name, ptree.stacked_size(leaf))[0]
    return next(iter(flat), "<none>")


def full_objective(cfg, freeze=()) -> Loss:
    """The train-step objective of a full fine-tune: `loss(trained; frozen) =
    CE(forward(join(trained, frozen), x), y)`, differentiated with respect to `trained` only.
    `freeze`: the globs the two were split with (`join`: leaves frozen in some layers)."""

    def fn(trained, frozen, inputs_BT, targets_BT, key, **masks):  # masks: loss_fn's keywords
        return loss_fn(join(trained, frozen, freeze), inputs_BT, targets_BT, cfg, key, **masks)

    return Loss(fn, uses_key=cfg.dropout > 0.0)


def full_trainable(cfg, spec: FinetuneSpec, init, frozen: dict):
    """The loop's `Trainable` for a full fine-tune: `init(key)` the base's unfrozen leaves."""
    return loop.Trainable(
        init_params=init,
        loss=full_objective(cfg.model_config(), spec.freeze),
        frozen=frozen,
        model_params=lambda trained: join(trained, frozen, spec.freeze),
        meta={"finetune": spec.to_dict()},
        files={FINETUNE_FILE: spec.to_yaml()},
        # A checkpoint saved per layer held no leaves of a frozen layer: zeros, stacked.
        absent_layers=lambda name: ptree.matches(name, spec.freeze),
    )


__all__ = ["check_freeze", "check_full", "full_fields", "full_objective", "full_trainable"]
