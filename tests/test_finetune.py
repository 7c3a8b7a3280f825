"""`lmjax finetune` end to end (tiny, in-process): the run directory, exact resume, the merged
export that generate reads, `inspect --lora/--qlora`, and bad inputs (one line, exit 2, nothing
written). QLoRA's own checks (NF4 bytes, loss on real text) are in tests/test_qlora.py."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from lmjax import cli, lora, models
from lmjax import params as ptree
from lmjax.config import RunConfig
from lmjax.errors import CheckpointError
from lmjax.train import loop
from lmjax.train.runs import load_run, write_weights_run

TEXT = "".join(
    f"Sonnet {i}: shall I compare thee to a summer's day, {i % 7}?\n" for i in range(300)
)
CONFIG = """
finetune: {{base: {base}, qlora: false}}
lora: {{r: 4, alpha: 8, targets: ["*.attention.query", "*.attention.value"], dropout: 0.1}}
data: {{corpus: {corpus}, tokenizer: char}}
optimizer: {{name: adamw, lr: 0.01, weight_decay: 0.0}}
schedule: {{warmup_steps: 1, decay_steps: 4}}
train: {{steps: 4, batch_size: 4, seq_len: 16, eval_every: 2, eval_batches: 1}}
checkpoint: {{every: 2, keep: 5}}
logging: {{every: 1, progress: false, sample_tokens: 4, sample_prompt: S, peak_flops: 1.0e+12}}
"""


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A workspace with a corpus, a tiny weights-only base run on its char vocabulary, and the
    fine-tune config; the cache dir is private to it."""
    root = tmp_path_factory.mktemp("finetune")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root / "cache"))
        yield _workspace(root)


def _workspace(root: Path) -> Path:
    (root / "corpus.txt").write_text(TEXT)
    cfg = RunConfig.from_dict(
        {
            "model": {"preset": "gpt", "vocab_size": None},
            "data": {"corpus": str(root / "corpus.txt")},
        }
    )
    prepared = loop.prepare_data(cfg, progress=False)
    model = models.preset("gpt", vocab_size=prepared.vocab_size, context_length=16, d_model=32,
                          n_heads=4, n_layers=2, d_ff=64)  # fmt: skip
    write_weights_run(root / "base", models.init(jax.random.PRNGKey(0), model), model,
                      prepared.tokenizer, "char")  # fmt: skip
    (root / "ft.yaml").write_text(CONFIG.format(base=root / "base", corpus=root / "corpus.txt"))
    return root


def run_cli(*args: str) -> int:
    return cli.main(list(args))


@pytest.fixture(scope="module")
def straight(ws):
    """4 steps in one go."""
    out = ws / "straight"
    assert run_cli("finetune", str(ws / "ft.yaml"), f"run.dir={out}") == 0
    return out


