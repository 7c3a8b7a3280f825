"""Fixes that can be followed (issue 47, items 4 and 5): a fix line names only what the same
command accepts, and a typo is named with its nearest spelling.

Witnesses, each the user's command run in-process (`lmjax.cli.main`) on a tiny char base
(context 16):
- `lmjax finetune recipe.yaml`, a config whose train.seq_len is 1024 as the Llama recipes' is,
  on the shorter base trains on 16-token sequences, saying so in one `note:` line; a
  train.seq_len given on the command line is refused with a fix (`train.seq_len=16 or less`)
  that the command then accepts, never `raise model.context_length` (a fine-tune keeps the
  base's architecture).
- `lmjax inspect` of a fine-tune config with a --seq-len past the base: `lower it`, not `raise
  context_length`.
- a bad JSON-lines record's fix names `data.skip_bad=true` (train has no --skip-bad), a bad
  data.eot's names `data.eot=auto` and prepare's `--eot auto`, the one prepare accepts.
- typos: `finetune.bsae` names the key and suggests `base` in one line; `trian.steps` lists the
  sections the command reads (`finetune` and `lora` for a fine-tune config); `--qlroa` points at
  `lmjax finetune --help` and suggests `--qlora`; a JSON-lines record cut inside a string says
  the string is unterminated, with its file and line, once.

Cost: one fine-tune of one step (~20-30 s on the shared 2-core machine: marked slow); the rest
fail before any compilation, a second or less each.
"""

from __future__ import annotations

import pytest
import yaml
from _bad_input import assert_one_line_error, run_main, tiny_weights_run

