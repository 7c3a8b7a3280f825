"""The fine-tune recipes shipped inside the package: `lmjax finetune --recipe NAME` runs
`lmjax/finetune/recipes/NAME.yaml` (docs/fine-tuning.md), wherever lmjax is installed.

A recipe is an ordinary fine-tune config. Its paths (`finetune.base`, `finetune.data`,
`run.dir`) are relative to the directory lmjax runs in, as every config's are, never to the
YAML file: a recipe lives in the installed package, and `runs/llama` or `chat.jsonl` there would
name nothing the user has. So a recipe is run from the directory holding the user's `runs/` and
`chat.jsonl`, and a copy of it (`recipe_path(NAME)`, to edit more than overrides reach) reads
the same paths from wherever it is copied.
"""

from __future__ import annotations

from pathlib import Path

from lmjax.errors import ConfigError

RECIPE_DIR = Path(__file__).with_name("recipes")


def recipe_names() -> list[str]:
    """The shipped recipes' names (`llama-lora`, `llama-qlora`, ...), sorted."""
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def recipe_path(name: str) -> Path:
    """The YAML file of the shipped recipe `name`; one error line naming the others."""
    names = recipe_names()
    if name not in names:
        raise ConfigError.describe(
            "--recipe",
            name,
            f"one of {names} (shipped with lmjax)",
            "pick one of them, or pass your own fine-tune config as CONFIG",
        )
    return RECIPE_DIR / f"{name}.yaml"


__all__ = ["RECIPE_DIR", "recipe_names", "recipe_path"]
