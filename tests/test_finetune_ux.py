"""Fine-tuning as a user lives with it (issue 47 items 3, 6 and 7), on one QLoRA fine-tune run
as docs/fine-tuning.md says: from a directory outside the checkout holding `runs/llama` (a tiny
chat Llama saved by `transformers`, imported by `lmjax import-hf`) and `chat.jsonl`, with
`lmjax finetune --recipe llama-qlora`, under umask 022.

Witnesses:
- the shipped recipe runs by name from any directory, its paths read from there; a wrong name,
  or a name and a CONFIG, is one line;
- every file the import, the fine-tune (checkpoints, adapters, merged/, samples, the SFT data
  cache) and the export wrote is 0644, every directory 0755 (tests/test_file_modes.py).

The run's overrides keep it small (2 steps, rows of 64 tokens) and make its sample
deterministic: greedy, a learning rate of 1e-12 (the adapters stay at their init, B = 0, so the
model is the NF4 base), and the user message `_llama_run` built the head to answer with
<|im_end|> EOS_STEP tokens in.

Cost: one fine-tune (compile, 2 steps, an evaluation, a sample), about 20 s on the loaded
2-core machine; the other commands a few seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest
import yaml
from _file_modes import assert_modes, umask
from _llama_run import CHAT_PROMPT, EOS_STEP, hf_checkpoint

from lmjax import cli

COLORS = ("quick", "brown", "red")
RECORDS = 40  # val_fraction 0.05: two held out
RUN = "runs/llama-qlora"  # the recipe's run.dir
SMALL = [
    "train.steps=2",
    "train.seq_len=64",
    "train.eval_batches=2",
    "optimizer.lr=1e-12",
    f"logging.sample_chat={CHAT_PROMPT[0]['content']}",
    "logging.sample_temperature=0",
]


def _records() -> str:
    lines = []
    for i in range(RECORDS):
        w = COLORS[i % 3]
        chat = [{"role": "user", "content": f"What does the {w} fox do?"}]
        chat.append({"role": "assistant", "content": f"The {w} fox jumps over dog {i}."})
        lines.append(json.dumps({"messages": chat}) + "\n")
    return "".join(lines)


def main(*argv: str) -> tuple[int, str, str]:
    """`lmjax ARGV` in-process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


