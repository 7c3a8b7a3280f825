"""What the kill benchmarks share (`kill_points.py`, `random_kills.py`): a tiny run that saves a
checkpoint every step (keeping 2, so every save also drops the oldest), evaluates every 3 steps
and logs to TensorBoard; starting it as a real `lmjax train` process (optionally under a
command such as strace); and comparing a run that was killed and resumed with the
uninterrupted one: the final state bit for bit, the logged (step, loss, val_loss), and what
was left behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The runs are CPU runs (workspace's environment); so is reading their checkpoints here, and
# without this a host with libtpu installed probes for a TPU and logs its failure.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
TEXT = "".join(
    f"Sonnet {i}: shall I compare thee to a summer's day, {i % 7}?\n" for i in range(300)
)
STEPS = 8
CONFIG = """
model: {{preset: gpt, vocab_size: null, context_length: 16, dropout: 0.1}}
data: {{corpus: {corpus}, tokenizer: char}}
optimizer: {{name: adamw, lr: 0.01}}
schedule: {{warmup_steps: 2, decay_steps: {steps}}}
train: {{steps: {steps}, batch_size: 4, seq_len: 16, eval_every: 3, eval_batches: 1,
        tensorboard: true}}
checkpoint: {{every: 1, keep: 2}}
logging: {{every: 1, progress: false, plot: false, sample_tokens: 4, sample_prompt: S,
          peak_flops: 1.0e+12}}
"""
# Names a killed writer leaves: orbax's unfinished step, a dropped step being removed, and the
# hidden `.NAME.<16 hex>.tmp` of lmjax.files.
TEMPORARY_MARKS = (".orbax-checkpoint-tmp", ".dropped", ".tmp")


def workspace(root: Path, jax_cache: Path | None = None, steps: int = STEPS) -> dict:
    """Write the corpus and `tiny.yaml` under `root`; the environment of every run there."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "corpus.txt").write_text(TEXT)
    (root / "tiny.yaml").write_text(CONFIG.format(corpus=root / "corpus.txt", steps=steps))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XDG_CACHE_HOME=str(root / "cache"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if "JAX_COMPILATION_CACHE_DIR" not in env:
        env["JAX_COMPILATION_CACHE_DIR"] = str(jax_cache or root / "jax-cache")
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def train_command(run: Path, resume: bool, prefix: tuple = ()) -> list[str]:
    """`lmjax train tiny.yaml run.dir=RUN [--resume]`, behind `prefix` (e.g. strace)."""
    args = ["train", "tiny.yaml", f"run.dir={run}", *(["--resume"] if resume else [])]
    return [*prefix, sys.executable, "-m", "lmjax", *args]


def start(root: Path, env: dict, run: Path, resume: bool, prefix: tuple = ()):
    """The training process, started (stdout and stderr to RUN.log beside the run)."""
    log = open(run.parent / f"{run.name}.log", "a")  # noqa: SIM115 - closed with the process
    cmd = train_command(run, resume, prefix)
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)


def run_to_end(root: Path, env: dict, run: Path, resume: bool, timeout: float = 600) -> int:
    """Run training to its end (or failure); the exit status."""
    proc = start(root, env, run, resume)
    try:
        return proc.wait(timeout)
    finally:
        proc.kill()
        proc.wait()


def kill_after(root: Path, env: dict, run: Path, resume: bool, delay: float) -> int:
    """Start training and SIGKILL it after `delay` seconds (unless it ended first); its exit
    status (-9 when killed)."""
    proc = start(root, env, run, resume)
    deadline = time.monotonic() + delay
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(min(0.005, max(0.0, deadline - time.monotonic())))
    if proc.poll() is None:
        proc.kill()
    return proc.wait()


def temporaries(run: Path) -> list[str]:
    """What a killed writer left anywhere under `run` (by name, see TEMPORARY_MARKS)."""
    found = []
    for path in run.rglob("*"):
        if any(mark in path.name for mark in TEMPORARY_MARKS):
            found.append(str(path.relative_to(run)))
    return sorted(found)


def started(run: Path) -> bool:
    """Whether a killed run left anything to continue (else it is started afresh)."""
    return run.is_dir() and any(run.iterdir())


def in_a_save(run: Path) -> bool:
    """Whether a save was under way when the process died: an unfinished or dropped step."""
    ckpts = run / "checkpoints"
    names = [p.name for p in ckpts.iterdir()] if ckpts.is_dir() else []
    return any(".orbax-checkpoint-tmp" in n or n.endswith(".dropped") for n in names)


class Reference:
    """The uninterrupted run's final state and losses; `differences(run)` names what differs."""

    def __init__(self, run: Path):
        self.state, self.losses = final_state(run), losses(run)

    def differences(self, run: Path) -> list[str]:
        import jax
        import numpy as np

        out = []
        try:
            state = final_state(run)
        except Exception as err:  # noqa: BLE001 - any failure to read is a difference
            return [f"final state unreadable: {type(err).__name__}: {err}"]
        leaves = zip(jax.tree.leaves(state), jax.tree.leaves(self.state), strict=True)
        if not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in leaves):
            out.append("final state differs")
        if losses(run) != self.losses:
            out.append(f"losses differ: {losses(run)} != {self.losses}")
        return out


def final_state(run: Path):
    """The newest checkpoint's TrainState of `run`."""
    import jax

    from lmjax import train
    from lmjax.train import optim
    from lmjax.train.checkpoint import Checkpoints
    from lmjax.train.step import init_state

    cfg = train.runs.read_config(run)
    model, (tx, _) = cfg.model_config(), optim.from_config(cfg)
    abstract = jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), model, tx))
    return Checkpoints(run / "checkpoints", create=False).restore(abstract)


def losses(run: Path) -> list[tuple]:
    """(step, loss, val_loss) of every record in RUN/metrics.jsonl, in file order."""
    from lmjax import train

    records = train.metrics.MetricsLog(run / "metrics.jsonl").read()
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in records]
