"""`lmjax chat` and `lmjax generate --chat / --show-ids` (issue 34, item 4) against transformers.

The model: `_llama_run.hf_checkpoint(chat=True)`, a tiny random Llama whose tokenizer has ChatML's
markers, a chat template with a default system turn, eos_token <|im_end|> in
tokenizer_config.json and eos_token_id [<|im_end|>, <|endoftext|>] in generation_config.json; its
head is set so that the greedy reply to the first prompt ends with <|im_end|> as its 4th token.
`lmjax import-hf` makes it a run (generation_config.json kept in RUN/tokenizer/).

Witnesses: transformers' `AutoTokenizer.apply_chat_template` for the ids of the first turn's
prompt and the text of the second (whose ids keep the first reply's ids as generated, `reference`),
and `AutoModelForCausalLM.generate(do_sample=False)` (which stops at the generation config's eos
ids) for every reply. Greedy decoding in float32 compares argmaxes, so each step's top-2 gap
of transformers' logits is asserted to be well above what the two float32 forward passes can
differ by (`GAP`). Cost: ~25 s (the chat and generate runs each compile prefill and decode).
"""

from __future__ import annotations

import io
import json
import re
import shutil

import pytest
import torch
import transformers
from _llama_run import CHAT_PROMPT, CHAT_TEMPLATE, EOS_STEP, imported_run

from lmjax import chat, cli
from lmjax.errors import FileFormatError

# Logits are O(1) here (|logit| < 2); two float32 forward passes of 2 layers of width <= 128
# differ by about sqrt(#terms) * eps_f32 * |logit| per reduction, < 1e-5 over the whole
# model; a top-2 gap of 1e-3 leaves two orders of magnitude for reordered sums.
GAP = 1e-3
MAX_NEW = 8
TURNS = [CHAT_PROMPT[0]["content"], "And the dog?"]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    run = imported_run(root, chat=True)
    return root / "hf", run


@pytest.fixture(scope="module")
def reference(chat_run):
    """transformers' ids for both turns: [(prompt ids, reply ids)], the reply stopped at eos.

    The second prompt is the first prompt, the first reply's ids as generated (without its stop
    id) and the rest of transformers' rendering of the conversation, encoded: chat keeps a
    reply's ids, and this model's first reply does not survive decode and encode (a lone
    UTF-8 lead byte that decodes to U+FFFD), so re-encoding its text would give other ids."""
    hf_dir, _ = chat_run
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    stops = model.generation_config.eos_token_id
    messages, turns = [], []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        prompt = _template_ids(tok, messages)
        if turns:
            prompt = _kept_reply_prompt(tok, messages, *turns[-1], stops)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=MAX_NEW,
                output_logits=True,
                return_dict_in_generate=True,
            )
        for logits in out.logits:
            top2 = torch.topk(logits[0], 2).values
            assert float(top2[0] - top2[1]) > GAP  # the argmax is not a float32 tie
        reply = out.sequences[0, len(prompt) :].tolist()
        turns.append((prompt, reply))
        content = [i for i in reply if i not in stops]
        messages.append(
            {"role": "assistant", "content": tok.decode(content, skip_special_tokens=True)}
        )
    return turns, tok


def _template_ids(tok, messages) -> list[int]:
    return tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def _rendered(tok, messages) -> str:
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _kept_reply_prompt(tok, messages, prompt, reply, stops) -> list[int]:
    """The prompt of messages [..., user, assistant, user] keeping the assistant's reply ids."""
    whole, before = _rendered(tok, messages), _rendered(tok, messages[:-2])
    content = messages[-2]["content"]
    assert whole.startswith(before + content)
    assert tok.encode(before, add_special_tokens=False) == prompt
    rest = tok.encode(whole[len(before) + len(content) :], add_special_tokens=False)
    kept = prompt + [i for i in reply if i not in stops] + rest
    assert tok.decode(kept) == whole  # the same text as transformers renders
    assert kept != _template_ids(tok, messages)  # which, encoded, has other ids
    return kept


def _ids(out: str, label: str) -> list[list[int]]:
    return [json.loads(m) for m in re.findall(rf"^{label} ids: (\[.*\])$", out, re.M)]


