"""`lmjax train` end to end: run directories, exact resume across processes, atomic saves,
the non-finite stop, and every bad input of the training issue (one line, exit 2, nothing
overwritten)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from lmjax import cli, models, train
from lmjax.config import load_run_config
from lmjax.train import optim
from lmjax.train.checkpoint import Checkpoints
from lmjax.train.step import init_state

ROOT = Path(__file__).parent.parent
TEXT = "".join(
    f"Sonnet {i}: shall I compare thee to a summer's day, {i % 7}?\n" for i in range(300)
)

CONFIG = """
model: {{preset: gpt, vocab_size: null, context_length: 16, dropout: 0.1}}
data: {{corpus: {corpus}, tokenizer: char}}
optimizer: {{name: adamw, lr: 0.01}}
schedule: {{warmup_steps: 2, decay_steps: 8}}
train: {{steps: 8, batch_size: 4, seq_len: 16, grad_accum: 2, eval_every: 4, eval_batches: 2}}
checkpoint: {{every: 2, keep: 10}}
logging: {{every: 1, progress: false, sample_tokens: 0, sample_prompt: S, peak_flops: 1.0e+12}}
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    (root / "corpus.txt").write_text(TEXT)
    (root / "tiny.yaml").write_text(CONFIG.format(corpus=root / "corpus.txt"))
    return root


def lmjax(root: Path, *args: str, check: bool = True, prelude: str = ""):
    """Run the CLI in a fresh process (with `prelude` executed first)."""
    env = dict(os.environ, XDG_CACHE_HOME=str(root / "cache"), PYTHONPATH=str(ROOT))
    code = f"{prelude}\nimport sys\nfrom lmjax.cli import main\nsys.exit(main({list(args)!r}))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )
    if check and done.returncode != 0:
        raise AssertionError(f"lmjax {args} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done


def final_state(run_dir: Path, step: int | None = None):
    cfg = train.runs.read_config(run_dir)
    model = cfg.model_config()
    tx, _ = optim.from_config(cfg)
    abstract = jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), model, tx))
    return Checkpoints(run_dir / "checkpoints", create=False).restore(abstract, step)


def assert_same_state(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def losses(run_dir: Path) -> list[tuple]:
    records = train.metrics.MetricsLog(run_dir / "metrics.jsonl").read()
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in records]


@pytest.fixture(scope="module")
def straight(workspace):
    """8 steps in one process: the reference every interrupted run must reproduce exactly."""
    done = lmjax(workspace, "train", "tiny.yaml", "run.dir=straight", "logging.sample_tokens=6")
    assert "validation loss:" in done.stdout and "run directory: straight" in done.stdout
    assert "loss.png: straight/loss.png" in done.stdout and "sample:\nS" in done.stdout
    return workspace / "straight"


def test_run_directory_contents(straight):
    names = {p.name for p in straight.iterdir()}
    assert names >= {"config.yaml", "metrics.jsonl", "loss.png", "checkpoints", "tokenizer"}
    assert (straight / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert Checkpoints(straight / "checkpoints", create=False).steps() == [2, 4, 6, 8]
    records = train.metrics.MetricsLog(straight / "metrics.jsonl").read()
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 9))
    for r in records:
        if "loss" in r:
            assert {"lr", "grad_norm", "tokens_per_s", "mfu"} <= set(r)
    # The first step of a process compiles: timed apart, not counted in tokens/s.
    assert records[0]["tokens_per_s"] is None and records[0]["first_step_s"] > 0
    assert all(r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in records[1:] if "loss" in r)
    assert [r["step"] for r in records if "val_loss" in r] == [4, 8]
    samples = (straight / "samples.txt").read_text()
    assert samples.count("===== step ") == 2 and "===== step 8 =====\nS" in samples
    assert load_run_config(straight / "config.yaml").model["vocab_size"] == len(set(TEXT))


def test_resume_in_a_new_process_is_bit_exact(workspace, straight):
    lmjax(workspace, "train", "tiny.yaml", "run.dir=resumed", "train.steps=4")
    assert Checkpoints(workspace / "resumed/checkpoints", create=False).steps() == [2, 4]
    lmjax(workspace, "train", "tiny.yaml", "run.dir=resumed", "--resume")
    assert_same_state(final_state(workspace / "resumed"), final_state(straight))
    assert losses(workspace / "resumed") == losses(straight)  # every step logged once


KILL_DURING_STEP_4_SAVE = """
import os, signal
from orbax.checkpoint._src.path import atomicity
_finalize = atomicity.AtomicRenameTemporaryPath.finalize
async def finalize(self, *args, **kwargs):
    # Every file of step 4 is written; only the rename that publishes it is left.
    if self._final_path.name == "4":
        os.kill(os.getpid(), signal.SIGKILL)
    return await _finalize(self, *args, **kwargs)
atomicity.AtomicRenameTemporaryPath.finalize = finalize
"""


def test_a_save_killed_midway_leaves_the_previous_checkpoint(workspace, straight):
    done = lmjax(
        workspace,
        "train",
        "tiny.yaml",
        "run.dir=killed",
        check=False,
        prelude=KILL_DURING_STEP_4_SAVE,
    )
    assert done.returncode == -9
    ckpts = Checkpoints(workspace / "killed/checkpoints", create=False)
    assert ckpts.steps() == [2]
    assert any(p.name.startswith("4.") for p in ckpts.directory.iterdir())  # the torn save
    assert_same_state(final_state(workspace / "killed", 2), final_state(straight, 2))
    lmjax(workspace, "train", "tiny.yaml", "run.dir=killed", "--resume")
    assert_same_state(final_state(workspace / "killed"), final_state(straight))


