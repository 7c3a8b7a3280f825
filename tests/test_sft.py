"""Supervised fine-tuning (issue 24): `lmjax finetune CONFIG --data FILE.jsonl`.

Witnesses:
- ids and masks: transformers' `PreTrainedTokenizerFast` on the same tokenizer directory (a small
  byte-level BPE trained offline with `tokenizers`, test_chat_template's ChatML template with
  `{% generation %}` markers, BOS added by the post-processor): `apply_chat_template` ids and its
  `return_assistant_tokens_mask`; for prompt/completion, `tok(prompt)` + `tok(completion,
  add_special_tokens=False)` + eos.
- rows: records whose ids name their own split position, so every loss-mask entry can be checked
  against the records' masks by hand, packed and unpacked.
- the loss: float64 numpy NLL over the completion tokens from `models.forward` logits; the
  gradient with respect to the final hidden states is exactly 0 at every other position.
- end to end: a tiny Llama base with that tokenizer, LoRA for 8 packed steps from the CLI, then
  `lmjax eval` of the run.

Cost: ~45 s under load 10 on the 2 CPU cores (the CLI run ~26 s, the loss test ~12 s of
compiles, transformers' import ~5 s; the rest well under a second).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from test_chat_template import CHATML_GENERATION as CHATML
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from lmjax import cli, ops
from lmjax import models as lm
from lmjax.config import DataConfig, RunConfig
from lmjax.data import prepared as D
from lmjax.data import sft, sft_records
from lmjax.data.sft_rows import SFTSplit
from lmjax.errors import FileFormatError
from lmjax.models.loss import loss_fn
from lmjax.tokenizers import ByteTokenizer, load_hf_tokenizer
from lmjax.train.plan import preflight
from lmjax.train.runs import write_weights_run

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
WORDS = "the quick brown fox jumps over a lazy dog what is two plus four answer".split()


def _record(i: int) -> dict:
    a, b = WORDS[i % 7], WORDS[(3 * i) % 11]
    if i % 2:
        return {"prompt": f"Q: {a} {b}?\nA:", "completion": f" {b} {a}."}
    return {
        "messages": [
            {"role": "user", "content": f"{a} and {b}?"},
            {"role": "assistant", "content": f"{b}, {a}."},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": f"{a} {b}"},
        ]
    }


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A tokenizer directory (HF files), the records file, and a private cache."""
    root = tmp_path_factory.mktemp("sft")
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    text = " ".join(json.dumps(_record(i)) for i in range(40))
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    hf.train_from_iterator([text], trainer)
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 3)])
    tok_dir = root / "tok"
    tok_dir.mkdir()
    hf.save(str(tok_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    records = root / "sft.jsonl"
    records.write_text("".join(json.dumps(_record(i)) + "\n" for i in range(40)))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root / "cache"))
        yield root


