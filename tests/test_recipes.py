"""The fine-tuning recipes for imported models (`lmjax finetune --recipe llama-lora` and
`llama-qlora`, shipped in lmjax/finetune/recipes/, issue 34 item 3), Alpaca records, and resuming
an SFT run.

Witnesses:
- the recipes run as written from a directory laid out as docs/fine-tuning.md says (runs/llama
  from `lmjax import-hf` of a tiny chat Llama, chat.jsonl beside it), overriding only
  train.steps and train.seq_len: adapters on all seven projections of every block, bfloat16
  compute, the SFT records from the config, an evaluation, and a sample whose prompt is
  transformers' `apply_chat_template(..., add_generation_prompt=True)` of the configured user
  message.
- Alpaca records: ids and masks against transformers' `apply_chat_template` of the documented
  conversation (user = instruction + "\\n\\n" + input, assistant = output), and without a chat
  template against `tok(prompt) + tok(completion, add_special_tokens=False) + eos`.
- an SFT run resumed without --data: one line whose command then resumes it ("resumed ... from
  step N" on stdout).

Cost: three fine-tunes of a 2-layer, 64-wide model (compile, a few steps, an evaluation and a
64-token sample each; about a minute each on the shared 2-core machine).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from _llama_run import hf_checkpoint
from transformers import PreTrainedTokenizerFast

from lmjax import cli
from lmjax.config import DataConfig
from lmjax.data import sft, sft_records
from lmjax.errors import FileFormatError
from lmjax.finetune import recipe_path
from lmjax.io import safetensors
from lmjax.params import flatten
from lmjax.tokenizers import load_hf_tokenizer

DOCS = Path(__file__).resolve().parents[1] / "docs"
RECIPES = {"lora": recipe_path("llama-lora"), "qlora": recipe_path("llama-qlora")}
SHORT = ["train.steps=2", "train.seq_len=64"]  # the only changes to the recipes
COLORS = ("quick", "brown", "red")
EOS_IDS = (0, 2)  # <|endoftext|>, <|im_end|>: _llama_run's generation_config.json


def _records() -> list[dict]:
    """Chat records, every fourth an Alpaca one (with and without input)."""
    out = []
    for i in range(24):
        w, answer = COLORS[i % 3], f"The {COLORS[i % 3]} fox jumps over the lazy dog number {i}."
        if i % 4 == 3:
            out.append({"instruction": f"Describe fox {i}.", "input": "" if i % 8 == 3 else w,
                        "output": answer})  # fmt: skip
        else:
            chat = [{"role": "user", "content": f"What does the {w} fox do?"}]
            out.append({"messages": [*chat, {"role": "assistant", "content": answer}]})
    return out


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """The walk-through's directory: hf/ (a tiny chat Llama), runs/llama (imported), chat.jsonl;
    the working directory and a private cache for the module's tests."""
    root = tmp_path_factory.mktemp("recipes")
    hf_checkpoint(root / "hf", chat=True, context=256)
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root / "cache"))
        patch.chdir(root)
        assert cli.main(["import-hf", "hf", "--out", "runs/llama"]) == 0
        yield root


def _transformers(ws) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(ws / "hf"))


def test_alpaca_records_through_the_chat_template_and_without(ws):
    theirs = _transformers(ws)
    ours = load_hf_tokenizer(ws / "runs/llama/tokenizer")
    eot = sft_records.end_of_text(ours, "auto")
    for record in _records()[3:12:4]:  # input "" and input "brown"
        ids, mask = sft_records.encode_record(ours, record, eot)
        user = record["instruction"] + (f"\n\n{record['input']}" if record["input"] else "")
        chat = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": record["output"]},
        ]
        want = theirs.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        assert ids == want
        assert theirs.decode([i for i, m in zip(ids, mask, strict=True) if m]) == (
            record["output"] + "<|im_end|>\n"
        )
    plain = ws / "plain"  # the same tokenizer.json, no tokenizer_config.json: no template
    plain.mkdir()
    (plain / "tokenizer.json").write_text((ws / "hf/tokenizer.json").read_text())
    ours = load_hf_tokenizer(plain)
    eot = sft_records.end_of_text(ours, "auto")
    assert eot == theirs.convert_tokens_to_ids("<|endoftext|>")
    record = {"instruction": "Describe it.", "input": "the dog", "output": "It sleeps."}
    ids, mask = sft_records.encode_record(ours, record, eot)
    prompt = theirs("Describe it.\n\nthe dog\n\n")["input_ids"]
    completion = theirs("It sleeps.", add_special_tokens=False)["input_ids"] + [eot]
    assert ids == prompt + completion and mask == [0] * len(prompt) + [1] * len(completion)