def test_non_finite_loss_stops_naming_the_step(workspace):
    done = lmjax(
        workspace,
        "train",
        "tiny.yaml",
        "run.dir=nan",
        "optimizer.name=sgd",
        "optimizer.lr=1e30",
        "optimizer.clip_norm=null",
        "schedule.warmup_steps=0",
        "checkpoint.every=1",
        "model.dropout=0.0",
        check=False,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "train step" in lines[0] and "NonFinite" not in lines[0]
    failed = int(lines[0].split("train step ")[1].split(":")[0])
    steps = Checkpoints(done_dir := workspace / "nan/checkpoints", create=False).steps()
    assert failed >= 2 and steps and max(steps) == failed - 1
    assert f"checkpoint (step {failed - 1})" in lines[0]
    state = final_state(done_dir.parent)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))


def test_eval_prints_the_runs_validation_loss(workspace, straight):
    done = lmjax(workspace, "eval", "straight")
    expected = [v for _, _, v in losses(straight) if v is not None][-1]
    assert f"validation loss {expected:.4f}" in done.stdout and "step 8" in done.stdout


def test_generate_command_continues_greedily(workspace, straight, monkeypatch, capsys):
    code, out, _ = run_cli(
        workspace,
        monkeypatch,
        capsys,
        "generate",
        "--run",
        "straight",
        "--prompt",
        "Sonnet",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0",
    )
    assert code == 0
    # Witness: greedy argmax of the full forward pass, one token at a time, no cache.
    run = train.load_run(straight)
    ids = run.tokenizer.encode("Sonnet")
    for _ in range(6):
        logits = models.forward(run.params, np.asarray([ids], np.int32), run.model)
        ids.append(int(np.argmax(logits[0, -1])))
    assert out == run.tokenizer.decode(ids) + "\n"


# ---- bad input, in-process: one line on stderr, exit 2, nothing written --------------------


def run_cli(workspace, monkeypatch, capsys, *args):
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("XDG_CACHE_HOME", str(workspace / "cache"))
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(directory: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tiny.yaml", "train.stepz=3"], "train key = 'stepz'"),
        (["tiny.yaml", "optimizer.lr=-1"], "optimizer.lr = -1.0"),
        (["missing.yaml"], "config file = 'missing.yaml'"),
        (["tiny.yaml", "data.corpus=nowhere.txt", "run.dir=x1"], "data.corpus = 'nowhere.txt'"),
        (["tiny.yaml", "data.corpus=empty.txt", "run.dir=x2"], "empty file"),
        (["tiny.yaml", "model.vocab_size=50", "run.dir=x3"], "model.vocab_size = 50"),
        (["tiny.yaml", "data.dir=baddata", "run.dir=x4"], "meta.json"),
        (["tiny.yaml", "run.dir=nothere", "--resume"], "run directory to resume = 'nothere'"),
    ],
)
def test_bad_training_input(workspace, monkeypatch, capsys, args, message):
    (workspace / "empty.txt").write_text("")
    (workspace / "baddata").mkdir(exist_ok=True)
    code, _, err = run_cli(workspace, monkeypatch, capsys, "train", *args)
    assert code == 2 and message in err and err.count("\n") == 1 and "Fix:" in err
    assert not any((workspace / d).exists() for d in ("x1", "x2", "x3", "x4", "nothere"))


def test_existing_run_without_resume_is_refused_untouched(workspace, straight, monkeypatch, capsys):
    before = snapshot(straight)
    code, _, err = run_cli(workspace, monkeypatch, capsys, "train", "tiny.yaml", "run.dir=straight")
    assert code == 2 and "--resume" in err and "nothing was overwritten" in err
    assert snapshot(straight) == before


def test_resume_with_another_architecture_is_refused(workspace, straight, monkeypatch, capsys):
    before = snapshot(straight)
    code, _, err = run_cli(
        workspace,
        monkeypatch,
        capsys,
        "train",
        "tiny.yaml",
        "run.dir=straight",
        "--resume",
        "model.n_layers=3",
    )
    assert code == 2 and "model.n_layers on resume = 3" in err
    assert snapshot(straight) == before


def test_checkpoint_from_another_architecture_is_refused(workspace, straight, monkeypatch, capsys):
    foreign = workspace / "foreign"
    foreign.mkdir()
    config = (straight / "config.yaml").read_text().replace("n_layers", "d_ff")
    (foreign / "config.yaml").write_text(
        config.replace("preset: gpt", "preset: gpt\n  n_layers: 3")
    )
    import shutil

    shutil.copytree(straight / "checkpoints", foreign / "checkpoints")
    code, _, err = run_cli(workspace, monkeypatch, capsys, "eval", "foreign")
    assert code == 2 and "different architecture" in err and "n_layers=2 (expected 3)" in err


def test_prepare_and_inspect_commands(workspace, monkeypatch, capsys):
    code, out, _ = run_cli(
        workspace,
        monkeypatch,
        capsys,
        "prepare",
        "--corpus",
        "corpus.txt",
        "--out",
        "prep",
        "--quiet",
    )
    assert code == 0 and "prepared prep" in out and "char tokenizer" in out
    code, out, _ = run_cli(workspace, monkeypatch, capsys, "inspect", "tiny.yaml")
    assert code == 0 and "adamw state" in out and "batch 2, sequence 16" in out
    code, _, err = run_cli(workspace, monkeypatch, capsys, "prepare", "--corpus", "nope.txt")
    assert code == 2 and "data.corpus = 'nope.txt'" in err


def test_help_everywhere():
    for command in ("prepare", "train", "eval", "inspect"):
        done = subprocess.run(
            [sys.executable, "-m", "lmjax", command, "--help"],
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        assert done.returncode == 0 and "usage: lmjax " + command in done.stdout, textwrap.shorten(
            done.stderr, 300
        )
