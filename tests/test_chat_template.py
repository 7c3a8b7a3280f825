"""Chat templates (issue 24's supervised fine-tuning): tokenizer_config.json's Jinja template.

Witness: transformers' `PreTrainedTokenizerFast.from_pretrained(dir).apply_chat_template`, on a
directory holding a small byte-level BPE tokenizer.json (trained offline with `tokenizers`) and a
tokenizer_config.json with a ChatML (Qwen-style) or a Llama-3-style template written here. The
assistant mask is checked against transformers' own `return_assistant_tokens_mask` on a template
with `{% generation %}` blocks, and by decoding the masked tokens. Cost: ~6 s (most of it
importing transformers; one 600-token vocabulary trained once).
"""

from __future__ import annotations

import json
import pydoc_data.topics

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from lmjax.errors import FileFormatError, TokenError
from lmjax.tokenizers import load, load_hf_tokenizer

LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"

# Qwen2.5's shape: a default system prompt, `-` whitespace control, raise_exception on a role.
CHATML = """{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('role ' + message['role'] + ' is not supported') }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama 3's shape: bos_token, no `-` markers (trim_blocks / lstrip_blocks decide the newlines).
LLAMA = """{{ bos_token }}{% for message in messages %}
  {% if message['role'] not in ['system', 'user', 'assistant'] %}
    {{ raise_exception('Unknown role: ' + message['role']) }}
  {% endif %}
{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
   + message['content'] | trim + '<|eot_id|>' }}
{% endfor %}
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}
"""

# ChatML with transformers' {% generation %} markers around what the model must learn to say.
CHATML_GENERATION = """{%- for message in messages %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content']
            + '<|im_end|>\\n' }}{% endgeneration %}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 2 + 2?  Say it in 日本語 🎉"},
    {"role": "assistant", "content": "  4, or 四.\n"},
    {"role": "user", "content": "And with\ttabs\r\nand <|im_end|> inside?"},
    {"role": "assistant", "content": "def f():\n    return 4"},
]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    hf = Tokenizer(models.BPE(ignore_merges=True))
    split = pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    hf.decoder = decoders.ByteLevel()
    docs = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    hf.train_from_iterator([docs[i : i + 2000] for i in range(0, 60_000, 2000)], trainer)
    bos = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 3)])
    hf.post_processor = bos  # Llama 3 adds BOS on encode; a chat template writes its own
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    hf.save(str(path))
    return path


def _directory(tmp_path, tokenizer_file, template) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS}
    if template is not None:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _theirs(directory, messages, **options) -> list[int]:
    tok = PreTrainedTokenizerFast.from_pretrained(directory)
    return tok.apply_chat_template(messages, tokenize=True, return_dict=False, **options)


@pytest.mark.parametrize("template", [CHATML, LLAMA], ids=["chatml", "llama3"])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_ids_equal_transformers(tmp_path, tokenizer_file, template, add_generation_prompt):
    directory = _directory(tmp_path, tokenizer_file, template)
    ours = load_hf_tokenizer(directory)
    for messages in (MESSAGES, MESSAGES[1:2], MESSAGES[1:4]):
        options = dict(add_generation_prompt=add_generation_prompt)
        got = ours.apply_chat_template(messages, **options)
        assert got == _theirs(directory, messages, **options)
        if template is LLAMA:  # the template's bos_token, not a second one from the encoder
            assert got[:2].count(ours.token_id(BOS)) == 1


def test_assistant_mask_equals_transformers_generation_mask(tmp_path, tokenizer_file):
    directory = _directory(tmp_path, tokenizer_file, CHATML_GENERATION)
    ids, mask = load_hf_tokenizer(directory).render_with_mask(MESSAGES)
    tok = PreTrainedTokenizerFast.from_pretrained(directory)
    theirs = tok.apply_chat_template(
        MESSAGES, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ids == theirs["input_ids"] and mask == theirs["assistant_masks"]
    assert 0 < sum(mask) < len(mask)


def test_assistant_mask_covers_exactly_the_assistant_turns(tmp_path, tokenizer_file):
    ours = load_hf_tokenizer(_directory(tmp_path, tokenizer_file, LLAMA))
    ids, mask = ours.render_with_mask(MESSAGES)
    assert ids == ours.apply_chat_template(MESSAGES) and len(mask) == len(ids)
    said = [m["content"].strip() + EOS + "\n" for m in MESSAGES if m["role"] == "assistant"]
    assert ours.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "".join(said)
    first_assistant = ours.decode(ids[: mask.index(1)])
    assert first_assistant.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_saved_tokenizer_keeps_its_template(tmp_path, tokenizer_file):
    ours = load_hf_tokenizer(_directory(tmp_path / "a", tokenizer_file, CHATML))
    ours.save(tmp_path / "b")
    again = load(tmp_path / "b")  # lmjax's loader, on HF's files
    assert again.apply_chat_template(MESSAGES) == ours.apply_chat_template(MESSAGES)
    assert _theirs(str(tmp_path / "b"), MESSAGES) == ours.apply_chat_template(MESSAGES)


def test_template_from_chat_template_jinja_and_named_lists(tmp_path, tokenizer_file):
    directory = _directory(tmp_path, tokenizer_file, [{"name": "default", "template": LLAMA}])
    assert load_hf_tokenizer(directory).chat_template == LLAMA
    named = load_hf_tokenizer(directory)
    named.save(tmp_path / "named")
    kept = json.loads((tmp_path / "named" / "tokenizer_config.json").read_text())
    assert kept["chat_template"] == [{"name": "default", "template": LLAMA}]
    (tmp_path / "chat_template.jinja").write_text(CHATML)  # transformers 5 saves it there
    from_file = load_hf_tokenizer(directory)
    assert from_file.apply_chat_template(MESSAGES) == _theirs(directory, MESSAGES)
    from_file.save(tmp_path / "saved")
    assert load_hf_tokenizer(tmp_path / "saved").chat_template == CHATML


def _one_line(info) -> str:
    message = str(info.value)
    assert "\n" not in message and "Fix:" in message
    return message


def test_errors_are_one_line(tmp_path, tokenizer_file):
    with pytest.raises(FileFormatError) as info:  # no template at all
        load_hf_tokenizer(_directory(tmp_path / "none", tokenizer_file, None)).apply_chat_template(
            MESSAGES
        )
    assert "chat_template" in _one_line(info)
    broken = load_hf_tokenizer(_directory(tmp_path / "bad", tokenizer_file, "{% for m in x %}"))
    with pytest.raises(FileFormatError) as info:
        broken.apply_chat_template(MESSAGES)
    assert "line 1" in _one_line(info)
    chatml = load_hf_tokenizer(_directory(tmp_path / "chatml", tokenizer_file, CHATML))
    with pytest.raises(TokenError) as info:  # the template's raise_exception
        chatml.apply_chat_template([{"role": "tool", "content": "x"}])
    assert "role tool is not supported" in _one_line(info)
    with pytest.raises(TokenError) as info:
        chatml.apply_chat_template("hello")
    assert "list of dicts" in _one_line(info)


def test_mask_refuses_a_template_that_is_not_prefix_stable(tmp_path, tokenizer_file):
    counting = "{{ messages | length }}" + CHATML  # every turn changes the first character
    tok = load_hf_tokenizer(_directory(tmp_path, tokenizer_file, counting))
    assert tok.apply_chat_template(MESSAGES) == _theirs(str(tmp_path), MESSAGES)
    with pytest.raises(TokenError) as info:
        tok.render_with_mask(MESSAGES)
    assert "prefix" in _one_line(info)