BAD_ALPACA = [
    ('{"instruction": 3, "output": "x"}', "'instruction' is int"),
    ('{"instruction": "x", "input": ["y"], "output": "z"}', "'input' is list"),
    ('{"instruction": "x", "output": ""}', "'output' is an empty string"),
    ('{"instruction": "", "input": "y", "output": "z"}', "'instruction' is an empty string"),
    ('{"input": "y", "output": "z"}', "fields ['input', 'output']"),
    (
        '{"instruction": "x", "output": "z", "extra": 1}',
        "fields ['extra', 'instruction', 'output']",
    ),
]


@pytest.mark.parametrize("line,reason", BAD_ALPACA, ids=[r for _, r in BAD_ALPACA])
def test_bad_alpaca_record_names_file_and_line(ws, tmp_path, line, reason):
    path = tmp_path / "bad.jsonl"
    good = [json.dumps(r) for r in _records()[:3]]
    path.write_text("\n".join([*good[:2], line, good[2]]) + "\n")
    d = DataConfig(dir=str(tmp_path / "out"), tokenizer="gpt2")
    with pytest.raises(FileFormatError) as err:
        sft.prepare(d, path, 64, ws / "runs/llama/tokenizer")
    assert f"{path}:3" in str(err.value) and reason in str(err.value)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


def test_bad_record_from_the_command_line_is_one_line(ws, capfd):
    bad = ws / "bad.jsonl"
    bad.write_text(json.dumps(_records()[0]) + "\n" + '{"instruction": "x", "output": 7}\n')
    argv = ["finetune", str(RECIPES["lora"]), "--data", "bad.jsonl", "run.dir=runs/bad", *SHORT]
    assert cli.main(argv) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lmjax finetune: error:")
    assert "bad.jsonl:2" in err[0] and "'output' is int" in err[0]
    assert not (ws / "runs/bad").exists()


def test_the_walk_through_shows_the_recipes_as_run_here():
    """docs/fine-tuning.md's lines: what the tests below run (they add SHORT only)."""
    text = (DOCS / "fine-tuning.md").read_text()
    assert "lmjax import-hf ~/models/SmolLM2-135M-Instruct --out runs/llama" in text
    for kind, recipe in RECIPES.items():
        assert re.search(rf"^lmjax finetune --recipe {recipe.stem} +# ", text, re.M), kind
        config = yaml.safe_load(recipe.read_text())
        assert config["finetune"]["base"] == "runs/llama"
        assert config["finetune"]["data"] == "chat.jsonl"
        assert config["run"]["dir"] == f"runs/llama-{kind}"


def _run(ws, kind: str, capfd) -> tuple[Path, str]:
    assert cli.main(["finetune", "--recipe", f"llama-{kind}", *SHORT]) == 0  # as docs say
    return ws / f"runs/llama-{kind}", capfd.readouterr().out


