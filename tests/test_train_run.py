"""`lmjax train` end to end: run directories, exact resume across processes, atomic saves,
the non-finite stop, and every bad input of the training issue (one line, exit 2, nothing
overwritten)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from _runs import assert_same_state, losses

from lmjax import cli, models, train
from lmjax import data as pipeline
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
logging: {{every: 1, progress: false, plot: false, sample_tokens: 0, sample_prompt: S,
          peak_flops: 1.0e+12}}
"""
# plot: false: only the straight run's loss.png is read (it turns the plot on); drawing it cost
# each other run about 1 s of CPU (matplotlib's import and two figures a run).


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


@pytest.fixture(scope="module")
def straight(workspace):
    """8 steps in one process: the reference every interrupted run must reproduce exactly."""
    done = lmjax(
        workspace, "train", "tiny.yaml", "run.dir=straight", "logging.sample_tokens=6",
        "logging.plot=true",
    )  # fmt: skip
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
    done = lmjax(workspace, "train", "tiny.yaml", "run.dir=resumed", "--resume")
    assert "resumed resumed from step 4" in done.stdout  # said, on stdout
    assert_same_state(final_state(workspace / "resumed"), final_state(straight))
    assert losses(workspace / "resumed") == losses(straight)  # every step logged once


# Killed as the run starts: its directory, metrics.jsonl and checkpoints/ made, config.yaml not
# yet written (the moment before `loop.publish`).
KILL_BEFORE_CONFIG = """
import os, signal
from lmjax.train import loop
loop.publish = lambda plan, trainable: os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_run_killed_while_starting_restarts_with_or_without_resume(workspace, straight):
    """Neither `--resume` nor a fresh start refuses what such a kill leaves (each used to point
    at the other); both run the whole run in it, as the straight run did, saying so once."""
    killed = lmjax(
        workspace, "train", "tiny.yaml", "run.dir=starting", check=False, prelude=KILL_BEFORE_CONFIG
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    left = {p.name for p in (workspace / "starting").iterdir()}
    assert left == {"checkpoints", "metrics.jsonl", "tensorboard"}, left  # as issue 45 found
    shutil.copytree(workspace / "starting", workspace / "starting_again")
    for directory, resume in (("starting", ("--resume",)), ("starting_again", ())):
        done = lmjax(workspace, "train", "tiny.yaml", f"run.dir={directory}", *resume)
        said = [line for line in done.stderr.splitlines() if "stopped while it started" in line]
        assert len(said) == 1 and said[0].startswith(f"lmjax: {directory} holds no config.yaml")
        assert_same_state(final_state(workspace / directory), final_state(straight))
        assert losses(workspace / directory) == losses(straight)


@pytest.mark.parametrize("leftover", ["notes.txt", "metrics.jsonl"])
def test_a_directory_with_more_than_a_start_left_is_still_refused(
    workspace, monkeypatch, capsys, leftover
):
    """A file of the user's, or metrics a run logged, is never taken over."""
    directory = workspace / f"not_a_start_{leftover.split('.')[0]}"
    (directory / "checkpoints").mkdir(parents=True)
    (directory / leftover).write_text('{"step": 1, "loss": 2.0}\n')
    before = snapshot(directory)
    for resume in ((), ("--resume",)):
        code, _, err = run_cli(
            workspace, monkeypatch, capsys, "train", "tiny.yaml", f"run.dir={directory}", *resume
        )
        assert code == 2 and err.count("\n") == 1, err
    assert snapshot(directory) == before


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


@pytest.mark.parametrize(
    "lr",
    [
        "1e30",  # finite updates for a step or two, then an overflowing loss
        "3e38",  # the very first update overflows the parameters, the loss before it is finite
    ],
)
def test_non_finite_training_stops_naming_the_step(workspace, lr, monkeypatch, capsys):
    run_dir = workspace / f"nan-{lr}"
    code, _, err = run_cli(
        workspace, monkeypatch, capsys, "train", "tiny.yaml", f"run.dir={run_dir.name}",
        "optimizer.name=sgd", f"optimizer.lr={lr}", "optimizer.clip_norm=null",
        "schedule.warmup_steps=0", "schedule.decay=constant", "checkpoint.every=1",
        "model.dropout=0.0",
    )  # fmt: skip
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "train step" in lines[0] and "Traceback" not in err
    failed = int(lines[0].split("train step ")[1].split(":")[0])
    steps = Checkpoints(run_dir / "checkpoints", create=False).steps()
    assert steps == list(range(1, failed))
    if steps:
        assert f"checkpoint (step {failed - 1}) is the last good one" in lines[0]
        state = final_state(run_dir)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))
    else:
        assert "before saving any checkpoint" in lines[0]


