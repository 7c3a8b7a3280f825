"""`lmjax train`: a run directory, the training loop, evaluation, samples and checkpoints.

    RUN/config.yaml        the resolved config (vocab size filled in from the data)
    RUN/tokenizer/         a copy of the data's tokenizer, so the run is self-contained
    RUN/metrics.jsonl      {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", ...} every
                           logging.every steps, {"step", "val_loss", "val_perplexity"} at evals
    RUN/loss.png           train and validation loss against step
    RUN/samples.txt        text sampled at every evaluation
    RUN/checkpoints/<s>/   orbax checkpoints (see `lmjax.train.checkpoint`)

A new run refuses an existing directory (nothing is overwritten); `resume=True` continues from
the newest complete checkpoint (damaged newer steps are moved to `<step>.corrupt` and a killed
save's temporary directory is removed, each reported on `out`; see `lmjax.train.checkpoint`),
redoing nothing and skipping nothing: the batches are a function of
(seed, step) and the dropout keys of (key, step), so N steps + resume + M steps equals N + M
straight steps bit for bit on CPU. A non-finite loss stops the run with `NonFiniteError` naming
the step; the newest checkpoint on disk is the last good one.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml

from lmjax import parallel
from lmjax.config import RunConfig
from lmjax.errors import ConfigError, LMJaxError, NonFiniteError
from lmjax.files import atomic_write_text
from lmjax.train import data as D
from lmjax.train import optim
from lmjax.train.checkpoint import Checkpoints, check_same_model
from lmjax.train.metrics import MetricsLog, flops_per_token, measured_peak_flops, plot_losses
from lmjax.train.step import TrainState, init_state, make_eval_step, make_train_step

# Sections a resumed run may change: how long to train and how to log/checkpoint, never what.
RESUMABLE_CHANGES = (
    "train.steps",
    "train.eval_every",
    "train.eval_batches",
    "run.",
    "logging.",
    "checkpoint.",
    "parallel.",  # a checkpoint restores onto any mesh
)


@dataclasses.dataclass
class RunResult:
    run_dir: Path
    step: int
    val_loss: float | None
    sample: str | None
    params: Any = None  # the trained parameters (the adapters of a fine-tune) at `step`


def _identity(params):
    return params


@dataclasses.dataclass(frozen=True)
class Trainable:
    """What the loop trains. The default: every model parameter. A fine-tune (`lmjax.finetune`)
    trains `init_params(key)`'s leaves (LoRA adapters) with its `loss`, passes `frozen` (the
    base model) to every step, and evaluates and samples `model_params(trained)`."""

    init_params: Any = None  # key -> trained params; None: models.init
    loss: Any = None  # a lmjax.train.step.Loss; None: the model loss
    frozen: Any = None  # the step's frozen argument: never donated, differentiated or updated
    model_params: Any = _identity  # trained params -> the tree forward / generate take
    meta: dict = dataclasses.field(default_factory=dict)  # added to every checkpoint's meta
    # (model cfg, seq_len) -> FLOPs per trained token for MFU; None: metrics.flops_per_token
    flops_per_token: Any = None
    files: dict = dataclasses.field(default_factory=dict)  # {name: text} beside config.yaml


def default_run_dir(config_path: str | None) -> Path:
    stem = Path(config_path).stem if config_path else "run"
    return Path("runs") / stem


def prepare_data(cfg: RunConfig, progress: bool = True, tokenizer_dir=None) -> D.Prepared:
    """Prepare (or reuse) the config's data and open it; `tokenizer_dir`: encode with that saved
    tokenizer instead of building one from the corpus (a fine-tune encodes with its base's)."""
    return D.open_prepared(D.prepare_section(cfg.data, progress, tokenizer_dir=tokenizer_dir))


def resolve(cfg: RunConfig, prepared: D.Prepared) -> RunConfig:
    """Fill model.vocab_size from the data, or check that it agrees with the data."""
    if cfg.vocab_from_data:
        cfg = cfg.with_vocab_size(prepared.vocab_size)
    D.check_vocab(prepared, cfg.model_config().vocab_size)
    return cfg


def train(
    cfg: RunConfig,
    *,
    config_path: str | None = None,
    resume: bool = False,
    out=None,
    trainable: Trainable | None = None,
) -> RunResult:
    """Run (or resume) training as configured; see the module docstring. `trainable`: what is
    trained (default every model parameter; `lmjax.finetune` passes LoRA's). `out`: the stream
    of the progress bar and notes (default: `sys.stderr` at call time, so a redirect applies)."""
    out = sys.stderr if out is None else out
    trainable = trainable or Trainable()
    run_dir = Path(cfg.run.dir) if cfg.run.dir else default_run_dir(config_path)
    _check_run_dir(run_dir, resume)
    if resume and trainable.frozen is None and (run_dir / "finetune.yaml").is_file():
        # Its checkpoints hold adapters, not a model: restoring would fail after config.yaml
        # had been rewritten.
        raise ConfigError.describe(
            "run directory to resume", str(run_dir), "a run written by lmjax train",
            "it is a fine-tune: continue it with lmjax finetune CONFIG --resume",
        )  # fmt: skip
    prepared = prepare_data(cfg, cfg.logging.progress)
    cfg = resolve(cfg, prepared)
    cfg = _resumed_config(run_dir, cfg) if resume else _pin_schedule(cfg)
    preflight(cfg, prepared)
    if note := warmup_only_note(cfg):
        print(note, file=out)
    if trainable.frozen is not None and (cfg.parallel.mesh is not None or jax.process_count() > 1):
        raise ConfigError.describe(
            "parallel.mesh", cfg.parallel.mesh, "no mesh for a fine-tune (not supported yet)",
            "remove the parallel section: fine-tunes run in one process, on one device",
        )  # fmt: skip
    # The mesh against the device count and the batch, before anything is written.
    parallel.run_mesh_shape(cfg.parallel.mesh, cfg.train.batch_size // cfg.train.grad_accum)
    # Every host checks the (shared) run directory before process 0 writes into it.
    parallel.barrier("lmjax train: run directory checked")
    run_dir.mkdir(parents=True, exist_ok=True)

    def publish() -> None:
        """The run's own files, written once its state is in hand: a resume refused by its
        checkpoint (another architecture, say) leaves config.yaml as it was."""
        if not parallel.is_main():  # one writer per run; the other hosts join the checkpoints
            return
        atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        for name, text in trainable.files.items():
            atomic_write_text(run_dir / name, text)
        if not (run_dir / "tokenizer").exists():
            shutil.copytree(prepared.directory / "tokenizer", run_dir / "tokenizer")

    return _Trainer(cfg, run_dir, prepared, out, trainable).run(resume, publish)


def _pin_schedule(cfg: RunConfig) -> RunConfig:
    """Write the decay length into the config, so extending a run keeps its schedule.

    A run no longer than its warmup (a smoke run, `train.steps=3` under 50 warmup steps) pins
    the decay to start right after the warmup: every step it takes is on the warmup ramp."""
    if cfg.schedule.decay_steps is not None:
        return cfg
    decay_steps = max(cfg.train.steps, cfg.schedule.warmup_steps + 1)
    return cfg.replace(schedule=dataclasses.replace(cfg.schedule, decay_steps=decay_steps))


def warmup_only_note(cfg: RunConfig) -> str | None:
    """The line that says a run ends inside its warmup (the learning rate never reaches its
    peak), or None when the run is longer than the warmup."""
    steps, warmup = cfg.train.steps, cfg.schedule.warmup_steps
    if steps > warmup:
        return None
    return (
        f"note: train.steps = {steps} <= schedule.warmup_steps = {warmup}: the learning rate "
        f"follows the warmup ramp for the whole run, reaching {steps}/{warmup} of optimizer.lr "
        f"= {cfg.optimizer.lr:g}"
    )


def preflight(cfg: RunConfig, prepared: D.Prepared) -> None:
    """What would otherwise fail at the first evaluation, checked before anything is written."""
    model = cfg.model_config()
    for name, tokens in (("train", prepared.train), ("validation", prepared.val)):
        if len(tokens) < cfg.seq_len + 1:
            raise ConfigError.describe(
                f"{name} split of {prepared.directory}",
                f"{len(tokens)} tokens",
                f"at least train.seq_len + 1 = {cfg.seq_len + 1}",
                "lower train.seq_len, use a longer corpus, or change data.val_fraction",
            )
    g = cfg.logging
    if g.sample_tokens == 0:
        return
    try:
        ids = prepared.tokenizer.encode(g.sample_prompt)
    except LMJaxError as err:
        raise ConfigError.describe(
            "logging.sample_prompt", g.sample_prompt, f"text the tokenizer can encode ({err})",
            "change the prompt or set logging.sample_tokens=0",
        ) from None  # fmt: skip
    room = model.context_length - len(ids)
    if not ids or g.sample_tokens > room:
        raise ConfigError.describe(
            "logging.sample_tokens", g.sample_tokens,
            f"<= context_length - prompt tokens = {room} and a non-empty prompt",
            "lower logging.sample_tokens or shorten logging.sample_prompt",
        )  # fmt: skip


def _check_run_dir(run_dir: Path, resume: bool) -> None:
    for parent in [run_dir, *run_dir.parents]:
        if parent.exists() and not parent.is_dir():
            raise ConfigError.describe(
                "run directory", str(run_dir), f"a directory path ({parent} is a file)",
                "pick another run.dir",
            )  # fmt: skip
    exists = run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir()))
    if exists and not resume:
        raise ConfigError.describe(
            "run directory",
            str(run_dir),
            "a new (or empty) directory",
            "pass --resume to continue that run, or run.dir=OTHER for a new one "
            "(nothing was overwritten)",
        )
    if resume and not (run_dir / "config.yaml").is_file():
        raise ConfigError.describe(
            "run directory to resume",
            str(run_dir),
            "a run directory with config.yaml",
            "check run.dir, or drop --resume to start a new run",
        )


