"""An imported model's own tokenizer, named for what it is (issue 34, item 2).

`lmjax import-hf` of a tiny Llama with its tokenizer.json (tests/_llama_run.py) records
`data.tokenizer: hf`, and the commands that read the run encode with that tokenizer/ without an
override: `lmjax prepare --tokenizer-from RUN` (ids checked against the `tokenizers` library
reading the original tokenizer.json) and `lmjax eval` (which now names the tokenizer it used).
A run written before (its label `gpt2` over a Hugging Face tokenizer/) still loads and prepares.
`lmjax prepare --vocab-size` says when BPE training stopped short of the size asked.
Cost: ~10 s (one import, one eval compile of a 2-layer model).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import regex
import yaml
from _llama_run import TEXT, imported_run
from tokenizers import Tokenizer

from lmjax import cli, data
from lmjax.errors import ConfigError
from lmjax.tokenizers.bpe_scheme import GPT2_PATTERN
from lmjax.train.runs import load_run


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """root/base: the imported run; root/hf: the Hugging Face original; root/corpus.txt."""
    root = tmp_path_factory.mktemp("kinds")
    imported_run(root)
    return root


def _config(run) -> dict:
    return yaml.safe_load((run / "config.yaml").read_text())


def test_import_records_the_hf_tokenizer_and_it_loads(ws):
    assert _config(ws / "base")["data"]["tokenizer"] == "hf"
    tok = load_run(ws / "base").tokenizer
    hf = Tokenizer.from_file(str(ws / "hf" / "tokenizer.json"))
    assert tok.kind == "hf" and tok.encode(TEXT[:500]) == hf.encode(TEXT[:500]).ids


def _prepare(argv, capsys) -> tuple[int, str, str]:
    code = cli.main(["prepare", *argv, "--quiet"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_prepare_tokenizer_from_run_encodes_with_the_runs_tokenizer(ws, tmp_path, capsys):
    corpus = tmp_path / "docs.jsonl"
    docs = [f"Document {i}: the red fox and the lazy dog, {i * 7}." for i in range(40)]
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "prepared"
    argv = ["--corpus", str(corpus), "--tokenizer-from", str(ws / "base"), "--out", str(out)]
    code, stdout, err = _prepare(argv, capsys)
    assert code == 0, err
    assert "hf tokenizer" in stdout
    prepared = data.open_prepared(out)
    assert prepared.meta["tokenizer"] == "hf"
    hf = Tokenizer.from_file(str(ws / "hf" / "tokenizer.json"))
    eot = hf.token_to_id("<|endoftext|>")
    expected = []  # every document's ids and its end-of-text id, both splits together
    for doc in docs:
        expected += [*hf.encode(doc).ids, eot]
    got = np.concatenate([np.asarray(prepared.train), np.asarray(prepared.val)]).tolist()
    assert sorted(got) == sorted(expected) and len(got) == len(expected)


@pytest.mark.parametrize("flags", [["--tokenizer", "byte"], ["--vocab-size", "300"]])
def test_prepare_tokenizer_from_with_another_tokenizer_is_one_line(ws, tmp_path, flags, capsys):
    argv = ["--corpus", str(ws / "corpus.txt"), "--tokenizer-from", str(ws / "base"), *flags]
    code, stdout, err = _prepare([*argv, "--out", str(tmp_path / "x")], capsys)
    assert code == 2 and stdout == "" and len(err.splitlines()) == 1, err
    assert flags[0] in err and "Fix:" in err
    assert not (tmp_path / "x").exists()


def test_hf_without_a_runs_tokenizer_is_one_line(tmp_path):
    (tmp_path / "c.txt").write_text("some text to prepare " * 50)
    with pytest.raises(ConfigError) as info:
        data.prepare(str(tmp_path / "c.txt"), tmp_path / "out", tokenizer="hf", progress=False)
    message = str(info.value)
    assert "--tokenizer-from" in message and "\n" not in message
    assert not (tmp_path / "out").exists()


def test_a_run_labelled_gpt2_over_an_hf_tokenizer_still_loads_and_prepares(ws, tmp_path, capsys):
    # Runs imported before issue 34 say data.tokenizer: gpt2 over their own tokenizer.json.
    old = tmp_path / "old"
    old.mkdir()
    for name in ("model.safetensors", "tokenizer"):
        (old / name).symlink_to(ws / "base" / name)
    config = _config(ws / "base")
    config["data"]["tokenizer"] = "gpt2"
    (old / "config.yaml").write_text(yaml.safe_dump(config))
    assert load_run(old).tokenizer.kind == "hf"
    argv = ["--corpus", str(ws / "corpus.txt"), "--tokenizer-from", str(old)]
    code, stdout, err = _prepare([*argv, "--out", str(tmp_path / "p")], capsys)
    assert code == 0, err
    assert data.open_prepared(tmp_path / "p").vocab_size == load_run(old).tokenizer.vocab_size


def test_eval_of_an_imported_run_names_its_own_tokenizer(ws, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "gpt2_tokenizer", lambda: pytest.fail("GPT-2's vocabulary fetched"))
    run = tmp_path / "run"
    run.mkdir()
    for name in ("model.safetensors", "tokenizer"):
        (run / name).symlink_to(ws / "base" / name)
    config = _config(ws / "base")
    config["data"]["corpus"] = str(ws / "corpus.txt")
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    argv = ["eval", str(run), "--batches", "1", "--batch-size", "1", "--seq-len", "8"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "the run's own Hugging Face tokenizer.json" in out and "gpt2" not in out, out
    assert (
        f"{Tokenizer.from_file(str(ws / 'hf' / 'tokenizer.json')).get_vocab_size()} tokens" in out
    )


def test_prepare_says_when_bpe_learns_fewer_tokens_than_asked(tmp_path, capsys):
    corpus = tmp_path / "small.txt"
    corpus.write_text("the cat sat on the mat. " * 40 + "a dog. " * 40)
    argv = ["--corpus", str(corpus), "--tokenizer", "bpe", "--vocab-size", "512"]
    code, stdout, err = _prepare([*argv, "--out", str(tmp_path / "p")], capsys)
    assert code == 0, err
    prepared = data.open_prepared(tmp_path / "p")
    n = prepared.vocab_size
    assert n < 512 and f"has {n} tokens, fewer than --vocab-size 512" in stdout, stdout
    # What the note claims: no piece of the training split has two tokens left to merge.
    tok = prepared.tokenizer
    split = int(len(corpus.read_text()) * 0.9)
    pieces = set(regex.findall(GPT2_PATTERN, corpus.read_text()[:split]))
    assert all(len(tok.encode(p)) == 1 for p in pieces)
