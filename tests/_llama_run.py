"""A tiny random Llama-family checkpoint with a byte-level BPE tokenizer.json, saved offline
(`transformers` + `tokenizers`, nothing downloaded), imported as an lmjax run: the base that
tests/test_lora_llama.py and tests/test_full_finetune.py fine-tune from the command line."""

from __future__ import annotations

import json
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


# chat=True: ChatML's turn markers (ids 1 and 2), a template written here (a default system
# turn, as Qwen's), <|im_end|> the end of a turn and <|endoftext|> the end of the text.
CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if loop.first and m['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou answer about foxes.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT_PROMPT = [{"role": "user", "content": "The quick fox?"}]
EOS_STEP = 3  # chat=True: the reply to CHAT_PROMPT ends with <|im_end|> as its 4th token


def tokenizer(chat: bool = False) -> Tokenizer:
    """Byte-level BPE as SmolLM ships it (ByteLevel pre-tokenizer with its regex); `chat` adds
    ChatML's two special tokens (the size stays VOCAB)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=CHAT_SPECIALS if chat else ["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer)
    return tok


def hf_checkpoint(
    directory: Path, chat: bool = False, context: int | None = None, vocab_size: int | None = None
) -> transformers.LlamaForCausalLM:
    """A GQA Llama (4 heads, 2 key/value heads, untied head, `context` positions: 128 with
    `chat`, else 64) and its tokenizer.json in `directory`. `chat`: also a tokenizer_config.json
    (CHAT_TEMPLATE, eos_token <|im_end|>) and a generation_config.json (eos_token_id
    [<|im_end|>, <|endoftext|>]), and a head that says <|im_end|> EOS_STEP tokens into its
    greedy reply to CHAT_PROMPT (`_end_turn`). `vocab_size`: the embedding's rows (default: the
    tokenizer's size; more pads it, as published checkpoints do)."""
    tok = tokenizer(chat)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size or tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=context or (128 if chat else 64), tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if chat:
        _chat_files(directory, tok)
        _end_turn(model, directory, tok.token_to_id("<|im_end|>"))
    model.save_pretrained(directory)
    if chat:  # after save_pretrained, which writes its own generation_config.json
        ids = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return model


def _chat_files(directory: Path, tok: Tokenizer) -> None:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def _end_turn(model, directory: Path, eos: int) -> None:
    """Make <|im_end|> the greedy choice where the random model would say its EOS_STEP-th
    token t of the reply to CHAT_PROMPT: its head row becomes t's scaled by 1.25, so its logit
    is 1.25 x t's (the largest logit, positive, wins by a quarter of itself there)."""
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(directory)
    ids = hf_tok.apply_chat_template(
        CHAT_PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=EOS_STEP + 1, pad_token_id=0
        )
        t = int(out[0, len(ids) + EOS_STEP])
        model.lm_head.weight[eos] = 1.25 * model.lm_head.weight[t]


def imported_run(
    root: Path, chat: bool = False, context: int | None = None, vocab_size: int | None = None
) -> Path:
    """`lmjax import-hf` of `hf_checkpoint(root/hf, chat, context, vocab_size)` into root/base;
    the corpus at root/corpus.txt."""
    hf_checkpoint(root / "hf", chat, context, vocab_size)
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