def test_run_directory_and_frozen_base(ws, straight, capsys):
    base_bytes = (ws / "base" / "model.safetensors").read_bytes()
    for name in ("config.yaml", "finetune.yaml", "metrics.jsonl", "samples.txt", "loss.png",
                 "adapters.safetensors", "merged/model.safetensors", "merged/config.yaml",
                 "tokenizer"):  # fmt: skip
        assert (straight / name).exists(), name
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    adapters, lcfg = lora.load_adapters(straight / "adapters.safetensors")
    assert (lcfg.r, lcfg.alpha, lcfg.dropout) == (4, 8.0, 0.1)
    assert sorted(ptree.flatten(adapters)) == [  # stacked over the 2 blocks
        f"blocks.attention.{p}.{ab}" for p in ("query", "value") for ab in ("lora_a", "lora_b")
    ]  # fmt: skip
    assert all(leaf.shape[0] == 2 for leaf in ptree.flatten(adapters).values())
    assert any(np.asarray(b).any() for _, b in lora.adapter_layers(adapters).values())
    # MFU counts a LoRA step's FLOPs (frozen base: no weight gradients), not 6N of the model.
    from lmjax.train.metrics import lora_flops_per_token

    shapes = lora.adapter_shapes(adapters)
    per_token = lora_flops_per_token(load_run(ws / "base").model, 16, shapes)
    timed = [r for r in records if r.get("mfu") is not None]
    assert timed
    for r in timed:  # logging.peak_flops is 1e12 in CONFIG
        assert r["mfu"] == pytest.approx(per_token * r["tokens_per_s"] / 1e12, rel=1e-9)
    assert (ws / "base" / "model.safetensors").read_bytes() == base_bytes
    # The checkpoint holds the adapters and their optimizer state, nothing of the base.
    from lmjax.train.checkpoint import Checkpoints

    stored = Checkpoints(straight / "checkpoints", create=False)._stored_leaves(4)
    assert not any("embedding" in name or "weight" in name for name in stored), sorted(stored)
    # load_run of the fine-tune run and of merged/ give the same (merged) parameters.
    merged, ft = load_run(straight / "merged"), load_run(straight)
    base = load_run(ws / "base")
    assert ft.step == 4
    for name, leaf in ptree.flatten(merged.params).items():
        np.testing.assert_allclose(ptree.flatten(ft.params)[name], leaf, atol=1e-6, err_msg=name)
    expected = lora.merge(base.params, adapters, lcfg)
    for name, leaf in ptree.flatten(expected).items():
        np.testing.assert_allclose(
            ptree.flatten(merged.params)[name], leaf, atol=1e-6, err_msg=name
        )
    capsys.readouterr()
    texts = []
    for source in (straight, straight / "merged"):
        assert run_cli("generate", "--run", str(source), "--prompt", "So", "--max-new-tokens",
                       "6", "--temperature", "0") == 0  # fmt: skip
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("So") and len(texts[0]) == 2 + 6 + 1