def _flat(cfg: RunConfig) -> dict[str, Any]:
    """`section.field -> value`, with the model section as the resolved `ModelConfig`."""
    sections = {**cfg.to_dict(), "model": cfg.model_config().to_dict()}
    return {f"{s}.{k}": v for s, fields in sections.items() for k, v in fields.items()}


def _resumed_config(run_dir: Path, cfg: RunConfig) -> RunConfig:
    """The config to resume with: the saved schedule length, and nothing else changed."""
    from lmjax.train.runs import read_config

    saved = _pin_schedule(read_config(run_dir))
    if cfg.schedule.decay_steps is None:  # keep the run's schedule when steps are extended
        schedule = dataclasses.replace(cfg.schedule, decay_steps=saved.schedule.decay_steps)
        cfg = cfg.replace(schedule=schedule)
    old, new = _flat(saved), _flat(cfg)
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key) and not key.startswith(RESUMABLE_CHANGES):
            raise ConfigError.describe(
                f"{key} on resume",
                new.get(key),
                f"the run's value {old.get(key)!r} (only {', '.join(RESUMABLE_CHANGES)} may "
                "change)",
                f"resume with {key}={_override_text(old.get(key))} or start a new run",
            )
    latest = (
        Checkpoints(run_dir / "checkpoints", create=False).latest_step()
        if (run_dir / "checkpoints").is_dir()
        else None
    )
    if latest is not None and cfg.train.steps < latest:
        raise ConfigError.describe(
            "train.steps on resume", cfg.train.steps, f">= the newest checkpoint's step {latest}",
            f"resume with train.steps={latest} or more",
        )  # fmt: skip
    return cfg


