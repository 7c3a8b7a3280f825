"""`lmjax finetune` and LoRA specs under bad input (issue 12, SPEC sections 6, 10 and 11).

Each case runs `lmjax finetune` in-process against a tiny weights-only base and must exit 2 with
one stderr line naming the value and a `Fix:`, print nothing on stdout, and leave the workspace
(data cache included) byte-identical: every case fails before the data is prepared or the run
directory made. tests/test_finetune.py covers the runs that succeed (and a few refusals); here
the bad inputs are exhaustive. `LoraConfig.parse` (the `--lora` text) is also driven by
hypothesis: a valid config or a one-line ConfigError, nothing else.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import yaml
from _bad_input import assert_one_line_error, run_main, tiny_weights_run
from _snapshot import assert_unchanged, tree_snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

from lmjax.errors import ConfigError
from lmjax.io import safetensors
from lmjax.lora import LoraConfig
from lmjax.train.runs import load_run

CONFIG = """finetune: {{base: {base}, qlora: false}}
lora: {{r: 2, alpha: 4}}
data: {{corpus: {corpus}, tokenizer: char}}
schedule: {{warmup_steps: 0}}
train: {{steps: 1, batch_size: 2, seq_len: 8, eval_every: 1, eval_batches: 1}}
logging: {{progress: false, sample_tokens: 0, plot: false}}
"""


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A tiny char base, its corpus and fine-tune config, and bad bases: one whose projections
    are NaN (NF4 can't scale them), one without tokenizer/, one that is a fine-tune whose own
    base is gone."""
    root = tmp_path_factory.mktemp("badft")
    tiny_weights_run(root / "base")
    (root / "corpus.txt").write_text("abc defg hab\n" * 200)
    (root / "other.txt").write_text("XYZ xyz!\n" * 200)  # characters the base lacks
    (root / "ft.yaml").write_text(CONFIG.format(base=root / "base", corpus=root / "corpus.txt"))
    (root / "afile").write_text("not a directory\n")
    (root / "cache").mkdir()
    nan_base = tiny_weights_run(root / "nan-base")
    params = safetensors.load(nan_base / "model.safetensors", load_run(nan_base).model)
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: np.full(a.shape, np.nan, a.dtype) if "attention" in str(path) else a,
        params,
    )
    safetensors.save(params, nan_base / "model.safetensors", metadata={"format": "lmjax"})
    no_tok = tiny_weights_run(root / "no-tokenizer")
    for f in (no_tok / "tokenizer").iterdir():
        f.unlink()
    (no_tok / "tokenizer").rmdir()
    orphan = root / "orphan-finetune"  # config.yaml of the base, finetune.yaml naming a lost base
    orphan.mkdir()
    (orphan / "config.yaml").write_text((root / "base" / "config.yaml").read_text())
    lora = dataclasses.asdict(LoraConfig()) | {"targets": ["*.attention.query"]}
    spec = {"finetune": {"base": "gone", "base_path": str(root / "gone"), "qlora": False}}
    (orphan / "finetune.yaml").write_text(yaml.safe_dump(spec | {"lora": lora}))
    return root