def test_eval_prints_the_runs_validation_loss(workspace, straight, monkeypatch, capsys):
    code, out, _ = run_cli(workspace, monkeypatch, capsys, "eval", "straight")
    assert code == 0
    # Witness: the same fixed validation crops scored by the reference model, softmax in numpy.
    run = train.load_run(straight)
    (prepared,) = (workspace / "cache/lmjax/data").iterdir()
    val = np.fromfile(prepared / "val.bin", np.uint16)
    scores = []
    for i in range(2):  # eval_batches 2 of micro-batch 4 / grad_accum 2 = 2 sequences of 16
        x, y = pipeline.eval_batch(val, 0, i, 2, 16).values()
        logits = np.asarray(models.forward(run.params, x, run.model.replace(ops="reference")))
        logits = logits.astype(np.float64) - logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        scores.append(-np.take_along_axis(logp, y[..., None], -1).mean())
    assert f"validation loss {np.mean(scores):.4f}" in out and "step 8" in out
    assert "(char tokenizer)" in out


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
    forward = jax.jit(models.forward)  # one compile: a fixed C-long buffer (causal: the
    for _ in range(6):  # zeros after the current position cannot change its logits)
        buffer = np.zeros((1, run.model.context_length), np.int32)
        buffer[0, : len(ids)] = ids
        logits = forward(run.params, buffer, run.model)
        ids.append(int(np.argmax(logits[0, len(ids) - 1])))
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
        # larger than the corpus's characters is a padded embedding (tests/test_padded_vocab.py)
        (["tiny.yaml", "model.vocab_size=5", "run.dir=x3"], "at most model.vocab_size = 5"),
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
    config = (straight / "config.yaml").read_text()
    (foreign / "config.yaml").write_text(
        config.replace("preset: gpt", "preset: gpt\n  n_layers: 3")
    )
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


HELP_COMMANDS = ("prepare", "train", "eval", "generate", "import-hf", "export-hf", "inspect",
                 "gradcheck")  # fmt: skip


def test_help_everywhere(capsys):
    # The real entry point once (`python -m lmjax` in a fresh process) ...
    done = subprocess.run(
        [sys.executable, "-m", "lmjax", "train", "--help"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0 and "usage: lmjax train" in done.stdout, textwrap.shorten(
        done.stderr, 300
    )
    # ... and every command's help in-process: the parser is the same, a process each costs
    # seconds of imports.
    for command in HELP_COMMANDS:
        with pytest.raises(SystemExit) as exited:
            cli.main([command, "--help"])
        out = capsys.readouterr().out
        assert exited.value.code == 0 and "usage: lmjax " + command in out, (command, out[:300])


INTERRUPT_AT_STEP_5 = """
from lmjax.data import prepared as data
_batch = data.train_batch
def train_batch(tokens, seed, step, *args):
    if step == 5:
        raise KeyboardInterrupt  # as if Ctrl-C arrived while the sixth batch was being cut
    return _batch(tokens, seed, step, *args)
data.train_batch = train_batch
"""


def test_ctrl_c_saves_the_steps_done_and_resume_matches(workspace, straight):
    done = lmjax(
        workspace, "train", "tiny.yaml", "run.dir=interrupted", check=False,
        prelude=INTERRUPT_AT_STEP_5,
    )  # fmt: skip
    assert done.returncode == 130 and "checkpoint step 5" in done.stderr
    assert Checkpoints(workspace / "interrupted/checkpoints", create=False).steps() == [2, 4, 5]
    assert "Traceback" not in done.stderr
    lmjax(workspace, "train", "tiny.yaml", "run.dir=interrupted", "--resume")
    assert_same_state(final_state(workspace / "interrupted"), final_state(straight))
    assert losses(workspace / "interrupted") == losses(straight)


def test_extending_a_run_keeps_its_schedule(workspace, straight, monkeypatch, capsys):
    # The straight run pinned decay_steps 8; resuming to 10 steps continues at the final lr.
    shutil.copytree(straight, workspace / "extended")
    code, _, err = run_cli(
        workspace, monkeypatch, capsys, "train", "tiny.yaml", "run.dir=extended", "--resume",
        "train.steps=10",
    )  # fmt: skip
    assert code == 0, err
    lrs = {
        r["step"]: r["lr"]
        for r in train.metrics.MetricsLog(workspace / "extended/metrics.jsonl").read()
        if "lr" in r
    }
    # By the schedule's equation: u = (s - 2) / (8 - 2) is capped at 1, so lr = end = peak / 10.
    assert lrs[9] == pytest.approx(0.01 * 0.1, rel=1e-5) and lrs[10] == pytest.approx(
        0.001, rel=1e-5
    )
    assert load_run_config(workspace / "extended/config.yaml").schedule.decay_steps == 8
    code, _, err = run_cli(
        workspace, monkeypatch, capsys, "train", "tiny.yaml", "run.dir=extended", "--resume",
        "train.steps=6",
    )  # fmt: skip
    assert code == 2 and "train.steps on resume = 6" in err


def test_resume_accepts_a_model_override_equal_to_the_runs(
    workspace, straight, monkeypatch, capsys
):
    code, _, err = run_cli(
        workspace, monkeypatch, capsys, "train", "tiny.yaml", "run.dir=straight", "--resume",
        "model.n_layers=2",
    )  # fmt: skip
    assert code == 0, err  # nothing to do: the run is at its last step


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["data.val_fraction=0.0005", "run.dir=y1"], "validation split of"),
        (["logging.sample_tokens=4", "logging.sample_prompt=ZQ", "run.dir=y2"],
         "logging.sample_prompt = 'ZQ'"),
        (["logging.sample_tokens=16", "run.dir=y3"], "logging.sample_tokens = 16"),
        (["train.seed=-1", "run.dir=y4"], "train.seed = -1"),
        (["data.dir=corpus.txt", "run.dir=y5"], "meta.json"),
        (["run.dir=corpus.txt/sub"], "corpus.txt is a file"),
    ],
)  # fmt: skip
def test_problems_found_before_training_starts(workspace, monkeypatch, capsys, args, message):
    code, _, err = run_cli(workspace, monkeypatch, capsys, "train", "tiny.yaml", *args)
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not any((workspace / f"y{i}").exists() for i in range(1, 6))