def _override_text(value) -> str:
    return (
        "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    )


class _Trainer:
    """The loop's mutable bookkeeping (timers, the progress bar); the step itself is pure."""

    def __init__(self, cfg: RunConfig, run_dir: Path, prepared: D.Prepared, out, trainable):
        self.cfg, self.run_dir, self.data, self.out = cfg, run_dir, prepared, out
        self.trainable = trainable
        self.model = cfg.model_config()
        self.tx, self.lr = optim.from_config(cfg)
        self.main = parallel.is_main()
        self.mesh, self.shardings = _mesh_and_shardings(cfg, self.model, self.tx)
        self.train_step = make_train_step(
            self.model, self.tx, self.lr, self.shardings, loss=trainable.loss
        )
        self.eval_step = make_eval_step(self.model)
        self.ckpt = Checkpoints(run_dir / "checkpoints", keep=cfg.checkpoint.keep)
        self.log = MetricsLog(run_dir / "metrics.jsonl")
        self.seq_len = cfg.seq_len
        self.tokens_per_step = cfg.train.batch_size * self.seq_len
        count = trainable.flops_per_token or flops_per_token
        self.flops = count(self.model, self.seq_len) * self.tokens_per_step
        peak = cfg.logging.peak_flops
        self.compile_s = None
        self.peak = peak or measured_peak_flops(str(self.model.compute_dtype))

    def initial_state(self, resume: bool) -> TrainState:
        key = jax.random.PRNGKey(self.cfg.train.seed)
        if resume and self.ckpt.latest_step() is not None:
            init = self.trainable.init_params
            abstract = jax.eval_shape(lambda: init_state(key, self.model, self.tx, init))
            if self.shardings is not None:
                abstract = jax.tree.map(
                    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                    abstract,
                    self.shardings,
                )
            state, moved = self.ckpt.restore_complete(
                abstract, lambda meta, where: check_same_model(meta, self.model, where)
            )
            if self.main:
                for step, err, name in moved:
                    print(
                        f"lmjax: checkpoint step {step} is damaged ({err}); moved it to "
                        f"{self.ckpt.directory / name} and resumed from step {int(state.step)}",
                        file=self.out,
                    )
                self.log.truncate_after(int(state.step))
                _truncate_samples(self.run_dir / "samples.txt", int(state.step))
            return state
        if self.main:
            self.log.truncate_after(0)
            _truncate_samples(self.run_dir / "samples.txt", 0)
        if self.shardings is None:
            state = init_state(key, self.model, self.tx, self.trainable.init_params)
            # Committed to its device, as the step's outputs are once any argument is (a frozen
            # base restored from a checkpoint): a fresh state is uncommitted, so step 2's
            # arguments would be placed unlike step 1's and jit would compile the step again.
            device = next(iter(jax.tree.leaves(state)[0].devices()))
            return jax.device_put(state, device)
        # Initialized directly into its shards: no device ever holds the whole state.
        init = jax.jit(init_state, static_argnums=(1, 2), out_shardings=self.shardings)
        return init(key, self.model, self.tx)

    def run(self, resume: bool, publish=lambda: None) -> RunResult:
        t = self.cfg.train
        state = self.initial_state(resume)
        publish()
        if self.main:  # what a save killed midway left: never listed, never resumed from
            for name in self.ckpt.remove_temporary():
                print(
                    f"lmjax: removed the half-written checkpoint {name} (a save that never "
                    "finished)",
                    file=self.out,
                )  # fmt: skip
        start = int(state.step)
        self.bar = _bar(start, t.steps, self.cfg.logging.progress, self.out)
        self.pending: list[tuple[int, dict]] = []
        self.state = state
        try:
            val_loss, sample = self._loop(start)
        except KeyboardInterrupt:
            self.bar.close()
            self._save_on_interrupt()
            raise
        except Exception as err:  # a dead peer's collective: one line, exit 75 (multihost)
            parallel.multihost.exit_if_peer_lost(err)
            raise
        self.bar.close()
        if start >= t.steps and val_loss is None:
            val_loss = self.evaluate_params(self.state.params)
        return RunResult(self.run_dir, int(self.state.step), val_loss, sample, self.state.params)

    def _loop(self, start: int) -> tuple[float | None, str | None]:
        t, bar, state, pending = self.cfg.train, self.bar, self.state, self.pending
        self.window_start, val_loss, sample = time.perf_counter(), None, None
        for step in range(start, t.steps):
            batch = self._batch(step)
            batch = {**batch, "step": np.int32(step)}
            state, metrics = self.train_step(state, batch, self.trainable.frozen)
            self.state = state
            done = step + 1
            pending.append((done, metrics))
            if step == start:  # the first step compiles: time it apart from the throughput
                jax.block_until_ready(metrics)
                self.compile_s = time.perf_counter() - self.window_start
                self.window_start = time.perf_counter()
            if done % self.cfg.logging.every == 0 or done == t.steps or _due(done, self.cfg):
                self._log_window(pending, self.window_start, int(state.step), bar)
                pending.clear()
                self.window_start = time.perf_counter()
            # Checkpoint first: an evaluation that fails must not cost the training behind it.
            if done % self.cfg.checkpoint.every == 0 or done == t.steps:
                self.ckpt.save(state, self._meta(done))
                self.window_start = time.perf_counter()
            if done % t.eval_every == 0 or done == t.steps:
                val_loss, sample = self._evaluate(state, done)
                self.window_start = time.perf_counter()
        return val_loss, sample

    def _batch(self, step: int) -> dict:
        t = self.cfg.train
        vocab = self.model.vocab_size  # positional: tests wrap train_batch(..., *args)
        if self.mesh is None:
            return D.train_batch(
                self.data.train, t.seed, step, t.batch_size, self.seq_len, t.grad_accum, None,
                vocab,
            )  # fmt: skip
        # Each host reads only the rows its devices hold (lmjax.parallel.multihost).
        shape = (t.grad_accum, t.batch_size // t.grad_accum, self.seq_len)
        sharding = parallel.batch_sharding(self.mesh, 3, batch_dim=1)

        def read(rows):
            return D.train_batch(
                self.data.train, t.seed, step, t.batch_size, self.seq_len, t.grad_accum, rows,
                vocab,
            )  # fmt: skip

        return parallel.host_batch(read, shape, sharding)

    def _save_on_interrupt(self) -> None:
        """Ctrl-C: log and checkpoint the steps done so far, if they are healthy and whole."""
        state, latest = self.state, self.ckpt.latest_step()
        try:
            if any(leaf.is_deleted() for leaf in jax.tree.leaves(state)):
                raise RuntimeError("interrupted inside a step")  # its input was donated
            step = int(state.step)
            if self.pending:
                self._log_window(self.pending, self.window_start, step, self.bar)
            if step > (latest or 0):
                self.ckpt.save(state, self._meta(step))
                latest = step
        except (RuntimeError, NonFiniteError):
            pass
        where = f"checkpoint step {latest}" if latest else "no checkpoint yet"
        print(f"interrupted: {self.run_dir} has {where}; continue with --resume", file=self.out)

    def _log_window(self, pending, window_start: float, state_step: int, bar) -> None:
        host = jax.device_get([m for _, m in pending])  # waits for the steps to finish
        elapsed = time.perf_counter() - window_start
        for (step, _), m in zip(pending, host, strict=True):
            if not m["finite"] or step > state_step:
                raise self._non_finite(step, m)
        # The compile step (first of the process) is logged but not timed into throughput.
        timed = len(pending) - (self.compile_s is not None)
        tokens_per_s = self.tokens_per_step * timed / elapsed if timed else None
        step, m = pending[-1][0], host[-1]
        record = {
            "step": step,
            "loss": float(np.mean([x["loss"] for x in host])),
            "lr": float(m["lr"]),
            "grad_norm": float(m["grad_norm"]),
            "tokens_per_s": tokens_per_s,
            "mfu": None
            if timed == 0
            else self.flops / self.tokens_per_step * tokens_per_s / self.peak,
        }
        if self.compile_s is not None:  # once per process: the first step's compile + run time
            record["first_step_s"], self.compile_s = self.compile_s, None
        if self.main:
            self.log.append(record)
        speed = f"{tokens_per_s:,.0f}" if tokens_per_s else "compiling"
        bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=speed, refresh=False)
        bar.update(step - bar.n)

    def _non_finite(self, step: int, m) -> NonFiniteError:
        return NonFiniteError.describe(
            f"train step {step}: loss",
            _Raw(f"{float(m['loss'])} (grad norm {float(m['grad_norm'])})"),
            "a finite loss, gradient and update",
            "lower optimizer.lr, set optimizer.clip_norm, or check the data; the run stopped "
            + (
                f"and its newest checkpoint (step {latest}) is the last good one"
                if (latest := self.ckpt.latest_step()) is not None
                else "before saving any checkpoint"
            ),
        )

    def evaluate_params(self, params) -> float:
        params = self.trainable.model_params(params)
        # On a mesh the eval batch is split like a training batch: left as host arrays it was
        # replicated, every device running the whole micro-batch.
        sharding = None if self.mesh is None else parallel.batch_sharding(self.mesh, 2)
        return evaluate(
            self.eval_step, params, self.data.val, self.cfg.train, self.seq_len, sharding,
            vocab_size=self.model.vocab_size,
        )  # fmt: skip

    def _evaluate(self, state: TrainState, step: int) -> tuple[float, str | None]:
        val_loss = self.evaluate_params(state.params)
        if self.main:
            self.log.append(
                {"step": step, "val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 700))}
            )
        sample = self._sample(state.params, step)
        if self.cfg.logging.plot and self.main:
            plot_losses(self.log.read(), self.run_dir / "loss.png", title=str(self.run_dir))
        return val_loss, sample

    def _sample(self, params, step: int) -> str | None:
        g = self.cfg.logging
        if g.sample_tokens == 0:
            return None
        if self.mesh is not None:  # sample from a host copy: decoding runs on one device
            from jax.experimental import multihost_utils

            params = multihost_utils.process_allgather(params, tiled=True)
        text = sample_text(
            self.trainable.model_params(params),
            self.model,
            self.data.tokenizer,
            g.sample_prompt,
            g.sample_tokens,
            g.sample_temperature,
            seed=step,
        )
        if self.main:
            with open(self.run_dir / "samples.txt", "a", encoding="utf-8") as handle:
                handle.write(f"===== step {step} =====\n{text}\n\n")
        return text

    def _meta(self, step: int) -> dict:
        return {
            "config": self.cfg.to_dict(),
            "model": self.model.to_dict(),
            "data_position": {"seed": self.cfg.train.seed, "step": step},
            **self.trainable.meta,
        }


def _mesh_and_shardings(cfg: RunConfig, model, tx):
    """`(mesh, TrainState of NamedShardings)` on the run's mesh (`parallel.run_mesh_shape`: a
    multi-process run without `parallel.mesh` gets one too), else `(None, None)`."""
    shape = parallel.run_mesh_shape(cfg.parallel.mesh, cfg.train.batch_size // cfg.train.grad_accum)
    if shape is None:
        return None, None
    mesh = parallel.make_mesh(shape)
    abstract = jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), model, tx))
    specs = parallel.state_specs(abstract, model, parallel.mesh_shape(mesh))
    return mesh, parallel.shardings(specs, mesh)