FINETUNE = """finetune: {{base: base, qlora: false}}
lora: {{r: 2, alpha: 4}}
data: {{corpus: {corpus}, tokenizer: char}}
schedule: {{warmup_steps: 0}}
train: {{steps: 1, batch_size: 2, seq_len: {seq_len}, eval_every: 1, eval_batches: 1}}
logging: {{progress: false, sample_tokens: 0, plot: false}}
run: {{compile_cache: false}}
"""
TRAIN = """model: {{preset: gpt, vocab_size: null, context_length: 16, d_model: 32, n_heads: 4,
  n_layers: 1, d_ff: 64}}
data: {{corpus: {corpus}, tokenizer: byte}}
train: {{steps: 1, batch_size: 2}}
logging: {{progress: false, sample_tokens: 0, plot: false}}
"""
PREPARE = ["prepare", "--tokenizer", "byte", "--quiet", "--corpus"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """base (a weights-only char run, context 16), corpus.txt, ft.yaml (a fine-tune of base),
    train.yaml (a byte-level run), bad and cut JSON-lines files; the data cache inside."""
    root = tmp_path_factory.mktemp("fixlines")
    tiny_weights_run(root / "base")
    (root / "corpus.txt").write_text("abc defg hab\n" * 200)
    (root / "ft.yaml").write_text(FINETUNE.format(corpus=root / "corpus.txt", seq_len=8))
    # As the Llama recipes (lmjax finetune --recipe llama-lora): train.seq_len 1024.
    (root / "recipe.yaml").write_text(FINETUNE.format(corpus=root / "corpus.txt", seq_len=1024))
    (root / "docs.jsonl").write_text('{"text": "abc"}\n{"text": "abc\n')  # cut inside a string
    (root / "train.yaml").write_text(TRAIN.format(corpus=root / "docs.jsonl"))
    (root / "ok.jsonl").write_text('{"text": "abc"}\n{"text": "defg"}\n')
    # An SFT record, then one cut inside its content: the line ends inside the string.
    cut = '{"prompt": "ab", "completion": "cd"}\n{"prompt": "ab", "completion": "cd hab de\n'
    (root / "cut.jsonl").write_text(cut)
    (root / "cache").mkdir()
    return root


@pytest.mark.slow  # a fine-tune of one step: compile, the step, an evaluation, merged/ written
def test_the_recipe_fits_its_seq_len_to_a_shorter_base_and_says_so(ws, capsys, monkeypatch):
    argv = ["finetune", "recipe.yaml", "run.dir=runs/fitted"]
    code, out, err = run_main(ws, argv, capsys, monkeypatch)
    assert code == 0, err
    note = "note: train.seq_len = 1024 > the base's context_length = 16: fine-tuning on 16-token"
    assert [line for line in err.splitlines() if "train.seq_len" in line] == [f"{note} sequences"]
    config = yaml.safe_load((ws / "runs" / "fitted" / "config.yaml").read_text())
    assert config["train"]["seq_len"] == 16
    assert "run directory: runs/fitted (step 1)" in out


def test_a_seq_len_given_past_the_base_is_refused_with_a_fix_it_accepts(ws, capsys, monkeypatch):
    argv = ["finetune", "recipe.yaml", "train.seq_len=1024"]
    code, out, err = run_main(ws, argv, capsys, monkeypatch)
    assert_one_line_error(code, out, err, "train.seq_len = 1024")
    assert "Fix: pass train.seq_len=16 or less, or leave it out" in err
    assert "model.context_length" not in err.partition("Fix:")[2]
    # Following the fix: the same config loads (inspect reads it as finetune does).
    argv = ["inspect", "recipe.yaml", "train.seq_len=16"]
    code, out, err = run_main(ws, argv, capsys, monkeypatch)
    assert code == 0 and err == "", err
    # The fix the refusal used to give is refused by the same command.
    argv = ["finetune", "recipe.yaml", "model.context_length=1024"]
    code, out, err = run_main(ws, argv, capsys, monkeypatch)
    assert_one_line_error(code, out, err, "model field = 'context_length'")


def test_inspect_of_a_finetune_config_past_the_base_says_lower_it(ws, capsys, monkeypatch):
    code, out, err = run_main(ws, ["inspect", "ft.yaml", "--seq-len", "100"], capsys, monkeypatch)
    assert_one_line_error(code, out, err, "--seq-len = 100")
    assert "the base's context_length = 16. Fix: lower it." in err and "raise" not in err


def test_a_bad_record_in_train_names_the_setting_train_accepts(ws, capsys, monkeypatch):
    code, out, err = run_main(ws, ["train", "train.yaml"], capsys, monkeypatch)
    assert_one_line_error(code, out, err, f"record {ws / 'docs.jsonl'}:2")
    assert "Fix: fix or remove the record, or skip malformed records: data.skip_bad=true " in err
    assert "(lmjax prepare and finetune: --skip-bad)" in err
    code, out, err = run_main(ws, ["train", "train.yaml", "--skip-bad"], capsys, monkeypatch)
    assert_one_line_error(code, out, err, "unrecognized arguments: --skip-bad")


@pytest.mark.parametrize(
    "argv",
    [
        [*PREPARE, "ok.jsonl", "--out", "p", "--eot", "<x>"],
        ["train", "train.yaml", "data.corpus=ok.jsonl", "data.eot=<x>"],
    ],
)
def test_a_bad_eot_names_the_spelling_of_each_command(ws, capsys, monkeypatch, argv):
    code, out, err = run_main(ws, argv, capsys, monkeypatch)
    assert_one_line_error(code, out, err, "data.eot = '<x>'")
    assert err.endswith("Fix: use data.eot=auto (lmjax prepare: --eot auto).\n"), err
    if argv[0] == "prepare":  # which takes the spelling its fix names
        argv = [*PREPARE, "ok.jsonl", "--out", "prepared", "--eot", "auto"]
        code, out, err = run_main(ws, argv, capsys, monkeypatch)
        assert code == 0 and out.startswith("prepared prepared"), err


TYPOS = {
    "finetune.bsae": (
        ["finetune", "ft.yaml", "finetune.bsae=base"],
        "finetune key = 'bsae'; expected one of ['base', 'qlora', 'full', 'freeze', 'data']. "
        "Fix: did you mean 'base'? Else remove it.",
    ),
    "trian.steps": (
        ["finetune", "ft.yaml", "trian.steps=3"],
        "override section = 'trian'; expected one of ['model', 'optimizer', 'schedule', 'data', "
        "'train', 'run', 'checkpoint', 'logging', 'parallel', 'finetune', 'lora']. "
        "Fix: did you mean 'train'? Else remove it.",
    ),
    "train.stesp": (
        ["finetune", "ft.yaml", "train.stesp=3"],
        "train key = 'stesp'; expected one of [",
    ),
    "train: trian.steps": (
        ["train", "train.yaml", "trian.steps=3"],
        "'logging', 'parallel']. Fix: did you mean 'train'? Else remove it.",
    ),
    "lora.trgets": (
        ["finetune", "ft.yaml", "lora.trgets=[q_proj]"],
        "lora key = 'trgets'; expected one of [",
    ),
    "--qlroa": (
        ["finetune", "ft.yaml", "--qlroa"],
        "lmjax finetune: error: unrecognized arguments: --qlroa (did you mean --qlora?). "
        "Fix: see `lmjax finetune --help` (usage: lmjax finetune [-h]",
    ),
}


@pytest.mark.parametrize("case", sorted(TYPOS))
def test_a_typo_is_named_with_its_nearest_spelling(ws, capsys, monkeypatch, case):
    argv, said = TYPOS[case]
    code, out, err = run_main(ws, argv, capsys, monkeypatch)
    assert_one_line_error(code, out, err, said)
    assert "template" not in err and "{base:" not in err, err
    if case == "lora.trgets":
        assert err.endswith("Fix: did you mean 'targets'? Else remove it.\n"), err


def test_a_yaml_section_typo_lists_the_finetune_sections(ws, capsys, monkeypatch):
    (ws / "typo.yaml").write_text((ws / "ft.yaml").read_text() + "trian: {steps: 2}\n")
    code, out, err = run_main(ws, ["finetune", "typo.yaml"], capsys, monkeypatch)
    assert_one_line_error(code, out, err, "config section = 'trian'")
    assert "'parallel', 'finetune', 'lora']. Fix: did you mean 'train'?" in err


@pytest.mark.parametrize(
    ("argv", "where"),
    [
        (["finetune", "ft.yaml", "--data", "cut.jsonl"], "cut.jsonl:2"),
        ([*PREPARE, "docs.jsonl", "--out", "p"], "docs.jsonl:2"),
    ],
)
def test_a_record_cut_inside_a_string_says_it_is_unterminated(ws, capsys, monkeypatch, argv, where):
    code, out, err = run_main(ws, argv, capsys, monkeypatch)
    column = 32 if argv[0] == "finetune" else 10  # where the cut string opens
    reason = (
        f"invalid JSON (unterminated string opened at column {column}: the line ends inside it)"
    )
    assert_one_line_error(code, out, err, f"{where} = '{reason}'")
    assert " at at " not in err and err.count("unterminated") == 1