def test_ids_and_masks_equal_transformers(ws):
    ours = load_hf_tokenizer(ws / "tok")
    theirs = PreTrainedTokenizerFast.from_pretrained(str(ws / "tok"))
    eot = sft_records.end_of_text(ours, "auto")
    assert eot == theirs.convert_tokens_to_ids("<|im_end|>")
    chat = _record(0)
    ids, mask = sft_records.encode_record(ours, chat, eot)
    want = theirs.apply_chat_template(
        chat["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ids == want["input_ids"]
    assert mask == want["assistant_masks"]
    said = [m["content"] + "<|im_end|>\n" for m in chat["messages"] if m["role"] == "assistant"]
    assert theirs.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "".join(said)
    pc = _record(1)
    ids, mask = sft_records.encode_record(ours, pc, eot)
    prompt = theirs(pc["prompt"])["input_ids"]
    completion = theirs(pc["completion"], add_special_tokens=False)["input_ids"] + [eot]
    assert prompt[0] == theirs.convert_tokens_to_ids("<s>")
    assert ids == prompt + completion
    assert mask == [0] * len(prompt) + [1] * len(completion)


def _named_split(lengths, mask_rule):
    """An SFTSplit whose ids are their own split positions (ids < vocab), mask by `mask_rule`."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.arange(offsets[-1], dtype=np.uint16)
    mask = np.zeros(offsets[-1], np.uint8)
    for d in range(len(lengths)):
        mask[offsets[d] : offsets[d + 1]] = mask_rule(np.arange(lengths[d]), lengths[d])
    return SFTSplit(tokens, mask, offsets)


@pytest.mark.parametrize("packed", [False, True], ids=["one-per-row", "packed"])
def test_rows_mask_only_completion_targets_of_the_same_record(packed):
    lengths = [5, 9, 3, 12, 7, 4, 9, 2, 11, 6]  # every record <= T + 1 = 13 ids
    split = _named_split(lengths, lambda i, n: (i >= n // 2).astype(np.uint8))
    record_of = np.searchsorted(split.offsets, np.arange(len(split.tokens)), side="right") - 1
    documents = split.offsets if packed else None
    batch = D.train_batch(split, 3, 5, 8, 12, 2, vocab_size=1000, documents=documents)
    assert batch["inputs"].shape == (2, 4, 12)
    assert ("segment_ids" in batch) == packed
    x, y = batch["inputs"].reshape(8, 12), batch["targets"].reshape(8, 12)
    got = batch["loss_mask"].reshape(8, 12)
    # Padding is id 0 = position 0, so an (input, target) pair is real iff target = input + 1.
    real = (y == x + 1) & (record_of[x] == record_of[np.minimum(y, len(record_of) - 1)])
    want = real & (split.mask[np.minimum(y, len(record_of) - 1)] == 1)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    assert got.sum() > 0
    if not packed:  # each row is one record from its first id
        assert set(x[:, 0]) <= set(split.offsets[:-1])


def _section(**fields) -> DataConfig:
    return DataConfig(**{"tokenizer": "gpt2", **fields})


def test_prepared_records_and_the_loss_on_completions_only(ws, capsys):
    target = sft.prepare(_section(), ws / "sft.jsonl", 24, ws / "tok")
    assert "sft data" in capsys.readouterr().err
    prepared = D.open_prepared(target)
    assert isinstance(prepared.train, SFTSplit)
    assert prepared.meta["train_documents"] + prepared.meta["val_documents"] == 40
    batch = D.eval_batch(prepared.val, 0, 0, 4, 24, prepared.vocab_size, prepared.val_documents)
    cfg = lm.preset("llama-tiny", vocab_size=prepared.vocab_size, context_length=24, d_model=32,
                    n_heads=4, n_kv_heads=2, n_layers=1, d_ff=64)  # fmt: skip
    params = lm.init(jax.random.PRNGKey(0), cfg)
    x, y, mask = (jnp.asarray(batch[k]) for k in ("inputs", "targets", "loss_mask"))
    seg = jnp.asarray(batch["segment_ids"])
    assert 0 < float(mask.mean()) < 1
    loss = jax.jit(loss_fn, static_argnums=3)(params, x, y, cfg, loss_mask_BT=mask,
                                              segment_ids_BT=seg)  # fmt: skip
    forward = jax.jit(lm.forward, static_argnums=2)
    logits = np.asarray(forward(params, x, cfg, segment_ids=seg), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, np.asarray(y)[..., None], -1)[..., 0]
    m = np.asarray(mask) == 1
    np.testing.assert_allclose(float(loss), nll[m].mean(), rtol=1e-5)
    p, h_BTD = jax.jit(lm.features, static_argnums=2)(params, x, cfg, segment_ids=seg)
    head = lm.head_params(p, cfg)
    fused = jax.jit(jax.grad(lambda h: ops.linear_cross_entropy(head, h, y, loss_mask=mask)))
    grad = fused(h_BTD)
    assert np.all(np.asarray(grad)[~m] == 0.0)
    assert np.all(np.abs(np.asarray(grad)[m]).sum(-1) > 0)


BAD = [
    ("{not json", "invalid JSON"),
    ('{"prompt": "a"}', "expected exactly {prompt, completion}"),
    ('{"prompt": "a", "completion": 3}', "'completion' is int"),
    ('{"messages": [{"role": "user", "content": ["x"]}]}', "content is list"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "unknown role 'wizard'"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
]


@pytest.mark.parametrize("line,reason", BAD, ids=[r for _, r in BAD])
def test_bad_record_names_file_and_line(ws, tmp_path, line, reason):
    path = tmp_path / "bad.jsonl"
    good = [json.dumps(_record(i)) for i in range(3)]
    path.write_text("\n".join([*good[:2], line, good[2]]) + "\n")
    with pytest.raises(FileFormatError) as err:
        sft.prepare(_section(dir=str(tmp_path / "out")), path, 24, ws / "tok")
    assert f"{path}:3" in str(err.value) and reason in str(err.value)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


def test_skip_bad_truncation_and_chat_without_template(ws, tmp_path, capsys):
    path = tmp_path / "mixed.jsonl"
    long = {"prompt": "Q: " + "the fox " * 40, "completion": " a dog."}  # no completion in 41
    cut = {"prompt": "Q:", "completion": " the fox" * 30}
    lines = [json.dumps(r) for r in (_record(0), _record(1), long, cut, _record(2), _record(3))]
    path.write_text("\n".join([*lines[:2], "[1, 2]", *lines[2:]]) + "\n")
    target = sft.prepare(_section(dir=str(tmp_path / "out"), skip_bad=True), path, 40, ws / "tok")
    line = capsys.readouterr().err
    assert "6 records" in line and "1 truncated to seq_len + 1 = 41" in line
    assert "1 dropped" in line and f"skipped 1 bad record (first: {path}:3" in line
    meta = D.open_prepared(target).meta
    assert meta["train_documents"] + meta["val_documents"] == 5
    assert meta["train_tokens"] + meta["val_tokens"] <= 5 * 41
    assert meta["val_tokens"] < 41  # one short record: still a row (padded), so no refusal
    model = {"preset": "llama-tiny", "vocab_size": meta["vocab_size"]}
    sections = {"model": model, "train": {"seq_len": 40}, "logging": {"sample_tokens": 0}}
    cfg = RunConfig.from_dict(sections)
    preflight(cfg, cfg.model_config(), D.open_prepared(target))
    byte_dir = tmp_path / "byte"
    ByteTokenizer().save(byte_dir)
    with pytest.raises(FileFormatError, match=f"{path}:1.*no chat template"):
        sft.prepare(_section(dir=str(tmp_path / "out2"), tokenizer="byte"), path, 24, byte_dir)


CONFIG = """
finetune: {{base: {base}}}
lora: {{r: 4, alpha: 16, targets: [all-linear], dropout: 0.0}}
data: {{packing: true}}
optimizer: {{name: adamw, lr: 0.03, weight_decay: 0.0}}
schedule: {{warmup_steps: 1, decay_steps: 8}}
train: {{steps: 8, batch_size: 4, seq_len: 48, eval_every: 8, eval_batches: 1}}
checkpoint: {{every: 8, keep: 1}}
logging: {{every: 1, progress: false, sample_tokens: 0, peak_flops: 1.0e+12}}
"""


@pytest.fixture(scope="module")
def base(ws):
    """One tiny Llama base run over the records' tokenizer, read (never written) by the three
    fine-tunes below: drawn once, not once per trainable."""
    tok = load_hf_tokenizer(ws / "tok")
    model = lm.preset("llama-tiny", vocab_size=tok.vocab_size, context_length=48, d_model=32,
                      n_heads=4, n_kv_heads=2, n_layers=2, d_ff=64)  # fmt: skip
    return write_weights_run(ws / "base", lm.init(jax.random.PRNGKey(1), model), model, tok, "gpt2")


def test_finetune_cli_on_records_lowers_the_loss(ws, base, capfd):
    (ws / "ft.yaml").write_text(CONFIG.format(base=base))
    out = ws / "run"
    argv = ["finetune", str(ws / "ft.yaml"), "--data", str(ws / "sft.jsonl"), f"run.dir={out}"]
    assert cli.main(argv) == 0
    assert "sft data" in capfd.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert len(train) == 8 and train[-1]["loss"] < train[0]["loss"] - 0.1
    data_dir = yaml.safe_load((out / "config.yaml").read_text())["data"]["dir"]
    prepared = D.open_prepared(data_dir)
    for r in train[:2]:  # the fraction of counted targets of that step's own batch
        batch = D.train_batch(prepared.train, 0, r["step"] - 1, 4, 48, 1, None,
                              prepared.vocab_size, prepared.train_documents)  # fmt: skip
        assert r["real_token_fraction"] == pytest.approx(float(batch["loss_mask"].mean()))
        assert 0 < r["real_token_fraction"] < 1
    assert (out / "adapters.safetensors").is_file()
    assert cli.main(["eval", str(out)]) == 0  # reopens the SFT data from config.yaml
    assert f"{rows[-1]['val_loss']:.4f}" in capfd.readouterr().out


# The same records with the other two trainables: QLoRA (adapters over an NF4 base) and full
# fine-tuning (every parameter but the frozen embedding). The data path is shared; what these
# show is that the loss mask reaches each trainable's objective and the loss still falls.
OTHER_TRAINABLES = {
    "qlora": (CONFIG, ["--qlora"]),
    "full": (
        CONFIG.replace(
            "lora: {{r: 4, alpha: 16, targets: [all-linear], dropout: 0.0}}\n", ""
        ).replace("lr: 0.03", "lr: 0.003"),
        ["--full", "--freeze", "token_embedding.*"],
    ),
}


@pytest.mark.parametrize("kind", sorted(OTHER_TRAINABLES))
def test_finetune_cli_on_records_with_qlora_and_full(ws, base, capfd, kind):
    template, flags = OTHER_TRAINABLES[kind]
    (ws / f"ft-{kind}.yaml").write_text(template.format(base=base))
    out = ws / f"run-{kind}"
    argv = ["finetune", str(ws / f"ft-{kind}.yaml"), "--data", str(ws / "sft.jsonl"), *flags]
    assert cli.main([*argv, f"run.dir={out}"]) == 0
    assert "sft data" in capfd.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert len(train) == 8 and train[-1]["loss"] < train[0]["loss"]
    assert all(0 < r["real_token_fraction"] < 1 for r in train)
