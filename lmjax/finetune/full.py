"""Full fine-tuning of a trained or imported model, parameters frozen by name (`lmjax finetune
--full [--freeze 'token_embedding.*,blocks.0.*']`; docs/fine-tuning.md).

Every base parameter trains except those matching a `freeze` glob (`lmjax.params.mask`). The
split is `lmjax.train.finetuned.partition`: the trained leaves are the loop's state (their
optimizer state and checkpoints hold nothing else), the frozen leaves are the step's `frozen`
argument, so they get no gradient, no optimizer state, and come out bit-identical:

    loss(trained; frozen) = CE(forward(join(trained, frozen), x), y)      d/d trained only

`lmjax.finetune` reads the settings (`full_fields`, `check_full`, `check_freeze`) and hands the
loop `full_trainable(...)`.
"""

from __future__ import annotations

import jax

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
    """Each glob must name a parameter of the base (`lmjax.params.mask`'s check), and something
    must be left to train."""
    # traced: nothing allocated
    frozen = ptree.mask(abstract_params(model), globs, require_match=True) if globs else {}
    if globs and all(jax.tree.leaves(frozen)):
        raise ConfigError.describe(
            "finetune.freeze",
            ",".join(globs),
            "globs leaving at least one parameter to train",
            "freeze fewer parameters",
        )


def full_objective(cfg) -> Loss:
    """The train-step objective of a full fine-tune: `loss(trained; frozen) =
    CE(forward(join(trained, frozen), x), y)`, differentiated with respect to `trained` only."""

    def fn(trained, frozen, inputs_BT, targets_BT, key, **masks):  # masks: loss_fn's keywords
        return loss_fn(join(trained, frozen), inputs_BT, targets_BT, cfg, key, **masks)

    return Loss(fn, uses_key=cfg.dropout > 0.0)


def full_trainable(cfg, spec: FinetuneSpec, init, frozen: dict):
    """The loop's `Trainable` for a full fine-tune: `init(key)` the base's unfrozen leaves."""
    return loop.Trainable(
        init_params=init,
        loss=full_objective(cfg.model_config()),
        frozen=frozen,
        model_params=lambda trained: join(trained, frozen),
        meta={"finetune": spec.to_dict()},
        files={FINETUNE_FILE: spec.to_yaml()},
    )


__all__ = ["check_freeze", "check_full", "full_fields", "full_objective", "full_trainable"]