def test_a_corrupt_run_config_is_one_line(workspace, straight, monkeypatch, capsys):
    broken = workspace / "broken"
    shutil.copytree(straight, broken)
    (broken / "config.yaml").write_text("model: [unclosed\n")
    for args in (["train", "tiny.yaml", "run.dir=broken", "--resume"], ["eval", "broken"]):
        code, _, err = run_cli(workspace, monkeypatch, capsys, *args)
        assert code == 2 and "config.yaml" in err and err.count("\n") == 1, err


def test_eval_and_generate_flags(workspace, straight, monkeypatch, capsys):
    cases = [
        (["eval", "straight", "--batches", "0"], "--batches = 0"),
        (["eval", "straight/checkpoints/4", "--step", "6"], "--step = 6"),
        (["eval", "straight", "--seq-len", "17"], "--seq-len = 17"),
        (["generate", "--run", "straight", "--prompt", "S", "--max-new-tokens", "0"],
         "--max-new-tokens = 0"),
        (["generate", "--run", "straight", "--prompt", "S", "--max-new-tokens", "16"],
         "--max-new-tokens = 16"),
        (["generate", "--run", "straight", "--prompt", "Sonnet 1: shall I"],
         "--prompt = '17 tokens'"),
        (["generate", "--run", "straight", "--prompt", ""], "--prompt = ''"),
    ]  # fmt: skip
    for args, message in cases:
        code, out, err = run_cli(workspace, monkeypatch, capsys, *args)
        assert code == 2 and message in err and out == "", (args, err)
    code, out, _ = run_cli(workspace, monkeypatch, capsys, "eval", "straight", "--batches", "1")
    assert code == 0 and "over 1 batches of 2 x 16 tokens" in out


def test_truncating_samples_keeps_earlier_steps(tmp_path):
    path = tmp_path / "samples.txt"
    path.write_text("===== step 4 =====\nab\n\n===== step 8 =====\ncd\n\n===== step 12 =====\nx\n")
    train.sampling.truncate_samples(path, 8)
    assert path.read_text() == "===== step 4 =====\nab\n\n===== step 8 =====\ncd\n\n"


def test_generate_command_batches_and_pages(workspace, straight, monkeypatch, capsys):
    args = ["generate", "--run", "straight", "--max-new-tokens", "5", "--temperature", "0"]
    code, batched, _ = run_cli(
        workspace, monkeypatch, capsys, *args, "--prompt", "Sonnet", "--prompt", "S"
    )
    assert code == 0
    for prompt in ("Sonnet", "S"):
        code, alone, _ = run_cli(
            workspace, monkeypatch, capsys, *args, "--prompt", prompt, "--cache", "paged"
        )
        assert code == 0 and f"--- {prompt!r}\n{alone}" in batched  # same text, batched or not


def test_a_run_shorter_than_its_warmup_runs_on_the_warmup_ramp(workspace, capsys, monkeypatch):
    """`train.steps` at most the warmup, with the decay length left to the run (the issue's
    `lmjax train configs/tiny-shakespeare.yaml train.steps=3` under 50 warmup steps): the run
    trains, one line says the learning rate stays on the warmup ramp, and every step's lr is
    the ramp's `lr (s + 1) / W` (worked out here from the config, not read from lmjax)."""
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("XDG_CACHE_HOME", str(workspace / "cache"))
    argv = ["train", "tiny.yaml", "run.dir=short", "train.steps=3", "train.eval_every=3"]
    argv += ["schedule.warmup_steps=50", "schedule.decay_steps=null", "checkpoint.every=3"]
    assert cli.main(argv) == 0, capsys.readouterr().err[-2000:]
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "warmup ramp" in line]
    assert len(notes) == 1 and "train.steps = 3 <= schedule.warmup_steps = 50" in notes[0], err
    metrics = (workspace / "short/metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in metrics]
    lrs = {row["step"]: row["lr"] for row in rows if "lr" in row}
    assert sorted(lrs) == [1, 2, 3], lrs
    for step, lr in lrs.items():  # metrics count steps from 1: step n is update s = n - 1
        assert lr == pytest.approx(0.01 * step / 50, rel=1e-6), (step, lr)
