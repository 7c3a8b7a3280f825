"""The training loop over a `Plan`: a small trainer holding the state and the jitted step.

    for step in start .. train.steps - 1:
        state, metrics = train_step(state, batch(seed, step), frozen)   (batch step + 1 is cut
                                                                         meanwhile: Prefetch)
        every logging.every steps           -> metrics.jsonl (`MetricsWindow`)
        every checkpoint.every steps, last  -> checkpoints/<step>/
        every train.eval_every steps, last  -> val_loss (`Evaluator`), samples.txt (`Sampler`)

Checkpointing comes before evaluation: an evaluation that fails must not cost the training
behind it. The batches are a function of (seed, step) and the dropout keys of (key, step), so a
resumed run redoes nothing and skips nothing. Ctrl-C records and checkpoints the steps done so
far when they are whole and healthy (a step interrupted midway has donated its input), then
re-raises; a lost peer's collective ends the process with one line (`parallel.multihost`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from lmjax import parallel
from lmjax.data import prepared as D
from lmjax.data.prefetch import Prefetch
from lmjax.errors import NonFiniteError
from lmjax.train.checkpoint import check_same_model
from lmjax.train.evaluate import Evaluator
from lmjax.train.metrics import MetricsLog, plot_losses
from lmjax.train.plan import Plan
from lmjax.train.progress import MetricsWindow, progress_bar
from lmjax.train.sampling import Sampler, truncate_samples
from lmjax.train.step import TrainState, init_state
from lmjax.train.tensorboard import TensorBoardLog
from lmjax.train.wandb_log import WandbLog


@dataclasses.dataclass
class RunResult:
    run_dir: Path
    step: int
    val_loss: float | None
    sample: str | None
    params: Any = None  # the trained parameters (the adapters of a fine-tune) at `step`
    compile_cache: str | None = None  # where JAX's compilation cache is (None: off)


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
    stop_ids: tuple = ()  # ids that end a sample (a chat model's end of turn), kept in its text
    notes: tuple = ()  # lines said on the run's `out` once its config and data are checked
    # per-layer name -> whether a checkpoint saved per layer may lack that layer (a full
    # fine-tune's frozen layers, restored as zeros: Checkpoints.restore); None: none may
    absent_layers: Any = None


@dataclasses.dataclass(frozen=True)
class Step:
    """The jitted train step and what it was built for: `tx` (the optimizer), and on a mesh the
    `mesh` and the `TrainState` of `NamedSharding`s (else both None)."""

    fn: Callable
    tx: Any
    mesh: Any = None
    shardings: Any = None


@dataclasses.dataclass(frozen=True)
class Pieces:
    """What the trainer calls besides the step: evaluation, sampling, metrics (FLOPs per step
    and the peak for MFU)."""

    evaluate: Evaluator
    sample: Sampler
    flops_per_step: float
    peak_flops: float


class Trainer:
    """`Trainer(plan, trainable, step, pieces, out).run(publish)`: see the module docstring."""

    def __init__(self, plan: Plan, trainable: Trainable, step: Step, pieces: Pieces, out):
        self.plan, self.trainable, self.step = plan, trainable, step
        self.pieces, self.out = pieces, out
        self.ckpt = plan.run.checkpoints(keep=plan.cfg.checkpoint.keep)
        board = (TensorBoardLog(plan.run.tensorboard_dir),) if plan.cfg.train.tensorboard else ()
        t = plan.cfg.train
        wandb = WandbLog(plan.run.path, plan.cfg.to_dict(), plan.resume, t.wandb_project)
        self.log = MetricsLog(plan.run.metrics_file, also=board + ((wandb,) if t.wandb else ()))
        self.state: TrainState | None = None

    # ---- the state ---------------------------------------------------------------------------

    def initial_state(self) -> TrainState:
        """The newest complete checkpoint's state (resuming), else a fresh one."""
        key = jax.random.PRNGKey(self.plan.cfg.train.seed)
        model, tx, init = self.plan.model, self.step.tx, self.trainable.init_params
        if self.plan.resume and self.ckpt.latest_step() is not None:
            state = self._restore(jax.eval_shape(lambda: init_state(key, model, tx, init)))
            self._say(f"resumed {self.plan.run.path} from step {int(state.step)}")
            return state
        if self.plan.resume:
            self._say(f"resuming {self.plan.run.path}: no checkpoint yet, starting at step 0")
        self._rewind(0)
        if self.step.shardings is None:
            state = init_state(key, model, tx, init)
            # Committed to its device, as the step's outputs are once any argument is (a frozen
            # base restored from a checkpoint): a fresh state is uncommitted, so step 2's
            # arguments would be placed unlike step 1's and jit would compile the step again.
            device = next(iter(jax.tree.leaves(state)[0].devices()))
            return jax.device_put(state, device)
        # Initialized directly into its shards: no device ever holds the whole state.
        if init is None:
            sharded = jax.jit(init_state, static_argnums=(1, 2), out_shardings=self.step.shardings)
            return sharded(key, model, tx)
        return _init_sharded(lambda k: init_state(k, model, tx, init), key, self.step.shardings)

    def _restore(self, abstract) -> TrainState:
        if self.step.shardings is not None:
            abstract = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                abstract,
                self.step.shardings,
            )
        model = self.plan.model
        state, moved = self.ckpt.restore_complete(
            abstract,
            lambda meta, where: check_same_model(meta, model, where),
            self.trainable.absent_layers,
        )
        for step, err, name in moved if parallel.is_main() else ():
            self._note(
                f"lmjax: checkpoint step {step} is damaged ({err}); moved it to "
                f"{self.ckpt.directory / name} and resumed from step {int(state.step)}"
            )
        self._rewind(int(state.step))
        return state

    def _rewind(self, step: int) -> None:
        """Drop the metrics and samples of steps after `step`: the run writes them again."""
        if parallel.is_main():
            self.log.truncate_after(step)
            truncate_samples(self.plan.run.samples_file, step)

    def _note(self, text: str) -> None:
        print(text, file=self.out)

    @staticmethod
    def _say(text: str) -> None:
        """A note for the user on stdout (main process only), before the progress bar starts."""
        if parallel.is_main():
            print(text, flush=True)

    # ---- the run -----------------------------------------------------------------------------

    def run(self, publish: Callable[[], None] = lambda: None) -> RunResult:
        """Train to `train.steps`; `publish()` writes the run's files once the state is in hand
        (a resume its checkpoint refuses leaves config.yaml as it was)."""
        try:
            return self._run(publish)
        finally:
            self.log.close()

    def _run(self, publish: Callable[[], None]) -> RunResult:
        t = self.plan.cfg.train
        self.state = self.initial_state()
        publish()
        for name in self.ckpt.remove_temporary() if parallel.is_main() else ():
            # What a save killed midway left: never listed, never resumed from.
            self._note(
                f"lmjax: removed the half-written checkpoint {name} (a save that never finished)"
            )
        if parallel.is_main():  # a file write killed midway: the file itself is whole
            self.plan.run.remove_stale()
        start = int(self.state.step)
        lost = None  # killed between its checkpoint and its evaluation: evaluate it now
        if self._evaluation_lost(start):
            lost = self._evaluate(start)
        bar = progress_bar(start, t.steps, self.plan.cfg.logging.progress, self.out)
        p, tokens = self.pieces, self.plan.tokens_per_step
        latest = self.ckpt.latest_step
        window = MetricsWindow(self.log, bar, tokens, p.flops_per_step, p.peak_flops, latest)
        try:
            val_loss, sample = self._loop(start, window)
        except KeyboardInterrupt:
            bar.close()
            self._save_on_interrupt(window)
            raise
        except Exception as err:  # a dead peer's collective: one line, exit 75 (multihost)
            parallel.multihost.exit_if_peer_lost(err)
            raise
        bar.close()
        if start >= t.steps and val_loss is None:
            val_loss, sample = lost or (self.pieces.evaluate(self.state.params), None)
        params = self.state.params
        return RunResult(self.plan.run.path, int(self.state.step), val_loss, sample, params)

    def _loop(self, start: int, window: MetricsWindow) -> tuple[float | None, str | None]:
        cfg = self.plan.cfg
        t, val_loss, sample = cfg.train, None, None
        window.restart()
        # The next batch is cut on a background thread while this step runs (Prefetch).
        with Prefetch(self._batch, range(start, t.steps)) as batches:
            for step in range(start, t.steps):
                _, batch, data_s = batches.next()
                batch = {**batch, "step": np.int32(step)}
                parallel.multihost.at_step(step + 1)  # its number as logged: names a hung process
                self.state, metrics = self.step.fn(self.state, batch, self.trainable.frozen)
                done = step + 1
                window.add(done, metrics, first=step == start, data_s=data_s)
                if done % cfg.logging.every == 0 or done == t.steps or _due(done, cfg):
                    window.flush(int(self.state.step))
                if done % cfg.checkpoint.every == 0 or done == t.steps:
                    self.log.sync()  # the losses up to the step are on disk before it is
                    self.ckpt.save(self.state, self._meta(done))
                    window.restart()
                if done % t.eval_every == 0 or done == t.steps:
                    val_loss, sample = self._evaluate(done)
                    window.restart()
        return val_loss, sample

    def _evaluation_lost(self, step: int) -> bool:
        """Whether `step`, resumed from, is an evaluation step whose evaluation was never
        logged (the process was killed after the checkpoint, before the evaluation): it is
        run again, as the uninterrupted run ran it. Every process reads the one shared file."""
        t = self.plan.cfg.train
        due = step > 0 and (step % t.eval_every == 0 or step == t.steps)
        logged = (r for r in self.log.read() if r.get("step") == step and "val_loss" in r)
        return self.plan.resume and due and next(logged, None) is None

    def _batch(self, step: int) -> dict:
        t, seq_len = self.plan.cfg.train, self.plan.cfg.seq_len
        vocab, tokens = self.plan.model.vocab_ids, self.plan.data.train

        documents = self.plan.data.train_documents if self.plan.cfg.data.packing else None

        def read(rows):  # positional: tests wrap D.train_batch(tokens, seed, step, *rest)
            return D.train_batch(
                tokens, t.seed, step, t.batch_size, seq_len, t.grad_accum, rows, vocab, documents
            )

        if self.step.mesh is None:
            return read(None)
        # Each host reads only the rows its devices hold (lmjax.parallel.multihost).
        shape = (t.grad_accum, t.batch_size // t.grad_accum, seq_len)
        sharding = parallel.batch_sharding(self.step.mesh, 3, batch_dim=1)
        return parallel.host_batch(read, shape, sharding)

    def _evaluate(self, step: int) -> tuple[float, str | None]:
        params = self.state.params
        val_loss = self.pieces.evaluate(params)
        if parallel.is_main():
            perplexity = math.exp(min(val_loss, 700))
            self.log.append({"step": step, "val_loss": val_loss, "val_perplexity": perplexity})
        sample = self.pieces.sample(params, step)
        if self.plan.cfg.logging.plot and parallel.is_main():
            run = self.plan.run
            plot_losses(self.log.read(), run.plot_file, title=str(run.path))
        return val_loss, sample

    def _save_on_interrupt(self, window: MetricsWindow) -> None:
        """Ctrl-C: log and checkpoint the steps done so far, if they are healthy and whole."""
        state, latest = self.state, self.ckpt.latest_step()
        try:
            if any(leaf.is_deleted() for leaf in jax.tree.leaves(state)):
                raise RuntimeError("interrupted inside a step")  # its input was donated
            step = int(state.step)
            window.flush(step)
            if step > (latest or 0):
                self.ckpt.save(state, self._meta(step))
                latest = step
        except (RuntimeError, NonFiniteError):
            pass
        where = f"checkpoint step {latest}" if latest else "no checkpoint yet"
        self._note(f"interrupted: {self.plan.run.path} has {where}; continue with --resume")

    def _meta(self, step: int) -> dict:
        cfg = self.plan.cfg
        return {
            "config": cfg.to_dict(),
            "model": self.plan.model.to_dict(),
            "data_position": {"seed": cfg.train.seed, "step": step},
            **self.trainable.meta,
        }


def _init_sharded(init, key, shardings):
    """`init(key)` jitted into `shardings`, with the arrays `init` closes over (a full
    fine-tune's base leaves, already laid out on the mesh) passed as arguments: jit would
    otherwise bake them into the program as constants, a copy of the model in the executable
    (and, over several processes, a constant no process holds whole)."""
    closed, shape = jax.make_jaxpr(init, return_shape=True)(key)
    tree = jax.tree.structure(shape)

    def run(k, consts):
        return jax.tree.unflatten(tree, jax.core.eval_jaxpr(closed.jaxpr, consts, k))

    return jax.jit(run, out_shardings=shardings)(key, closed.consts)


def _due(done: int, cfg) -> bool:
    """Metrics are flushed (and health checked) before every evaluation and checkpoint."""
    return done % cfg.train.eval_every == 0 or done % cfg.checkpoint.every == 0


__all__ = ["Pieces", "RunResult", "Step", "Trainable", "Trainer"]