@pytest.mark.slow  # about a minute each: compile, 2 steps, an evaluation, a 64-token sample
@pytest.mark.parametrize("kind", sorted(RECIPES))
def test_recipe_runs_as_written_on_an_imported_chat_llama(ws, capfd, kind):
    run, out = _run(ws, kind, capfd)
    spec = yaml.safe_load((run / "finetune.yaml").read_text())
    assert spec["finetune"]["qlora"] == (kind == "qlora")
    assert spec["lora"]["targets"] == ["all-linear"]
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["model"]["dtype"] == "bfloat16"
    assert config["data"]["corpus"] == "chat.jsonl" and sft.is_sft_dir(config["data"]["dir"])
    adapters = flatten(safetensors.load(run / "adapters.safetensors"))
    layers = {".".join(name.split(".")[:-1]) for name in adapters}
    projections = [f"attention.{p}" for p in ("query", "key", "value", "output")]
    projections += [f"feed_forward.{p}" for p in ("gate", "up", "down")]
    assert layers == {f"blocks.{p}" for p in projections}  # each stacked over both blocks
    assert all(leaf.shape[0] == 2 for leaf in adapters.values())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [2]
    assert all(0 < r["real_token_fraction"] < 1 for r in rows if "loss" in r)
    recipe = yaml.safe_load(RECIPES[kind].read_text())["logging"]
    chat = [{"role": "user", "content": recipe["sample_chat"]}]
    prompt = _transformers(ws).apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    samples = (run / "samples.txt").read_text()
    assert samples.startswith(f"===== step 2 =====\n{prompt}")
    assert f"sample:\n{prompt}" in out and f"run directory: runs/llama-{kind} (step 2)" in out
    # The walk-through's chat line on the fine-tune: transformers' rendering of the turn, and a
    # reply that never runs past an end-of-turn id of the base's generation_config.json.
    turn = "What does the fox do?"
    argv = ["chat", f"runs/llama-{kind}", "--message", turn, "--max-new-tokens", "3"]
    assert cli.main([*argv, "--temperature", "0", "--show-ids"]) == 0
    lines = capfd.readouterr().out.splitlines()
    want = _transformers(ws).apply_chat_template(
        [{"role": "user", "content": turn}], add_generation_prompt=True, tokenize=True,
        return_dict=True,
    )["input_ids"]  # fmt: skip
    assert f"prompt ids: {want}" in lines
    new = json.loads(next(x for x in lines if x.startswith("new ids: "))[len("new ids: ") :])
    assert 1 <= len(new) <= 3 and not set(new[:-1]) & set(EOS_IDS)


@pytest.mark.slow  # two fine-tunes of 2 steps and 1 (the step compiled once, then cached)
def test_sft_run_resumed_without_data_says_how_and_resumes(ws, capfd):
    """Without finetune.data, an SFT run's records come from --data: a resume without it is
    one line whose command works, and the resumed run says where it started."""
    first = ["finetune", str(RECIPES["lora"]), "finetune.data=null", "run.dir=runs/j2", *SHORT]
    assert cli.main([*first, "--data", "chat.jsonl"]) == 0
    capfd.readouterr()
    more = ["finetune.data=null", "run.dir=runs/j2", "train.steps=3", "train.seq_len=64"]
    assert cli.main(["finetune", str(RECIPES["lora"]), "--resume", *more]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--data on resume" in err[0], err
    (ws / "other.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()[:-1]))
    argv = ["finetune", str(RECIPES["lora"]), "--resume", "--data", "other.jsonl", *more]
    assert cli.main(argv) == 2  # other records: the hint names --data, not data.corpus=
    other = capfd.readouterr().err.strip().splitlines()[-1]
    assert "data.corpus on resume = 'other.jsonl'" in other
    assert "Fix: resume with --data chat.jsonl (the run's SFT records)" in other
    command = err[0].split("Fix: resume with ")[1].split(" (and the same overrides)")[0]
    argv = shlex.split(command)
    assert argv[:2] == ["lmjax", "finetune"] and argv[-2:] == ["--data", "chat.jsonl"]
    assert cli.main([*argv[1:], *more]) == 0
    assert "resumed runs/j2 from step 2" in capfd.readouterr().out
    rows = [json.loads(line) for line in (ws / "runs/j2/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [2, 3]  # logging.every 10: each end


def test_every_data_file_of_the_package_is_installed_with_it():
    """A wheel holds a package's non-Python files only where `[tool.setuptools.package-data]`
    names them (an editable install here finds them either way): every such file under lmjax/
    and pallas_kernels/ (the recipes `--recipe` reads) matches one of its globs."""
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = data.get("package-data", {})
    files = [
        f
        for top in ("lmjax", "pallas_kernels")
        for f in (root / top).rglob("*")
        if f.is_file() and f.suffix not in (".py", ".pyc") and "__pycache__" not in f.parts
    ]
    assert files, "the recipes, at least"
    for f in files:
        package = ".".join(f.parent.relative_to(root).parts)
        owners = [p for p in globs if package == p or package.startswith(p + ".")]
        rel = {p: f.relative_to(root / p.replace(".", "/")).as_posix() for p in owners}
        assert any(fnmatch.fnmatch(rel[p], g) for p in owners for g in globs[p]), f
