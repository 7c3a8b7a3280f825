"""Every `lmjax` command under bad invocations (issue 12, SPEC sections 10 and 11).

Each case runs `lmjax.cli.main` in-process (no JAX import per case) and must: exit 2 (a returned
2, or SystemExit(2) for a usage error argparse finds), print exactly one stderr line that starts
`lmjax`, says `error:`, names the offending value and carries a `Fix:`, print nothing on stdout,
and leave every file and directory under the workspace as it was (names, kinds, sizes, sha256:
tests/_snapshot.py), the data cache included. One subprocess proves the real exit status and
stderr of the installed entry point. `lmjax finetune` has its own module (test_bad_finetune.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _bad_input import assert_one_line_error, run_main, tiny_weights_run
from _snapshot import assert_unchanged, tree_snapshot

ROOT = Path(__file__).resolve().parents[1]
TRAIN_CONFIG = """model: {{preset: gpt, vocab_size: null, context_length: 16, d_model: 32,
  n_heads: 4, n_layers: 1, d_ff: 64}}
data: {{corpus: {corpus}, tokenizer: char}}
schedule: {{warmup_steps: 0}}
train: {{steps: 2, batch_size: 2, eval_every: 1, eval_batches: 1}}
logging: {{progress: false, sample_tokens: 0, plot: false}}
"""


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A workspace: a tiny weights-only char run (`base`, context 16, vocabulary CHARS), a
    corpus, a train config, a plain file; the data cache lives inside it."""
    root = tmp_path_factory.mktemp("badcli")
    tiny_weights_run(root / "base")
    (root / "corpus.txt").write_text("abc defg hab\n" * 200)
    (root / "tiny.yaml").write_text(TRAIN_CONFIG.format(corpus=root / "corpus.txt"))
    (root / "afile").write_text("not a directory\n")
    (root / "cache").mkdir()
    return root