def test_resume_equals_straight(ws, straight, monkeypatch):
    """The resume names the same base another way (a relative path through a symlink, from
    another working directory): the base is the same weights, so the run continues."""
    out = ws / "resumed"
    quiet = ("logging.sample_tokens=0", "logging.plot=false")  # no effect on the adapters
    assert run_cli("finetune", str(ws / "ft.yaml"), f"run.dir={out}", "train.steps=2", *quiet) == 0
    (ws / "elsewhere").mkdir()
    (ws / "link").symlink_to(ws / "base")
    monkeypatch.chdir(ws / "elsewhere")
    again = ("finetune.base=../link", "--resume", *quiet)
    assert run_cli("finetune", str(ws / "ft.yaml"), f"run.dir={out}", *again) == 0
    a, _ = lora.load_adapters(straight / "adapters.safetensors")
    b, _ = lora.load_adapters(out / "adapters.safetensors")
    for name, leaf in ptree.flatten(a).items():
        np.testing.assert_array_equal(ptree.flatten(b)[name], leaf, err_msg=name)
    assert (out / "metrics.jsonl").read_text().count('"val_loss"') == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["finetune.base=nowhere"], "run path"),
        (["lora.r=0"], "lora.r"),
        (["--lora", "targets=*.attention.qurey"], "lora target"),
        (["--lora", "rank=4"], "--lora key"),
        (["model.n_layers=3"], "model field"),
        (["finetune.color=red"], "finetune key"),
        (["train.steps=0"], "train.steps"),
        (["data.corpus={other}"], "data.corpus"),  # characters the base's vocabulary lacks
        (["--resume"], "run directory to resume"),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(ws, capsys, args, message):
    (ws / "other.txt").write_text("xyz XYZ! " * 500)
    out = ws / "bad"
    args = [a.format(other=ws / "other.txt") for a in args]
    assert run_cli("finetune", str(ws / "ft.yaml"), f"run.dir={out}", *args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lmjax finetune: error:") and "\n" not in err, err
    assert message in err, err
    assert not out.exists()


def test_fine_tune_on_another_corpus_uses_the_base_tokenizer(ws, capsys):
    """A char base fine-tunes on another text made of its characters: the text is encoded with
    the base's vocabulary (a vocabulary built from that text was refused as a mismatch)."""
    (ws / "verse.txt").write_text("shall I compare thee to a summer's day?\n" * 200)
    out = ws / "verse"
    quiet = ("train.steps=1", "logging.sample_tokens=0", "logging.plot=false")
    args = (f"run.dir={out}", f"data.corpus={ws / 'verse.txt'}", *quiet)
    assert run_cli("finetune", str(ws / "ft.yaml"), *args) == 0, capsys.readouterr().err
    base = load_run(ws / "base").tokenizer
    assert load_run(out).tokenizer.encode("summer") == base.encode("summer")
    assert base.vocab_size > len(set("shall I compare thee to a summer's day?\n"))
    # lmjax eval scores with the base's ids too, even after the cached data directory is gone
    # (a vocabulary rebuilt from verse.txt would be smaller and give other ids).
    capsys.readouterr()
    assert run_cli("eval", str(out)) == 0, capsys.readouterr().err
    first = capsys.readouterr().out
    shutil.rmtree(yaml.safe_load((out / "config.yaml").read_text())["data"]["dir"])
    assert run_cli("eval", str(out)) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == first


def test_resume_onto_other_base_weights_is_refused(ws, straight, capsys):
    """Same path, other weights (the base was retrained or replaced): refused, nothing written;
    load_run of the fine-tune then says its base changed instead of merging onto it."""
    other = ws / "other-base"
    base = load_run(ws / "base")
    params = models.init(jax.random.PRNGKey(7), base.model)
    write_weights_run(other, params, base.model, base.tokenizer, "char")
    before = {p: p.read_bytes() for p in straight.rglob("*") if p.is_file()}
    args = (f"run.dir={straight}", f"finetune.base={other}", "train.steps=6", "--resume")
    assert run_cli("finetune", str(ws / "ft.yaml"), *args) == 2
    err = capsys.readouterr().err
    assert "base weights on resume" in err and "\n" not in err.strip(), err
    assert {p: p.read_bytes() for p in straight.rglob("*") if p.is_file()} == before
    copy = ws / "moved-base-run"
    import shutil

    shutil.copytree(straight, copy, ignore=shutil.ignore_patterns("merged"))
    spec = (copy / "finetune.yaml").read_text()
    (copy / "finetune.yaml").write_text(spec.replace(str(ws / "base"), str(other)))
    with pytest.raises(CheckpointError, match="base"):
        load_run(copy)


def test_lmjax_train_resume_of_a_fine_tune_is_refused_before_writing(ws, straight, capsys):
    """`lmjax train --resume` on a fine-tune run would restore adapters as a whole model (and
    rewrote config.yaml first): it is refused up front, pointing at lmjax finetune --resume."""
    before = {p: p.read_bytes() for p in straight.rglob("*") if p.is_file()}
    args = ("train", str(straight / "config.yaml"), f"run.dir={straight}", "train.steps=6")
    assert run_cli(*args, "--resume") == 2
    err = capsys.readouterr().err
    assert "lmjax finetune" in err and "--resume" in err, err
    assert {p: p.read_bytes() for p in straight.rglob("*") if p.is_file()} == before


def test_existing_run_directory_is_refused(ws, straight, capsys):
    before = (straight / "adapters.safetensors").read_bytes()
    assert run_cli("finetune", str(ws / "ft.yaml"), f"run.dir={straight}") == 2
    assert "--resume" in capsys.readouterr().err
    assert (straight / "adapters.safetensors").read_bytes() == before


def test_help_and_inspect(capsys):
    with pytest.raises(SystemExit) as done:
        run_cli("finetune", "--help")
    assert done.value.code == 0
    assert "--qlora" in capsys.readouterr().out
    assert run_cli("inspect", "gpt", "vocab_size=64", "n_layers=2", "--lora", "r=4") == 0
    text = capsys.readouterr().out
    cfg = models.preset("gpt", vocab_size=64, n_layers=2)
    lcfg = lora.LoraConfig(r=4)
    n = lora.count(lora.init(jax.random.PRNGKey(0), cfg, lcfg))
    # query and value adapters: r * (in + out) = 4 * (D + D) each, per layer.
    assert n == 2 * 2 * 4 * (cfg.d_model + cfg.d_model)
    assert f"adapters, trainable ({n:,} params)" in text
    assert "frozen base weights" in text
    assert run_cli("inspect", "gpt", "--lora", "r=0") == 2
    capsys.readouterr()
    assert run_cli("inspect", "gpt", "vocab_size=64", "n_layers=2", "--qlora") == 0
    text = capsys.readouterr().out
    n = 2 * (4 * cfg.d_model**2 + 2 * cfg.d_model * cfg.d_ff)  # the block projections
    per_weight = [cfg.d_model**2] * 4 + [cfg.d_model * cfg.d_ff] * 2  # one block's
    # SPEC section 6: N/2 + ceil(N/64) + 4 ceil(N/16384) + 4 bytes per weight matrix.
    stored = 2 * sum(w // 2 + -(-w // 64) + 4 * -(-w // 16384) + 4 for w in per_weight)
    assert f"NF4: {n:,} weights in" in text
    assert f"{8 * stored / n:.3f} bits each" in text


def test_inspect_a_fine_tune_config(ws, capsys):
    """`lmjax inspect configs/finetune-*.yaml` reports the base's model and the LoRA memory of
    the config's adapters and optimizer (it refused the finetune section); nothing is loaded."""
    assert run_cli("inspect", str(ws / "ft.yaml")) == 0
    text = capsys.readouterr().out
    base = load_run(ws / "base").model
    lcfg = lora.LoraConfig(r=4, alpha=8, dropout=0.1)
    n = lora.count(lora.init(jax.random.PRNGKey(0), base, lcfg))
    assert f"d_model={base.d_model}" in text and "LoRA (float base): r=4, alpha=8" in text
    assert f"adapters, trainable ({n:,} params)" in text and "adamw state (adapters only)" in text
    assert run_cli("inspect", str(ws / "ft.yaml"), "--qlora", "--lora", "r=2") == 0
    text = capsys.readouterr().out
    assert "QLoRA (NF4 base): r=2, alpha=8" in text and "NF4:" in text
    assert run_cli("inspect", str(ws / "ft.yaml"), "finetune.base=nowhere") == 2
    assert "run path" in capsys.readouterr().err


@pytest.mark.slow
def test_qlora_run_merges_into_a_float_model(ws, capsys, caplog, monkeypatch):
    """--qlora: the NF4 base trains its query/value adapters; merged/ is a float model in which
    every weight (adapted or not) is the dequantized NF4 weight plus the adapters' update.

    The frozen base is committed to the device here, as a base restored from a checkpoint
    (`lmjax train`'s runs/tiny-shakespeare, the README's base) is, unlike this weights-only
    one: the jitted step still compiles once for its 2 steps (the adapters' fresh state was
    uncommitted, so step 2's inputs were placed unlike step 1's and it compiled again)."""
    from lmjax import finetune
    from lmjax.quant.params import quantize_params

    frozen_params = finetune.frozen_params

    def committed(base, qlora):
        return jax.device_put(frozen_params(base, qlora), jax.devices()[0])

    monkeypatch.setattr(finetune, "frozen_params", committed)
    out = ws / "qlora"
    quiet = ("train.steps=2", "logging.sample_tokens=0", "logging.plot=false")
    with caplog.at_level(logging.WARNING, logger="jax"), jax.log_compiles():
        assert run_cli("finetune", str(ws / "ft.yaml"), f"run.dir={out}", "--qlora", *quiet) == 0
    compiles = [r for r in caplog.messages if r.startswith("Compiling jit(train_step)")]
    assert len(compiles) == 1, [c[-160:] for c in compiles]  # their argument placements
    assert "qlora: true" in (out / "finetune.yaml").read_text()
    adapters, lcfg = lora.load_adapters(out / "adapters.safetensors")
    expected = lora.merge(quantize_params(load_run(ws / "base").params), adapters, lcfg)
    merged = load_run(out / "merged").params
    assert all(isinstance(leaf, jax.Array) for leaf in ptree.flatten(merged).values())
    for name, leaf in ptree.flatten(expected).items():
        np.testing.assert_allclose(ptree.flatten(merged)[name], leaf, atol=1e-6, err_msg=name)
    key = ptree.flatten(merged)["blocks.attention.key.weight"]  # not adapted: NF4 round-off only
    original = ptree.flatten(load_run(ws / "base").params)["blocks.attention.key.weight"]
    assert 0 < float(np.abs(np.asarray(key) - np.asarray(original)).max()) < 0.1