def evaluate(
    eval_step, params, val_tokens, t, seq_len: int, sharding=None, vocab_size: int | None = None
) -> float:
    """Mean loss over the `t.eval_batches` fixed validation batches (micro-batch sized).

    `sharding`: lay each `[B, T]` batch out by it (every host computes the same batch and
    hands over only its devices' rows); None: host arrays. `vocab_size`: refuse a batch with
    an id outside the vocabulary (`TokenError`; the gather would clamp it).
    """
    micro = t.batch_size // t.grad_accum

    def batch(i: int):
        arrays = D.eval_batch(val_tokens, t.seed, i, micro, seq_len, vocab_size=vocab_size)
        if sharding is None:
            return arrays
        return [jax.make_array_from_callback(a.shape, sharding, a.__getitem__) for a in arrays]

    losses = [eval_step(params, *batch(i)) for i in range(t.eval_batches)]
    return float(np.mean(jax.device_get(losses)))


def _due(done: int, cfg: RunConfig) -> bool:
    """Metrics are flushed (and health checked) before every evaluation and checkpoint."""
    return done % cfg.train.eval_every == 0 or done % cfg.checkpoint.every == 0


def _bar(start: int, total: int, enabled: bool, out):
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=start,
        desc="train",
        unit="step",
        disable=not enabled,
        file=out,
        dynamic_ncols=True,
    )


def sample_text(
    params, model, tokenizer, prompt: str, n_tokens: int, temperature: float, seed: int
) -> str:
    """`prompt` continued by `n_tokens` sampled tokens (decoded, prompt included)."""
    from lmjax import generate

    ids = tokenizer.encode(prompt)
    out = generate.generate(
        params, [ids], model, max_new_tokens=n_tokens, temperature=temperature, seed=seed
    )
    return tokenizer.decode(list(ids) + list(out[0]))


def _truncate_samples(path: Path, step: int) -> None:
    """Keep the samples of steps <= `step` (a resumed run writes the later ones again)."""
    if not path.exists():
        return
    blocks = re.split(r"(?m)^(?====== step \d+ =====$)", path.read_text(encoding="utf-8"))
    kept = [b for b in blocks if b and int(b.split()[2]) <= step]
    atomic_write_text(path, "".join(kept))


class _Raw(str):
    """A value shown as is in an error message (not as a quoted repr)."""

    def __repr__(self) -> str:
        return str(self)