@dataclasses.dataclass(frozen=True)
class Workspace:
    root: Path  # the user's directory: hf/, chat.jsonl, runs/llama, runs/llama-qlora, exported/
    finetuned: tuple[int, str, str]  # the fine-tune's (exit code, stdout, stderr)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """The directory the user works in (and the working directory of the module's tests), after
    import-hf, `finetune --recipe llama-qlora` and export-hf under umask 022."""
    root = tmp_path_factory.mktemp("user")
    hf_checkpoint(root / "hf", chat=True, context=256)
    (root / "chat.jsonl").write_text(_records())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root / "cache"))
        patch.chdir(root)
        with umask(0o022):
            assert main("import-hf", "hf", "--out", "runs/llama")[0] == 0
            finetuned = main("finetune", "--recipe", "llama-qlora", *SMALL)
            assert finetuned[0] == 0, finetuned[2][-2000:]
            assert main("export-hf", RUN, "--out", "exported")[0] == 0
        yield Workspace(root, finetuned)


# ---- item 6: a recipe by name, from any directory -----------------------------------------------


def test_recipe_by_name_runs_with_paths_of_the_current_directory(ws):
    assert not (ws.root / "configs").exists()  # no checkout here
    spec = yaml.safe_load((ws.root / RUN / "finetune.yaml").read_text())
    assert spec["finetune"]["base"] == "runs/llama" and spec["finetune"]["qlora"] is True
    assert spec["finetune"]["base_path"] == str((ws.root / "runs/llama").resolve())
    assert spec["lora"]["r"] == 16 and spec["lora"]["targets"] == ["all-linear"]  # the recipe's
    config = yaml.safe_load((ws.root / RUN / "config.yaml").read_text())
    assert config["data"]["corpus"] == "chat.jsonl"  # finetune.data, read from here
    assert f"run directory: {RUN} (step 2)" in ws.finetuned[1]


@pytest.mark.parametrize(
    "argv,words",
    [
        (
            ["--recipe", "llama"],
            "--recipe = 'llama'; expected one of ['llama-lora', 'llama-qlora']",
        ),
        (["my.yaml", "--recipe", "llama-lora"], "expected one of them, not both"),
        ([], "CONFIG = 'not given (train.steps=1 is an override)'; expected a fine-tune config"),
    ],
)
def test_a_wrong_recipe_or_config_is_one_line(ws, argv, words):
    code, out, err = main("finetune", *argv, "train.steps=1", "run.dir=runs/never")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("lmjax finetune: error: ") and words in err
    assert not (ws.root / "runs/never").exists()


# ---- item 3: file modes -------------------------------------------------------------------------


def test_everything_the_fine_tune_wrote_is_0644_under_umask_022(ws):
    """runs/ (the import and the fine-tune), exported/ and the cache (the SFT data prepared):
    what lmjax wrote, not hf/ or chat.jsonl (the test's)."""
    run = ("finetune.yaml", "config.yaml", "adapters.safetensors", "metrics.jsonl", "samples.txt")
    run += ("loss.png", "checkpoints/2", "merged/model.safetensors", "merged/tokenizer")
    assert_modes(
        ws.root / "runs", 0o022, ("llama/model.safetensors", *(f"llama-qlora/{n}" for n in run))
    )
    assert_modes(
        ws.root / "exported", 0o022, ("config.json", "model.safetensors", "tokenizer.json")
    )
    assert_modes(ws.root / "cache", 0o022, ("lmjax",))


# ---- item 7: quiet or surprising results --------------------------------------------------------

ADAPTERS = 14  # 7 projections in each of 2 blocks
# r (in + out) per adapted layer: q 64+64, k and v 64+32, o 64+64, gate and up 64+128, down 128+64
TRAINABLE = 16 * 1024 * 2


def _tree(root: Path) -> dict[str, tuple[bytes, int]]:
    """{path: (bytes, mtime in ns)} of every file under `root`."""
    files = (p for p in root.rglob("*") if p.is_file())
    return {str(p): (p.read_bytes(), p.stat().st_mtime_ns) for p in files}


def test_resuming_a_finished_fine_tune_says_so_and_changes_nothing(ws):
    before = _tree(ws.root / "runs")
    code, out, err = main("finetune", "--recipe", "llama-qlora", "--resume", *SMALL)
    assert code == 0, err
    said = f"nothing to do: {RUN} is at step 2 and train.steps = 2; nothing was changed"
    assert said in out and f"run directory: {RUN} (step 2)" in out
    assert "validation loss: " in out and "QLoRA:" not in err  # no fine-tune started
    assert _tree(ws.root / "runs") == before  # bytes and mtimes of every file


def test_qlora_says_the_base_is_nf4_when_it_trains_and_decodes(ws):
    lines = [line for line in ws.finetuned[2].splitlines() if line.startswith("QLoRA: ")]
    assert len(lines) == 1, ws.finetuned[2][-2000:]
    assert lines[0].startswith(
        f"QLoRA: {ADAPTERS} adapters (r 16, alpha 32), {TRAINABLE:,} trainable parameters over "
        "runs/llama with its block projections in NF4 ("
    )
    said = f"decoding from {RUN}'s NF4 base with its {ADAPTERS} adapters attached"
    generate = ["generate", "--run", RUN, "--prompt", "The quick", "--max-new-tokens", "2"]
    chat = ["chat", RUN, "--message", "Hi", "--max-new-tokens", "2"]
    for argv in (generate, chat):
        code, _, err = main(*argv)
        assert code == 0 and err.count(said) == 1, (argv, err)
    code, _, err = main(*generate, "--quantize", "none")  # the merged float model: no line
    assert code == 0 and "NF4" not in err, err


def test_inspect_of_a_qlora_run_shows_its_own_adapters(ws):
    code, out, _ = main("inspect", RUN)
    assert code == 0
    assert f"{RUN} (QLoRA fine-tune of runs/llama): " in out
    assert "QLoRA (NF4 base): r=16, alpha=32, scale=2, targets all-linear" in out
    assert f"adapters, trainable ({TRAINABLE:,} params)" in out and "adapter gradients" in out
    assert "adamw state (adapters only)" in out and "NF4 base" in out
    assert "memory estimate" not in out  # the full-training estimate is the base's, below
    code, base, _ = main("inspect", "runs/llama")
    assert code == 0 and "memory estimate" in base and "adapters" not in base


def test_the_training_sample_stops_at_the_end_of_turn_as_chat_does(ws):
    """The sample's reply ends with its first <|im_end|>, after the tokens `lmjax chat` gives
    for the same message on the same run (greedy): the same ids, the stop id last."""
    from lmjax.tokenizers import load

    sample = (ws.root / RUN / "samples.txt").read_text()
    prompt = "<|im_start|>assistant\n"
    reply = sample[sample.index(prompt) + len(prompt) :]
    assert reply.endswith("<|im_end|>\n\n") and reply.count("<|im_end|>") == 1, reply
    message, n = CHAT_PROMPT[0]["content"], "64"  # the recipe's logging.sample_tokens
    argv = ["chat", RUN, "--message", message, "--temperature", "0", "--max-new-tokens", n]
    code, out, _ = main(*argv, "--show-ids")
    assert code == 0
    new = json.loads(next(x for x in out.splitlines() if x.startswith("new ids: "))[9:])
    assert len(new) == EOS_STEP + 1 and new[-1] == load(ws.root / "runs/llama/tokenizer").token_id(
        "<|im_end|>"
    )
    assert reply == load(ws.root / "runs/llama/tokenizer").decode(new) + "\n\n"


def test_eval_says_how_few_records_are_held_out(ws):
    config = yaml.safe_load((ws.root / RUN / "config.yaml").read_text())
    meta = json.loads((Path(config["data"]["dir"]) / "meta.json").read_text())
    assert meta["val_documents"] == 2
    code, out, err = main("eval", RUN)
    assert code == 0, err
    held = f"2 held-out records ({meta['val_tokens']:,} tokens) of chat.jsonl"
    assert f"over 2 batches of 8 x 64 tokens drawn from {held}, which the batches repeat" in out