def _chat(run, capsys, *extra: str) -> str:
    argv = ["chat", str(run), "--temperature", "0", "--max-new-tokens", str(MAX_NEW)]
    assert cli.main([*argv, "--show-ids", *extra]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


def test_the_model_ends_its_first_reply_with_end_of_turn(reference):
    turns, tok = reference
    reply = turns[0][1]
    assert reply[-1] == tok.convert_tokens_to_ids("<|im_end|>") and len(reply) == EOS_STEP + 1


def test_chat_turns_equal_apply_chat_template_and_greedy_generate(chat_run, reference, capsys):
    _, run = chat_run
    turns, tok = reference
    out = _chat(run, capsys, "--message", TURNS[0], "--message", TURNS[1])
    assert _ids(out, "prompt") == [p for p, _ in turns]
    assert _ids(out, "new") == [r for _, r in turns]
    # The printed reply is its text without the end-of-turn token.
    first = tok.decode(turns[0][1][:-1], skip_special_tokens=True)
    assert f"> {TURNS[0]}\n{first}\nprompt ids:" in out and "<|im_end|>" not in out


def test_chat_reads_user_turns_from_stdin(chat_run, reference, capsys, monkeypatch):
    _, run = chat_run
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{TURNS[0]}\n\n{TURNS[1]}\n"))
    out = _chat(run, capsys)
    assert _ids(out, "new") == [r for _, r in reference[0]]  # the empty line is no turn
    assert "> " not in out  # no prompt sign when stdin is not a terminal


def test_generate_chat_and_show_ids(chat_run, reference, capsys):
    _, run = chat_run
    argv = ["generate", "--run", str(run), "--temperature", "0", "--show-ids"]
    argv += ["--max-new-tokens", str(MAX_NEW)]
    assert cli.main([*argv, "--chat", "--prompt", TURNS[0]]) == 0
    out = capsys.readouterr().out
    assert _ids(out, "prompt") == [reference[0][0][0]]
    assert _ids(out, "new") == [reference[0][0][1]]
    # Plain text: the prompt's ids are the tokenizer's, and MAX_NEW ids follow (no stop ids).
    assert cli.main([*argv, "--prompt", "The quick fox"]) == 0
    out = capsys.readouterr().out
    tok = reference[1]
    assert _ids(out, "prompt") == [tok.encode("The quick fox", add_special_tokens=False)]
    (new,) = _ids(out, "new")
    assert len(new) == MAX_NEW
    assert out.startswith("The quick fox" + tok.decode(new))


def test_import_and_export_carry_generation_config(chat_run, tmp_path, capsys):
    hf_dir, run = chat_run
    assert json.loads((run / "tokenizer" / "generation_config.json").read_text()) == {
        "eos_token_id": [2, 0]
    }
    assert cli.main(["export-hf", str(run), "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    config = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert config.eos_token_id == [2, 0]


def test_a_fine_tune_finds_the_generation_config_of_its_base(chat_run, tmp_path):
    from lmjax.train.finetuned import FinetuneSpec

    _, run = chat_run
    spec = FinetuneSpec(str(run), str(run.resolve()), qlora=False, lora=None, full=True)
    (tmp_path / "ft").mkdir()
    (tmp_path / "ft" / "finetune.yaml").write_text(spec.to_yaml())
    assert chat.generation_config_dir(tmp_path / "ft") == run / "tokenizer"
    (tmp_path / "ft" / "merged").mkdir()  # the fine-tune's merged weights-only run
    assert chat.generation_config_dir(tmp_path / "ft" / "merged") == run / "tokenizer"
    assert chat.generation_config_dir(tmp_path) is None


def test_stop_ids_take_an_int_or_a_list_and_the_eos_token(chat_run):
    from lmjax.tokenizers import load

    _, run = chat_run
    tok = load(run / "tokenizer")
    assert chat.stop_ids(tok, {"eos_token_id": 0}, 300) == [0, 2]
    assert chat.stop_ids(tok, {"eos_token_id": [2, 0, 7]}, 300) == [2, 0, 7]
    assert chat.stop_ids(tok, {}, 300) == [2]
    assert chat.stop_ids(tok, {"eos_token_id": [512]}, 300) == [2]  # past the model's vocab
    with pytest.raises(FileFormatError, match="eos_token_id"):
        chat.stop_ids(tok, {"eos_token_id": "2"}, 300)


def _one_error_line(argv, capsys) -> str:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lmjax {argv[0]}: error: "), captured.err
    return lines[0]


def test_chat_errors_are_one_line(chat_run, tmp_path, capsys):
    _, run = chat_run
    plain = tmp_path / "plain"
    shutil.copytree(run, plain)
    config = plain / "tokenizer" / "tokenizer_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"chat_template": None}))
    line = _one_error_line(["chat", str(plain), "--message", "hi"], capsys)
    assert "without a chat template" in line and "lmjax generate" in line
    # The fix can be followed: a chat_template.jinja in RUN/tokenizer/ (as transformers saves).
    assert f"Fix: copy the chat model's chat_template.jinja into {plain / 'tokenizer'} " in line
    generate = ["generate", "--run", str(plain), "--chat", "--prompt", "hi"]
    assert _one_error_line(generate, capsys).endswith(line.partition("error: ")[2])
    (plain / "tokenizer" / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    _chat(plain, capsys, "--message", "hi")
    (plain / "tokenizer" / "generation_config.json").write_text('{"eos_token_id": "two"}')
    shutil.copyfile(run / "tokenizer" / "tokenizer_config.json", config)
    line = _one_error_line(["chat", str(plain), "--message", "hi"], capsys)
    assert "eos_token_id = 'two'" in line
    line = _one_error_line(["chat", str(run), "--message", "hi", "--max-new-tokens", "500"], capsys)
    assert "--max-new-tokens = 500" in line


def test_import_refuses_a_bad_generation_config_and_writes_nothing(chat_run, tmp_path, capsys):
    hf_dir, _ = chat_run
    shutil.copytree(hf_dir, tmp_path / "hf")
    (tmp_path / "hf" / "generation_config.json").write_text('{"eos_token_id": [2, -1]}')
    line = _one_error_line(
        ["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "r")], capsys
    )
    assert "generation_config.json: eos_token_id = [2, -1]" in line
    assert not (tmp_path / "r").exists()
