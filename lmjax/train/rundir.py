"""A run directory: its layout and its kind, known in one place.

    RUN/config.yaml          the resolved run config            (every kind)
    RUN/tokenizer/           the tokenizer the run's ids are of  (every kind, when known)
    RUN/checkpoints/<step>/  orbax checkpoints                   (trained, fine-tuned)
    RUN/metrics.jsonl, RUN/samples.txt, RUN/loss.png             (trained, fine-tuned)
    RUN/model.safetensors    the weights alone                   (weights: import-hf, merged/)
    RUN/finetune.yaml        the base and the LoRA config        (fine-tuned)
    RUN/adapters.safetensors the final adapters alone            (fine-tuned)
    RUN/merged/              the merged model, a weights run     (fine-tuned)

The kind, read from the files: `FINETUNED` when finetune.yaml is there (its checkpoints hold
adapters, not a model), else `TRAINED` when a checkpoint step is, else `WEIGHTS` when
model.safetensors is, else None (nothing saved yet). Who trains or fine-tunes a run lives above
this module; what a run directory holds is known here only.
"""

from __future__ import annotations

import dataclasses
import shlex
import shutil
from pathlib import Path

import yaml

from lmjax import tokenizers
from lmjax.config import RunConfig
from lmjax.data.prepared import TOKENIZER_DIR
from lmjax.errors import ConfigError, FileFormatError
from lmjax.files import atomic_dir, atomic_write_text, copy_tree, remove_stale, temporary_of
from lmjax.train.checkpoint import Checkpoints

CONFIG_FILE = "config.yaml"
CHECKPOINTS_DIR = "checkpoints"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.txt"
PLOT_FILE = "loss.png"
WEIGHTS_FILE = "model.safetensors"
FINETUNE_FILE = "finetune.yaml"
ADAPTERS_FILE = "adapters.safetensors"
MERGED_DIR = "merged"
TENSORBOARD_DIR = "tensorboard"
# What the trainer makes before the run's config.yaml (`RunDir.never_started`).
STARTING = (CHECKPOINTS_DIR, METRICS_FILE, TENSORBOARD_DIR)
# The files and directories of a run written atomically (`lmjax.files`): a kill mid-write
# leaves a hidden temporary of one of these, which the next run in the directory removes.
ATOMIC = (CONFIG_FILE, METRICS_FILE, SAMPLES_FILE, PLOT_FILE, FINETUNE_FILE, TOKENIZER_DIR,
          ADAPTERS_FILE, MERGED_DIR)  # fmt: skip
# Where a fine-tune builds its merged model before it replaces merged/ (`lmjax.finetune`).
STAGED_MERGED = f".{MERGED_DIR}.new"

TRAINED, FINETUNED, WEIGHTS = "trained", "finetuned", "weights"


def _under(name: str) -> property:
    """The property `run.path / name` (a file or directory of the layout above)."""
    return property(lambda self: self.path / name, doc=f"RUN/{name}")