FT = ["finetune", "ft.yaml", "run.dir=out"]
CASES = {
    # --lora text
    "--lora r=0": (["--lora", "r=0"], "lora.r = 0"),
    "--lora r=-1": (["--lora", "r=-1"], "lora.r = -1"),
    "--lora r=2.5": (["--lora", "r=2.5"], "lora.r = 2.5"),
    "--lora r=true": (["--lora", "r=true"], "lora.r = True"),
    "--lora r=abc": (["--lora", "r=abc"], "lora.r = 'abc'"),
    "--lora alpha=abc": (["--lora", "alpha=abc"], "lora.alpha = 'abc'"),
    "--lora alpha=0": (["--lora", "alpha=0"], "lora.alpha = 0"),
    "--lora alpha=nan": (["--lora", "alpha=nan"], "lora.alpha = 'nan'"),
    "--lora alpha=1e999": (["--lora", "alpha=1e999"], "lora.alpha = inf"),
    "--lora unknown key": (["--lora", "rank=4"], "--lora key = 'rank'"),
    "--lora item without =": (["--lora", "r"], "--lora item = 'r'"),
    "--lora empty key": (["--lora", "=4"], "--lora key = ''"),
    "--lora repeated key": (["--lora", "r=4,r=5"], "--lora key = 'r'"),
    "--lora targets match nothing": (["--lora", "targets=*.nothing"], "lora target = '*.nothing'"),
    "--lora empty target": (["--lora", "targets="], "lora.targets = ('',)"),
    "--lora trailing |": (["--lora", "targets=*.query|"], "lora.targets = ('*.query', '')"),
    "--lora dropout=1": (["--lora", "dropout=1"], "lora.dropout = 1"),
    "--lora dropout=-0.1": (["--lora", "dropout=-0.1"], "lora.dropout = -0.1"),
    "--lora dropout=nan": (["--lora", "dropout=nan"], "lora.dropout = 'nan'"),
    "--lora r past the layers' rank": (["--lora", "r=33"], "lora.r = 33; expected <= min(out, in)"),
    "--lora r huge (was an OOM)": (["--lora", "r=99999999999999"], "lora.r = 99999999999999"),
    "--lora all-linear among globs": (["--lora", "targets=all-linear|*.query"],
                                      "lora.targets = ('all-linear', '*.query')"),
    "--lora init=xavier": (["--lora", "init=xavier"], "lora.init = 'xavier'"),
    "--lora rslora=maybe": (["--lora", "rslora=maybe"], "lora.rslora = 'maybe'"),
    # the lora and finetune sections through overrides
    "lora.r=0": (["lora.r=0"], "lora.r = 0"),
    "lora.bogus=1": (["lora.bogus=1"], "lora key = 'bogus'"),
    "lora=3": (["lora=3"], "override key = 'lora'"),
    "finetune=3": (["finetune=3"], "override key = 'finetune'"),
    "finetune.color": (["finetune.color=red"], "finetune key = 'color'"),
    "finetune.qlora=yes": (["finetune.qlora=yes"], "finetune.qlora = 'yes'"),
    "finetune.qlora=1": (["finetune.qlora=1"], "finetune.qlora = 1"),
    # the base
    "base missing": (["finetune.base=nowhere"], "run path = 'nowhere'"),
    "base is a file": (["finetune.base=afile"], "run path = 'afile'"),
    "base is a text file": (["finetune.base=corpus.txt"], "run path = 'corpus.txt'"),
    "base is a number": (["finetune.base=3"], "finetune.base = 3"),
    "base is null": (["finetune.base=null"], "finetune.base = None"),
    "base step of a weights-only run": (["finetune.base=base/checkpoints/7"],
                                        "finetune.base = 'base/checkpoints/7'"),
    "base without tokenizer": (["finetune.base=no-tokenizer"], "base run = "),
    "base: a fine-tune whose base is gone": (["finetune.base=orphan-finetune"],
                                             "fine-tune base = "),
    "--qlora on NaN projections": (["finetune.base=nan-base", "--qlora"], "NaN or infinite"),
    # the model and other sections
    "model.n_layers": (["model.n_layers=3"], "model field = 'n_layers'"),
    "model.vocab_size": (["model.vocab_size=3"], "model field = 'vocab_size'"),
    "model.preset": (["model.preset=llama"], "model field = 'preset'"),
    "model.dropout=2": (["model.dropout=2"], "model.dropout = 2"),
    "model.dtype=int8": (["model.dtype=int8"], "model.dtype = 'int8'"),
    "model=3": (["model=3"], "override key = 'model'"),
    # a mesh is checked against the devices before anything is written (one here)
    "parallel.mesh": (["parallel.mesh=data=2"], "parallel.mesh = 'data=2,fsdp=1,model=1'"),
    "train.steps=0": (["train.steps=0"], "train.steps = 0"),
    "optimizer.lr=1e999": (["optimizer.lr=1e999"], "optimizer.lr = inf"),
    "corpus outside the base's chars": (["data.corpus=other.txt"], "data.corpus = 'other.txt'"),
    "corpus missing": (["data.corpus=nope.txt"], "data.corpus = 'nope.txt'"),
    "another tokenizer than the base's": (["data.tokenizer=byte"], "data.tokenizer = 'byte'"),
    "a bpe vocabulary on a char base": (["data.vocab_size=300"], "data.vocab_size = 300"),
    # run directory
    "run.dir exists without --resume": (["run.dir=base"], "run directory = 'base'"),
    "run.dir is a file": (["run.dir=afile"], "'afile'"),
    "--resume of nothing": (["--resume"], "run directory to resume = 'out'"),
}  # fmt: skip


