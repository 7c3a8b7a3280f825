"""TensorBoard event files of a run, read back with TensorBoard's own `EventAccumulator`.

One tiny in-process run (4 steps, checkpoints at 2 and 4), then the crash case of `--resume`:
checkpoint 4 is removed (as if the process died after logging steps 3-4 but before saving 4)
and the run resumes from 2 to 6. TensorBoard must show every step once, with the resumed
run's values, and the same numbers as metrics.jsonl (loss, lr, grad norm, tokens/s, MFU,
data time, validation loss). ~15 s (two compiles of the 2-layer gpt preset).
"""

from __future__ import annotations

import shutil

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lmjax import train
from lmjax.config import RunConfig
from lmjax.train.tensorboard import TAGS

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(200))


def _config(root, **overrides) -> RunConfig:
    base = {
        "model": {"preset": "gpt", "vocab_size": None, "context_length": 16},
        "data": {"corpus": str(root / "corpus.txt"), "tokenizer": "char"},
        "train": {"steps": 4, "batch_size": 2, "seq_len": 8, "eval_every": 2, "eval_batches": 1},
        "checkpoint": {"every": 2},
        "logging": {"every": 1, "progress": False, "plot": False, "sample_tokens": 0},
        "run": {"dir": str(root / "run")},
    }
    base["logging"]["peak_flops"] = 1.0e12
    return RunConfig.from_dict(base, overrides)


def _scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    board = EventAccumulator(str(run_dir / "tensorboard"))
    board.Reload()
    return {tag: [(e.step, e.value) for e in board.Scalars(tag)] for tag in board.Tags()["scalars"]}


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("board")
    (root / "corpus.txt").write_text(TEXT)
    train.train(_config(root), out=open(root / "log1.txt", "w"))
    first = _scalars(root / "run")
    shutil.rmtree(root / "run" / "checkpoints" / "4")
    steps = {"train.steps": 6}
    train.train(_config(root, **steps), resume=True, out=open(root / "log2.txt", "w"))
    return root / "run", first


def test_a_run_writes_its_metrics_as_scalars(resumed_run):
    _, first = resumed_run
    assert [s for s, _ in first["train/loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in first["val/loss"]] == [2, 4]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "train/mfu",
            "train/data_time_s", "val/perplexity"} <= set(first)  # fmt: skip


def test_resume_continues_the_run_without_duplicate_steps(resumed_run):
    run_dir, first = resumed_run
    board = _scalars(run_dir)
    assert [s for s, _ in board["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in board["val/loss"]] == [2, 4, 6]
    records = train.metrics.MetricsLog(run_dir / "metrics.jsonl").read()
    for key, tag in TAGS.items():
        logged = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        shown = board.get(tag, [])
        assert [s for s, _ in shown] == [s for s, _ in logged], tag
        for (_, mine), (_, theirs) in zip(shown, logged, strict=True):
            assert mine == pytest.approx(theirs, rel=1e-6), tag  # float32 in the event file
    # Steps 1-2 are the first run's, untouched; 3-4 were redone from checkpoint 2.
    assert board["train/loss"][:2] == first["train/loss"][:2]


def test_the_tensorboard_switch():
    assert RunConfig.from_dict({"model": {"preset": "gpt"}}).train.tensorboard is True
    off = RunConfig.from_dict({"model": {"preset": "gpt"}}, {"train.tensorboard": False})
    assert off.train.tensorboard is False