@dataclasses.dataclass(frozen=True)
class RunDir:
    """The run directory at `path` (which need not exist yet)."""

    path: Path

    @classmethod
    def parse(cls, path) -> tuple[RunDir, int | None]:
        """`RUN` -> (RunDir(RUN), None); `RUN/checkpoints/STEP` -> (RunDir(RUN), STEP)."""
        path = Path(path)
        if (path / CONFIG_FILE).is_file():
            return cls(path), None
        parent = path.parent.parent
        named_step = path.name.isdigit() and path.parent.name == CHECKPOINTS_DIR
        if named_step and (parent / CONFIG_FILE).is_file():
            return cls(parent), int(path.name)
        expected = f"a run directory (with {CONFIG_FILE}) or RUN/{CHECKPOINTS_DIR}/<step>"
        if (path / "config.json").is_file():  # a Hugging Face checkpoint: lmjax reads runs
            out = shlex.quote(f"runs/{path.resolve().name}")
            raise ConfigError.describe(
                "run path",
                str(path),
                f"{expected}, not a Hugging Face checkpoint (config.json)",
                f"import it first: lmjax import-hf {shlex.quote(str(path))} --out {out}, "
                f"then pass {out}",
            )
        raise ConfigError.describe(
            "run path", str(path), expected, "pass the directory `lmjax train` wrote"
        )

    @classmethod
    def for_config(cls, cfg: RunConfig, config_path: str | None) -> RunDir:
        """`run.dir`, else `runs/<the config file's stem>` (`runs/run` without a file)."""
        return cls(Path(cfg.run.dir)) if cfg.run.dir else cls.default(config_path)

    @classmethod
    def default(cls, config_path: str | None) -> RunDir:
        """`runs/<the config file's stem>`, `runs/run` without a file."""
        return cls(Path("runs") / (Path(config_path).stem if config_path else "run"))

    # ---- layout: each a path under the run (which need not exist) ----------------------------

    config_file = _under(CONFIG_FILE)
    tokenizer_dir = _under(TOKENIZER_DIR)
    checkpoints_dir = _under(CHECKPOINTS_DIR)
    metrics_file = _under(METRICS_FILE)
    samples_file = _under(SAMPLES_FILE)
    plot_file = _under(PLOT_FILE)
    weights_file = _under(WEIGHTS_FILE)
    finetune_file = _under(FINETUNE_FILE)
    adapters_file = _under(ADAPTERS_FILE)
    merged_dir = _under(MERGED_DIR)
    tensorboard_dir = _under(TENSORBOARD_DIR)

    # ---- what it holds -----------------------------------------------------------------------

    def is_finetune(self) -> bool:
        return self.finetune_file.is_file()

    def kind(self) -> str | None:
        """`FINETUNED`, `TRAINED`, `WEIGHTS` or None (see the module docstring)."""
        if self.is_finetune():
            return FINETUNED
        if self.checkpoint_steps():
            return TRAINED
        return WEIGHTS if self.weights_file.is_file() else None

    def checkpoints(self, keep: int = 3) -> Checkpoints:
        """The run's checkpoints for writing (the directory is made)."""
        return Checkpoints(self.checkpoints_dir, keep=keep)

    def read_checkpoints(self) -> Checkpoints:
        """The run's checkpoints for reading (`CheckpointError` without checkpoints/)."""
        return Checkpoints(self.checkpoints_dir, create=False)

    def checkpoint_steps(self) -> list[int]:
        """The saved steps, oldest first ([] without checkpoints/)."""
        return self.read_checkpoints().steps() if self.checkpoints_dir.is_dir() else []

    def latest_step(self) -> int | None:
        steps = self.checkpoint_steps()
        return max(steps) if steps else None

    def read_config(self) -> RunConfig:
        try:
            data = yaml.safe_load(self.config_file.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            raise FileFormatError.describe(
                str(self.config_file),
                f"unparseable ({type(err).__name__})",
                "valid YAML",
                "restore the file from the run's checkpoint meta or re-run",
            ) from None
        return RunConfig.from_dict(data)

    def tokenizer(self) -> tokenizers.Tokenizer | None:
        """The run's tokenizer, or None when it has no tokenizer/ directory."""
        return tokenizers.load(self.tokenizer_dir) if self.tokenizer_dir.is_dir() else None

    # ---- writing -----------------------------------------------------------------------------

    def never_started(self) -> bool:
        """Whether the directory holds only what a run makes before it writes config.yaml (an
        empty metrics.jsonl, checkpoints/ without a step, tensorboard/, and the temporary of a
        file being written): a run killed while it started, which left nothing to continue and
        nothing to keep."""
        if not self.path.is_dir() or self.config_file.exists():
            return False
        entries = {e.name for e in self.path.iterdir() if temporary_of(e.name) not in ATOMIC}
        steps = self.checkpoints_dir.is_dir() and any(
            entry.name.isdecimal() for entry in self.checkpoints_dir.iterdir()
        )
        metrics = self.metrics_file.exists() and self.metrics_file.stat().st_size > 0
        return bool(entries) and entries <= set(STARTING) and not steps and not metrics

    def check_writable(self, resume: bool) -> bool:
        """A new run needs a new (or empty) directory; a resumed one its config.yaml. A directory
        a run was killed in while starting (`never_started`) is taken as new, with or without
        `resume`: returns whether the run resumes."""
        for parent in [self.path, *self.path.parents]:
            if parent.exists() and not parent.is_dir():
                raise ConfigError.describe(
                    "run directory",
                    str(self.path),
                    f"a directory path ({parent} is a file)",
                    "pick another run.dir",
                )
        if self.never_started():
            return False
        exists = self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir()))
        if exists and not resume:
            raise ConfigError.describe(
                "run directory",
                str(self.path),
                "a new (or empty) directory",
                "pass --resume to continue that run, or run.dir=OTHER for a new one "
                "(nothing was overwritten)",
            )
        if resume and not self.config_file.is_file():
            raise ConfigError.describe(
                "run directory to resume",
                str(self.path),
                f"a run directory with {CONFIG_FILE}",
                "check run.dir, or drop --resume to start a new run",
            )
        return resume

    def write_config(self, cfg: RunConfig) -> None:
        atomic_write_text(self.config_file, yaml.safe_dump(cfg.to_dict(), sort_keys=False))

    def copy_tokenizer(self, source: Path) -> None:
        """Copy `source` (a saved tokenizer) in as tokenizer/, unless the run has one; whole or
        not at all (a kill mid-copy left a half tokenizer/ that a resume then kept)."""
        if not self.tokenizer_dir.exists():  # the bytes; the modes are the umask's
            with atomic_dir(self.tokenizer_dir) as tmp:
                copy_tree(source, tmp)

    def remove_stale(self) -> list[str]:
        """Remove the temporaries a killed writer left beside the run's files; their names."""
        staged = self.path / STAGED_MERGED  # built whole, not yet in place of merged/
        found = [STAGED_MERGED] if staged.is_dir() else []
        shutil.rmtree(staged, ignore_errors=True)
        return remove_stale(self.path, (*ATOMIC, STAGED_MERGED)) + found


def run_label(path, step: int | None) -> str:
    """How a message names a run's weights: "PATH step 12", or "PATH (weights only)" for a run
    without checkpoints (import-hf, merged/), whose step is None."""
    return f"{path} (weights only)" if step is None else f"{path} step {step}"


__all__ = [
    "ADAPTERS_FILE",
    "CHECKPOINTS_DIR",
    "CONFIG_FILE",
    "FINETUNE_FILE",
    "FINETUNED",
    "MERGED_DIR",
    "METRICS_FILE",
    "PLOT_FILE",
    "RunDir",
    "SAMPLES_FILE",
    "TOKENIZER_DIR",
    "TRAINED",
    "WEIGHTS",
    "WEIGHTS_FILE",
    "run_label",
]