# The corpus is encoded while its cache entry is built (lmjax.files.atomic_dir), so the cache's
# parent directories may appear, empty; no file does.
EMPTY_CACHE_DIRS_ALLOWED = {"corpus outside the base's chars"}


@pytest.mark.parametrize("args, named", list(CASES.values()), ids=list(CASES))
def test_bad_finetune_is_one_line_exit_2_and_writes_nothing(
    ws, capsys, monkeypatch, request, args, named
):
    before = tree_snapshot(ws)
    assert_one_line_error(*run_main(ws, [*FT, *args], capsys, monkeypatch), named)
    if request.node.callspec.id in EMPTY_CACHE_DIRS_ALLOWED:
        after = tree_snapshot(ws)
        new = {p: kind for p, kind in after.items() if p not in before}
        assert all(p.startswith("cache/") and kind[0] == "dir" for p, kind in new.items()), new
        before = before | new
    assert_unchanged(ws, before)


@pytest.mark.parametrize(
    "argv, named",
    [
        (["finetune", "nowhere.yaml"], "config file = 'nowhere.yaml'"),
        (["finetune", "afile"], "config = 'not a directory'"),
        (["finetune", "corpus.txt"], "config = "),
        (["finetune", "base/config.yaml", "run.dir=out"], "finetune.base = None"),  # a train config
        (["finetune"], "CONFIG = 'not given'; expected a fine-tune config file or --recipe"),
        (["finetune", "ft.yaml", "--lora"], "expected one argument"),
        (["finetune", "ft.yaml", "--qlora=yes"], "ignored explicit argument 'yes'"),
        (["inspect", "ft.yaml", "finetune.base=base/checkpoints/3"], "finetune.base = 'base/che"),
        (["inspect", "ft.yaml", "--lora", "r=100"], "lora.r = 100"),
        (["inspect", "ft.yaml", "--lora", "targets=*.nothing"], "lora target = '*.nothing'"),
    ],
)
def test_bad_config_files_and_flags(ws, capsys, monkeypatch, argv, named):
    before = tree_snapshot(ws)
    assert_one_line_error(*run_main(ws, argv, capsys, monkeypatch), named)
    assert_unchanged(ws, before)


field_values = st.one_of(
    st.sampled_from(["", "0", "1", "-1", "8", "2.5", "1e999", "nan", "inf", "true", "null",
                     "abc", "*.query", "all-linear", "kaiming", "gaussian", "x|y", "|"]),
    st.text(max_size=6),
)  # fmt: skip
lora_items = st.one_of(
    st.builds(
        lambda k, v: f"{k}={v}",
        st.sampled_from(["r", "alpha", "targets", "dropout", "init", "rslora", "rank", ""]),
        field_values,
    ),
    st.text(max_size=8),
)


@settings(max_examples=150, derandomize=True, deadline=None)
@given(items=st.lists(lora_items, max_size=4))
def test_lora_text_parses_to_a_valid_config_or_a_one_line_config_error(items):
    text = ",".join(items)
    try:
        lcfg = LoraConfig.parse(text)
    except ConfigError as err:
        message = str(err)
        assert "\n" not in message and "; expected " in message and ". Fix: " in message
        assert message.split(" = ")[0] in {"--lora item", "--lora key"} or message.startswith(
            "lora."
        ), message
        return
    # The documented ranges (lmjax.lora.LoraConfig): what a valid config promises.
    assert type(lcfg.r) is int and lcfg.r >= 1
    assert type(lcfg.alpha) is float and 0 < lcfg.alpha < float("inf")
    assert type(lcfg.dropout) in (int, float) and 0 <= lcfg.dropout < 1
    assert lcfg.init in ("kaiming", "gaussian") and type(lcfg.rslora) is bool
    assert lcfg.targets and all(type(t) is str and t for t in lcfg.targets)
    assert LoraConfig.from_dict(lcfg.to_dict()) == lcfg


@pytest.mark.parametrize("text", [None, 8, ["r=8"], b"r=8"])
def test_lora_text_that_is_not_a_string_is_a_config_error(text):
    """Found: LoraConfig.parse(None) leaked AttributeError ('NoneType' has no 'split')."""
    with pytest.raises(ConfigError, match=r"--lora = .*; expected a string such as 'r=8,alpha=16'"):
        LoraConfig.parse(text)
