"""A tiny random Llama-family checkpoint with a byte-level BPE tokenizer.json, saved offline
(`transformers` + `tokenizers`, nothing downloaded), imported as an lmjax run: the base that
tests/test_lora_llama.py and tests/test_full_finetune.py fine-tune from the command line."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lmjax import cli

TEXT = "".join(
    f"The {w} fox jumps over the lazy dog number {i}, and the dog sleeps.\n"
    for i in range(200)
    for w in ("quick", "brown", "red")[i % 3 : i % 3 + 1]
)
VOCAB = 300  # the tokenizer's size; the model's vocab_size equals it unless padded
PADDED_VOCAB = 320  # a padded embedding: 20 rows no token id reaches (tests/test_padded_vocab.py)


def tokenizer() -> Tokenizer:
    """Byte-level BPE as SmolLM ships it (ByteLevel pre-tokenizer with its regex)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer)
    return tok


def hf_checkpoint(directory: Path, vocab_size: int | None = None) -> transformers.LlamaForCausalLM:
    """A GQA Llama (4 heads, 2 key/value heads, untied head) and its tokenizer.json in
    `directory`. `vocab_size`: the embedding's rows (default: the tokenizer's size; more pads
    it, as published checkpoints do)."""
    tok = tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size or tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    tok.save(str(directory / "tokenizer.json"))
    return model


def imported_run(root: Path, vocab_size: int | None = None) -> Path:
    """`lmjax import-hf` of `hf_checkpoint(root/hf, vocab_size)` into root/base; the corpus at
    root/corpus.txt."""
    hf_checkpoint(root / "hf", vocab_size)
    (root / "corpus.txt").write_text(TEXT)
    assert cli.main(["import-hf", str(root / "hf"), "--out", str(root / "base")]) == 0
    return root / "base"


CONFIG = """
finetune: {{base: {base}}}
{lora}
data: {{corpus: {corpus}}}
optimizer: {{name: adamw, lr: 0.01, weight_decay: 0.0}}
schedule: {{warmup_steps: 1, decay_steps: 8}}
train: {{steps: 8, batch_size: 4, seq_len: 32, eval_every: 8, eval_batches: 1}}
checkpoint: {{every: 8, keep: 1}}
logging: {{every: 1, progress: false, sample_tokens: 4, sample_prompt: The, peak_flops: 1.0e+12}}
"""


def finetune_config(root: Path, lora: str = "") -> Path:
    """root/ft.yaml: 8 steps of 4 x 32 tokens over `imported_run(root)`'s base and corpus
    (`lora`: a lora section, or none for --full)."""
    path = root / "ft.yaml"
    path.write_text(CONFIG.format(base=root / "base", corpus=root / "corpus.txt", lora=lora))
    return path
