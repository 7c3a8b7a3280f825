"""Soak (issue 12): a tiny model trained for 2,400 steps in this process, with a checkpoint every
200 steps (the newest 3 kept) and an evaluation every 400, then the run checked as a whole:
metrics.jsonl complete and in step order, every kept checkpoint whole and loadable, no
temporary directory left, and the process's resident memory flat after warm-up.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from lmjax import cli, train
from lmjax.train.checkpoint import Checkpoints
from lmjax.train.progress import MetricsWindow

STEPS, LOG_EVERY, EVAL_EVERY, CKPT_EVERY, KEEP = 2400, 50, 400, 200, 3
WARM = 800  # RSS is compared from here: two evaluations and four saves have run
# Memory, from step WARM on (RSS sampled in the loop after every logged window of 50 steps):
# - windows without a save or an evaluation: the training steps themselves must not grow it
#   by more than QUIET_TOLERANCE in all (measured: 0). A leak of one training state per step
#   (asserted below to be >= 100 kB here) would add > 100 MB; one metrics record per step
#   (~1.3 kB) ~1.6 MB, about what the tolerance allows, so that one would go unseen.
# - the saves (each with the evaluation that may follow it) may add SAVE_TOLERANCE each on
#   average: measured ~0.5 MiB here. It is orbax/tensorstore's, not lmjax's: 200 bare orbax
#   saves of a 61-array state in one process grew RSS linearly by ~45 kB each (Python objects
#   allocated under orbax's serialization and kept), so a run that saves thousands of times
#   holds more. The mean, not the largest: a leak at every save raises the mean by its size,
#   while the allocator takes memory from the system in steps, so one save window of a large
#   process can show a step the next ones do not (a whole-suite process of 2.9 GB on jax
#   0.12.0.1: one save +1.5 MiB, 4.6 MiB over the whole run, 0.6 MiB a save).
QUIET_TOLERANCE = 2 << 20
SAVE_TOLERANCE = 3 << 19  # 1.5 MiB

CONFIG = f"""
model: {{preset: gpt, vocab_size: null, context_length: 16, d_model: 32, n_heads: 2,
        n_layers: 1, d_ff: 64, dropout: 0.0}}
data: {{corpus: CORPUS, tokenizer: char}}
optimizer: {{name: adamw, lr: 0.003}}
schedule: {{warmup_steps: 20}}
train: {{steps: {STEPS}, batch_size: 4, seq_len: 8, eval_every: {EVAL_EVERY}, eval_batches: 2}}
checkpoint: {{every: {CKPT_EVERY}, keep: {KEEP}}}
logging: {{every: {LOG_EVERY}, progress: false, plot: false, sample_tokens: 0,
          peak_flops: 1.0e+12}}
"""


def rss_bytes() -> int:
    """This process's resident set size, from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="RSS is read from /proc")
def test_soak_thousands_of_steps(tmp_path, monkeypatch):
    text = "".join(f"line {i}: the quick brown fox jumps over {i % 13} dogs\n" for i in range(400))
    (tmp_path / "corpus.txt").write_text(text)
    (tmp_path / "soak.yaml").write_text(CONFIG.replace("CORPUS", str(tmp_path / "corpus.txt")))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    run = tmp_path / "soak"

    samples: list[tuple[int, int]] = []  # (step, RSS) after each logged window, in the loop
    flush = MetricsWindow.flush

    def sampled(self, state_step):
        flush(self, state_step)
        samples.append((state_step, rss_bytes()))

    monkeypatch.setattr(MetricsWindow, "flush", sampled)
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(["train", str(tmp_path / "soak.yaml"), f"run.dir={run}"])
    seconds = time.perf_counter() - start
    assert code == 0

    # metrics.jsonl: every line JSON; a training record every LOG_EVERY steps and an
    # evaluation every EVAL_EVERY, each once, in step order; all finite.
    lines = (run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    trained = [r["step"] for r in records if "loss" in r]
    evaluated = [r["step"] for r in records if "val_loss" in r]
    assert trained == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert evaluated == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    steps = [r["step"] for r in records]
    assert steps == sorted(steps)
    assert all(math.isfinite(r.get("loss", r.get("val_loss"))) for r in records)
    losses = [r["loss"] for r in records if "loss" in r]
    assert np.mean(losses[-5:]) < np.mean(losses[:5])  # it learned

    # Checkpoints: the newest KEEP, whole (no temporary directory), each loads.
    directory = run / "checkpoints"
    kept = list(range(STEPS - (KEEP - 1) * CKPT_EVERY, STEPS + 1, CKPT_EVERY))
    assert Checkpoints(directory, create=False).steps() == kept
    assert sorted(p.name for p in directory.iterdir()) == sorted(map(str, kept))
    for step in kept:
        loaded = train.load_run(run, step=step)
        assert loaded.step == step
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(loaded.params))

    # Memory: flat across training steps from WARM on; bounded per save (see the top).
    state_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(loaded.params)) * 3  # + Adam
    assert state_bytes >= 100_000
    assert [s for s, _ in samples] == trained
    quiet, saves = 0, []
    for (_, before), (step, after) in zip(samples, samples[1:], strict=False):
        if step - LOG_EVERY < WARM:
            continue
        if (step - LOG_EVERY) % CKPT_EVERY == 0:  # this window began with a save (+ an eval)
            saves.append(after - before)
        else:
            quiet += max(0, after - before)
    series = ", ".join(f"{s}:{r / 2**20:.1f}" for s, r in samples)
    assert quiet <= QUIET_TOLERANCE, f"RSS grew {quiet / 2**20:.1f} MiB over steps: {series}"
    per_save = sum(saves) / len(saves)
    assert per_save <= SAVE_TOLERANCE, f"saves added {per_save / 2**20:.2f} MiB each: {series}"
    warm = dict(samples)[WARM]
    end = samples[-1][1]
    print(
        f"soak: {STEPS} steps in {seconds:.1f} s; RSS {warm / 2**20:.1f} MiB at step {WARM}, "
        f"{end / 2**20:.1f} at the end: {quiet / 2**20:.1f} over training steps, "
        f"{per_save / 2**20:.2f} per save (at most {max(saves) / 2**20:.2f})"
    )