# (argv, text the one stderr line must contain); paths are relative to the workspace.
CASES = {
    # generate
    "generate: run path missing": (["generate", "--run", "nowhere", "--prompt", "ab"],
                                   "run path = 'nowhere'"),
    "generate: a file as the run": (["generate", "--run", "afile", "--prompt", "ab"],
                                    "run path = 'afile'"),
    "generate: a file as checkpoint": (["generate", "--checkpoint", "afile", "--prompt", "ab"],
                                       "run path = 'afile'"),
    "generate: --max-new-tokens 0": (["generate", "--run", "base", "--prompt", "ab",
                                      "--max-new-tokens", "0"], "--max-new-tokens = 0"),
    "generate: --max-new-tokens -3": (["generate", "--run", "base", "--prompt", "ab",
                                       "--max-new-tokens", "-3"], "--max-new-tokens = -3"),
    "generate: --max-new-tokens huge": (["generate", "--run", "base", "--prompt", "ab",
                                         "--max-new-tokens", "99999999"], "= 99999999"),
    "generate: --max-new-tokens abc": (["generate", "--run", "base", "--prompt", "ab",
                                        "--max-new-tokens", "abc"], "invalid int value: 'abc'"),
    "generate: --temperature -1": (["generate", "--run", "base", "--prompt", "ab",
                                    "--temperature", "-1"], "temperature = -1.0"),
    "generate: --temperature nan": (["generate", "--run", "base", "--prompt", "ab",
                                     "--temperature", "nan"], "temperature = nan"),
    "generate: --temperature inf": (["generate", "--run", "base", "--prompt", "ab",
                                     "--temperature", "inf"], "temperature = inf"),
    "generate: sampling checked before loading": (["generate", "--run", "nowhere", "--prompt",
                                                   "ab", "--top-p", "0"], "top_p = 0.0"),
    "generate: --top-p 0": (["generate", "--run", "base", "--prompt", "ab", "--top-p", "0"],
                            "top_p = 0.0"),
    "generate: --top-p 1.5": (["generate", "--run", "base", "--prompt", "ab", "--top-p", "1.5"],
                              "top_p = 1.5"),
    "generate: --top-p nan": (["generate", "--run", "base", "--prompt", "ab", "--top-p", "nan"],
                              "top_p = nan"),
    # (--top-k 0 is not here: 0 switches top-k off, Hugging Face's convention; `Sampling`.)
    "generate: --top-k -2": (["generate", "--run", "base", "--prompt", "ab", "--top-k", "-2"],
                             "top_k = -2"),
    "generate: --top-k > vocab": (["generate", "--run", "base", "--prompt", "ab", "--top-k",
                                   "1000"], "top_k = 1000; expected <= vocab_size = 10"),
    "generate: prompt outside vocab": (["generate", "--run", "base", "--prompt", "aXb"],
                                       "character = 'X'"),
    "generate: empty prompt": (["generate", "--run", "base", "--prompt", ""], "--prompt = ''"),
    "generate: one of two prompts empty": (["generate", "--run", "base", "--prompt", "ab",
                                            "--prompt", ""], "--prompt = ''"),
    "generate --chat: a char run has no chat template": (["generate", "--run", "base", "--chat",
                                                          "--prompt", "ab"], "chat template"),
    # chat
    "chat: run path missing": (["chat", "nowhere", "--message", "ab"], "nowhere"),
    "chat: a char run has no chat template": (["chat", "base", "--message", "ab"],
                                              "char tokenizer without a chat template"),
    "chat: --temperature -1 before loading": (["chat", "nowhere", "--temperature", "-1"],
                                              "temperature"),
    "generate: prompt past context": (["generate", "--run", "base", "--prompt", "abcdefgh" * 3],
                                      "--prompt = '24 tokens'"),
    "generate: prompt fills context": (["generate", "--run", "base", "--prompt", "abcdefgh" * 2],
                                       "--prompt = '16 tokens'"),
    "generate: stop token past vocab": (["generate", "--run", "base", "--prompt", "ab",
                                         "--stop-token", "10"], "stop_tokens[0] = 10"),
    "generate: negative stop token": (["generate", "--run", "base", "--prompt", "ab",
                                       "--stop-token", "-1"], "stop_tokens[0] = -1"),
    "generate: seed past int64": (["generate", "--run", "base", "--prompt", "ab", "--seed",
                                   str(2**70)], f"seed = {2**70}"),
    "generate: --step on weights-only": (["generate", "--run", "base", "--prompt", "ab",
                                          "--step", "3"], "--step = 3"),
    "generate: --cache ring": (["generate", "--run", "base", "--prompt", "ab", "--cache", "ring"],
                               "invalid choice: 'ring'"),
    "generate: --quantize int8": (["generate", "--run", "base", "--prompt", "ab", "--quantize",
                                   "int8"], "invalid choice: 'int8'"),
    "generate: --run and --checkpoint": (["generate", "--run", "base", "--checkpoint", "base",
                                          "--prompt", "ab"], "not allowed with argument --run"),
    "generate: no source": (["generate", "--prompt", "ab"], "--run --checkpoint is required"),
    "generate: no prompt": (["generate", "--run", "base"], "required: --prompt"),
    "generate: an override": (["generate", "--run", "base", "--prompt", "ab", "model.n_layers=3"],
                              "unrecognized arguments: model.n_layers=3"),
    "generate: unknown flag": (["generate", "--run", "base", "--prompt", "ab", "--bogus"],
                               "unrecognized arguments: --bogus"),
    # eval
    "eval: run path missing": (["eval", "nowhere"], "run path = 'nowhere'"),
    "eval: a file as the run": (["eval", "afile"], "run path = 'afile'"),
    "eval: --step on weights-only": (["eval", "base", "--step", "5"], "--step = 5"),
    "eval: checkpoints/STEP of weights-only": (["eval", "base/checkpoints/3"], "= 3"),
    "eval: --step conflicts with the path": (["eval", "base/checkpoints/3", "--step", "4"],
                                             "--step = 4"),
    "eval: --batches 0": (["eval", "base", "--batches", "0"], "--batches = 0"),
    "eval: --batch-size -1": (["eval", "base", "--batch-size", "-1"], "--batch-size = -1"),
    "eval: --seq-len past context": (["eval", "base", "--seq-len", "999"], "--seq-len = 999"),
    "eval: --seq-len 0": (["eval", "base", "--seq-len", "0"], "--seq-len = 0"),
    # export-hf / import-hf
    "export-hf: run path missing": (["export-hf", "nowhere", "--out", "hf"],
                                    "run path = 'nowhere'"),
    "export-hf: --out is a file": (["export-hf", "base", "--out", "afile"], "--out = 'afile'"),
    "export-hf: --out exists": (["export-hf", "base", "--out", "base"], "--out = 'base'"),
    "export-hf: --step on weights-only": (["export-hf", "base", "--out", "hf", "--step", "4"],
                                          "--step = 4"),
    "export-hf: no --out": (["export-hf", "base"], "required: --out"),
    "import-hf: source missing": (["import-hf", "nowhere", "--out", "imp"], "'nowhere'"),
    "import-hf: a text file": (["import-hf", "corpus.txt", "--out", "imp"], "corpus.txt"),
    "import-hf: a tiny file": (["import-hf", "afile", "--out", "imp"], "afile"),
    "import-hf: a model id the cache lacks": (["import-hf", "lmjax-no-such-org/no-such-model",
                                               "--out", "imp"], "pass --download"),
    "import-hf: lmjax weights, no config.json": (["import-hf", "base/model.safetensors", "--out",
                                                  "imp"], "base/config.json = 'missing'"),
    # inspect
    "inspect: unknown preset": (["inspect", "gpt5"], "model preset = 'gpt5'"),
    "inspect: n_layers=0": (["inspect", "gpt", "n_layers=0"], "model.n_layers = 0"),
    "inspect: unknown field": (["inspect", "gpt", "n_layer=2"], "'n_layer'"),
    "inspect: override without =": (["inspect", "gpt", "n_layers"], "override = 'n_layers'"),
    "inspect: override without key": (["inspect", "gpt", "=3"], "override = '=3'"),
    "inspect: --batch-size 0": (["inspect", "gpt", "--batch-size", "0"], "--batch-size = 0"),
    "inspect: --seq-len past context": (["inspect", "gpt", "--seq-len", "100000"],
                                        "--seq-len = 100000"),
    "inspect: --mesh data=0": (["inspect", "gpt", "--mesh", "data=0"], "--mesh.data = 0"),
    "inspect: --mesh junk": (["inspect", "gpt", "--mesh", "bogus"], "'bogus'"),
    "inspect: --lora r=0": (["inspect", "gpt", "--lora", "r=0"], "lora.r = 0"),
    "inspect: --lora targets nothing": (["inspect", "gpt", "--lora", "targets=*.nothing"],
                                        "lora target = '*.nothing'"),  # printed a table first
    "inspect: --lora r past the layers": (["inspect", "gpt", "--lora", "r=100"], "lora.r = 100"),
    "inspect: config --lora r past the layers": (["inspect", "tiny.yaml", "model.vocab_size=10",
                                                  "--lora", "r=100"], "lora.r = 100"),
    "inspect: --lora alpha=abc": (["inspect", "gpt", "--lora", "alpha=abc"], "lora.alpha = 'abc'"),
    "inspect: config missing": (["inspect", "nowhere.yaml"], "config file = 'nowhere.yaml'"),
    "inspect: config bad value": (["inspect", "tiny.yaml", "train.steps=-1"],
                                  "train.steps = -1"),
    "inspect: config unknown section": (["inspect", "tiny.yaml", "bogus.key=1"], "'bogus'"),
    "inspect: config key without section": (["inspect", "tiny.yaml", "n_layers=1"],
                                            "override key = 'n_layers'"),
    # prepare
    "prepare: corpus missing": (["prepare", "--corpus", "nope.txt", "--out", "p"],
                                "data.corpus = 'nope.txt'"),
    "prepare: corpus glob matches nothing": (["prepare", "--corpus", "no/*.jsonl", "--out", "p"],
                                             "data.corpus = 'no/*.jsonl'"),
    "prepare: --out is a file": (["prepare", "--corpus", "corpus.txt", "--out", "afile"],
                                 "'afile'"),
    "prepare: --out is a run": (["prepare", "--corpus", "corpus.txt", "--out", "base"], "'base'"),
    "prepare: --val-fraction 0": (["prepare", "--corpus", "corpus.txt", "--out", "p",
                                   "--val-fraction", "0"], "data.val_fraction = 0.0"),
    "prepare: --val-fraction nan": (["prepare", "--corpus", "corpus.txt", "--out", "p",
                                     "--val-fraction", "nan"], "data.val_fraction = nan"),
    "prepare: --vocab-size without bpe": (["prepare", "--corpus", "corpus.txt", "--out", "p",
                                           "--vocab-size", "300"], "data.vocab_size = 300"),
    "prepare: bpe vocab too small": (["prepare", "--corpus", "corpus.txt", "--out", "p",
                                      "--tokenizer", "bpe", "--vocab-size", "3"],
                                     "vocab_size = 3"),
    "prepare: unknown tokenizer": (["prepare", "--tokenizer", "word"], "invalid choice: 'word'"),
    # train
    "train: config missing": (["train", "nowhere.yaml"], "config file = 'nowhere.yaml'"),
    "train: a directory as config": (["train", "."], "config file = '.'"),
    "train: a text file as config": (["train", "afile"], "config = 'not a directory'"),
    "train: steps=0": (["train", "tiny.yaml", "train.steps=0"], "train.steps = 0"),
    "train: unknown key": (["train", "tiny.yaml", "train.stepz=3"], "train key = 'stepz'"),
    "train: unknown section": (["train", "tiny.yaml", "trian.steps=3"], "'trian'"),
    "train: override without =": (["train", "tiny.yaml", "train.steps"], "'train.steps'"),
    "train: override without key": (["train", "tiny.yaml", "=5"], "override = '=5'"),
    "train: empty section": (["train", "tiny.yaml", ".x=5"], "override section = ''"),
    "train: empty field": (["train", "tiny.yaml", "model.=5"], "override key = 'model.'"),
    "train: inf learning rate": (["train", "tiny.yaml", "optimizer.lr=1e999"],
                                 "optimizer.lr = inf"),
    "train: steps past int32": (["train", "tiny.yaml", "train.steps=9999999999"],
                                "train.steps = 9999999999"),
    "train: existing run without --resume": (["train", "tiny.yaml", "run.dir=base"],
                                             "run directory = 'base'"),
    "train: run.dir is a file": (["train", "tiny.yaml", "run.dir=afile"], "'afile'"),
    "train: --resume of nothing": (["train", "tiny.yaml", "run.dir=newrun", "--resume"],
                                   "run directory to resume = 'newrun'"),
    # bench, gradcheck, the top level
    "bench: --steps 0": (["bench", "tiny.yaml", "--steps", "0"], "--steps = 0"),
    "bench: --peak-tflops -1": (["bench", "tiny.yaml", "--peak-tflops", "-1"],
                                "--peak-tflops = -1.0"),
    "bench: --peak-tflops inf": (["bench", "tiny.yaml", "--peak-tflops", "inf"],
                                 "--peak-tflops = inf"),
    "bench: config missing": (["bench", "nowhere.yaml"], "config file = 'nowhere.yaml'"),
    "bench: unknown section": (["bench", "tiny.yaml", "bad.key=1"], "'bad'"),
    "bench: vocabulary left to the data": (["bench", "tiny.yaml"], "model.vocab_size = None"),
    "bench: --output under a file": (["bench", "tiny.yaml", "model.vocab_size=10", "--output",
                                      "afile/x.json"], "--output = 'afile/x.json'"),
    "bench: --output is a directory": (["bench", "tiny.yaml", "model.vocab_size=10", "--output",
                                        "base"], "--output = 'base'"),
    "gradcheck: no op matches": (["gradcheck", "--ops", "nope"], "--ops = 'nope'"),
    "gradcheck: --seed x": (["gradcheck", "--seed", "x"], "invalid int value: 'x'"),
    "no command": ([], "required: COMMAND"),
    "unknown command": (["frobnicate"], "invalid choice: 'frobnicate'"),
}  # fmt: skip


@pytest.mark.parametrize("argv, named", list(CASES.values()), ids=list(CASES))
def test_bad_invocation_is_one_line_exit_2_and_writes_nothing(ws, capsys, monkeypatch, argv,
                                                              named):  # fmt: skip
    before = tree_snapshot(ws)
    assert_one_line_error(*run_main(ws, argv, capsys, monkeypatch), named)
    assert_unchanged(ws, before)


def test_the_real_entry_point_exits_2_with_one_line(ws):
    """`python -m lmjax` in a fresh process: exit status 2, one stderr line, no traceback,
    nothing on stdout, nothing written (argparse's SystemExit(2) is Python's exit status 2)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(ws / "cache"))
    before = tree_snapshot(ws)
    done = subprocess.run(
        [sys.executable, "-m", "lmjax", "generate", "--run", "base", "--prompt", "ab", "--top-p",
         "2"], cwd=ws, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("lmjax generate: error: top_p = 2.0; expected a float in (0, 1]")
    assert_unchanged(ws, before)
