"""Hugging Face tokenizer.json as an lmjax tokenizer (SPEC section 8, issue 23).

Witness: the `tokenizers` library itself, read from the file (lmjax runs the same library since
issue 34: these tests pin lmjax's checks, its byte table and its decode, and that nothing lmjax
adds changes the ids). Each tokenizer.json is built offline: a small byte-level BPE trained on
Python's own documentation with the Llama 3 / Qwen2 split regexes (or plain ByteLevel), added
tokens, ignore_merges on and off, NFC, a BOS post-processor. Our ids must equal
`tokenizers.Tokenizer.from_file(path).encode(text).ids`. Cost: ~3 s (training five 600-token
vocabularies, ~40 kB encoded per case, 150 hypothesis examples).
"""

from __future__ import annotations

import json
import pydoc_data.topics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

import lmjax.tokenizers as toks
from lmjax.errors import FileFormatError, TokenError
from lmjax.tokenizers import HFTokenizer, load_hf_tokenizer
from lmjax.tokenizers.bpe_scheme import BYTE_TO_CHAR

LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]
DOCS = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
CORPUS = [DOCS[i : i + 2000] for i in range(0, 80_000, 2000)]
CORPUS.append("東京は晴れ。日本語のテキスト。Привет мир! 🎉 émoji café naïve " * 20)

TEXTS = {
    "english": DOCS[150_000:170_000],
    "code": (
        "def f(x):\r\n\tif x:\r\n\t\treturn [i ** 2 for i in range(10)]  # tab\r\n"
        "    else:\n        pass\n\n\n  \t  trailing   \nclass A(B):\n    x: int = 1_000_000\n"
    ),
    "multilingual": (
        "héllo wörld, naïve café cafe\u0301 (NFC composes it). 東京は晴れ。 Привет! "
        "🎉🎉👩‍👩‍👧 x\u0301 it's WE'LL 12345 "
        "العربية हिन्दी 한국어 ÅΩ≈ç√∫ \u00a0nbsp\u3000ideographic   end  "
    ),
    "added tokens": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant<|endoftext|><|im_end",
}


def _train(pattern: str | None, ignore_merges: bool, *, nfc=False, bos=False, digits=False):
    hf = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if digits:  # SmolLM: each digit alone (a split leaving gaps), then ByteLevel's own regex
        split = pre_tokenizers.Digits(individual_digits=True)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pattern is None:  # GPT-2 / SmolLM style: ByteLevel's own regex
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        hf.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    hf.decoder = decoders.ByteLevel()
    if nfc:
        hf.normalizer = normalizers.NFC()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    hf.train_from_iterator(CORPUS, trainer)
    if bos:  # Llama 3's post-processor: <|begin_of_text|> before each sequence
        template = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 3)]
        )
        byte_level = processors.ByteLevel(trim_offsets=False)
        hf.post_processor = processors.Sequence([byte_level, template])
    return hf


FLAVOURS = {
    "llama3 ignore_merges bos": dict(pattern=LLAMA3, ignore_merges=True, bos=True),
    "qwen2": dict(pattern=QWEN2, ignore_merges=False),
    "gpt2 byte-level regex": dict(pattern=None, ignore_merges=False),
    "qwen2 nfc ignore_merges": dict(pattern=QWEN2, ignore_merges=True, nfc=True),
    "smollm digits then byte-level regex": dict(pattern=None, ignore_merges=False, digits=True),
}


@pytest.fixture(scope="module", params=list(FLAVOURS))
def pair(request, tmp_path_factory) -> tuple[Tokenizer, HFTokenizer]:
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    _train(**FLAVOURS[request.param]).save(str(path))
    return Tokenizer.from_file(str(path)), load_hf_tokenizer(path)


@pytest.mark.parametrize("name", list(TEXTS))
def test_ids_equal_hf_tokenizers(pair, name):
    hf, ours = pair
    text = TEXTS[name]
    assert ours.encode(text) == hf.encode(text).ids
    plain = ours.encode(text, add_special_tokens=False)
    assert plain == hf.encode(text, add_special_tokens=False).ids
    assert ours.decode(plain) == hf.decode(plain, skip_special_tokens=False)
    assert ours.vocab_size == hf.get_vocab_size(with_added_tokens=True)


def test_decode_round_trips_and_added_tokens_are_single_ids(pair):
    hf, ours = pair
    text = "".join(TEXTS.values())
    normalized = hf.normalizer.normalize_str(text) if hf.normalizer else text  # NFC composes
    assert ours.decode(ours.encode(text, add_special_tokens=False)) == normalized
    for special in SPECIALS:
        assert ours.encode(special, add_special_tokens=False) == [hf.token_to_id(special)]
    assert ours.special_tokens == {s: hf.token_to_id(s) for s in SPECIALS}


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=40) | st.text(alphabet="ab \n\t'<|>_endoftxim", max_size=40))
def test_random_unicode_matches_hf(llama_pair, text):
    hf, ours = llama_pair
    assert ours.encode(text) == hf.encode(text).ids
    assert ours.decode(ours.encode(text, add_special_tokens=False)) == text


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "tokenizer.json"
    _train(LLAMA3, True).save(str(path))
    return Tokenizer.from_file(str(path)), load_hf_tokenizer(path)


def _hand_made(ignore_merges: bool, merges) -> dict:
    """256 byte tokens, then ab=256, bc=257, abc=258; merges in the order given (not id order)."""
    vocab = {c: i for i, c in enumerate(BYTE_TO_CHAR.values())} | {"ab": 256, "bc": 257, "abc": 258}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    byte_level["use_regex"] = True
    return {
        "version": "1.0",
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges},
    }


@pytest.mark.parametrize("ignore_merges", [False, True])
@pytest.mark.parametrize("merge_format", ["lists", "strings"])
def test_pairs_merge_by_their_rank_in_merges(tmp_path, ignore_merges, merge_format):
    # bc merges first (rank 0) although ab has the smaller id, and (a, bc) is no merge: HF gives
    # [a, bc] for "abc" where a rule ranking pairs by the merged token's id gives [abc].
    merges = [["b", "c"], ["a", "b"], ["ab", "c"]]
    if merge_format == "strings":
        merges = [" ".join(m) for m in merges]
    (tmp_path / "tokenizer.json").write_text(json.dumps(_hand_made(ignore_merges, merges)))
    hf, ours = Tokenizer.from_file(str(tmp_path / "tokenizer.json")), load_hf_tokenizer(tmp_path)
    for text in ("abc", "xabcabc", "ab bc abcab"):
        assert ours.encode(text) == hf.encode(text).ids
    expected = [258] if ignore_merges else [list(BYTE_TO_CHAR.values()).index("a"), 257]
    assert ours.encode("abc") == expected == hf.encode("abc").ids


def test_saved_directory_is_hf_files_that_load_back(pair, tmp_path):
    hf, ours = pair
    ours.save(tmp_path)
    text = TEXTS["multilingual"] + TEXTS["added tokens"]
    reread = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert reread.encode(text).ids == ours.encode(text)
    again = toks.load(tmp_path)  # lmjax's own loader recognises the HF file
    assert isinstance(again, HFTokenizer) and again.encode(text) == ours.encode(text)


def _base_json(tmp_path) -> dict:
    path = tmp_path / "base.json"
    _train(LLAMA3, True, bos=True).save(str(path))
    return json.loads(path.read_text())


REFUSED = {
    "WordPiece": (lambda d: d["model"].update(type="WordPiece"), "WordPiece"),
    "byte_fallback": (lambda d: d["model"].update(byte_fallback=True), "byte_fallback"),
    "Metaspace": (lambda d: d.update(pre_tokenizer={"type": "Metaspace"}), "Metaspace"),
    "Split Removed": (
        lambda d: d["pre_tokenizer"]["pretokenizers"][0].update(behavior="Removed"),
        "Removed",
    ),
    "inverted Split": (
        lambda d: d["pre_tokenizer"]["pretokenizers"][0].update(invert=True),
        "invert",
    ),
    "prefix space": (
        lambda d: d["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True),
        "add_prefix_space",
    ),
    "NFKC": (lambda d: d.update(normalizer={"type": "NFKC"}), "NFKC"),
    "lstrip token": (lambda d: d["added_tokens"][1].update(lstrip=True), "lstrip"),
    "Roberta post-processor": (
        lambda d: d.update(post_processor={"type": "RobertaProcessing"}),
        "RobertaProcessing",
    ),
    "merge out of vocab": (lambda d: d["model"]["merges"].append(["zz", "qq"]), "'zz'"),
    "Strip decoder": (lambda d: d.update(decoder={"type": "Strip"}), "Strip"),
    # passes lmjax's checks; the tokenizers library's regex engine refuses it (one line too)
    "unclosed Split regex": (
        lambda d: d["pre_tokenizer"]["pretokenizers"][0].update(pattern={"Regex": "(a"}),
        "tokenizers library",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_parts_are_one_line_naming_them(tmp_path, case):
    data = _base_json(tmp_path)
    change, named = REFUSED[case]
    change(data)
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(FileFormatError) as info:
        load_hf_tokenizer(tmp_path / "tokenizer.json")
    message = str(info.value)
    assert named in message and "\n" not in message and "Fix:" in message


def test_bad_input_to_encode_and_decode(pair):
    _, ours = pair
    with pytest.raises(TokenError, match="surrogate"):
        ours.encode("a\ud800b")
    with pytest.raises(TokenError, match="token id"):
        ours.decode([ours.vocab_size])
    with pytest.raises(FileFormatError, match="existing file"):
        load_hf_tokenizer("/nonexistent/tokenizer.json")


def test_non_normalized_added_tokens_are_split_out_first(llama_pair, tmp_path):
    # HF matches normalized=false tokens in the raw text before normalized=true ones, so "cd"
    # (special, not normalized) wins inside "abcd" (normalized), where one leftmost-longest pass
    # over both would give "abcd".
    hf = Tokenizer.from_str(llama_pair[0].to_str())
    hf.add_tokens([AddedToken("abcd", normalized=True)])
    hf.add_special_tokens([AddedToken("cd", normalized=False, special=True)])
    hf.save(str(tmp_path / "tokenizer.json"))
    ours = load_hf_tokenizer(tmp_path / "tokenizer.json")
    for text in ("xabcdx", "abcd abcd", "ab" + "cd"):
        assert ours.encode(text) == hf.encode(text).ids
    assert hf.token_to_id("cd") in ours.encode("abcd")


@pytest.mark.parametrize("individual", [True, False])
@pytest.mark.parametrize("pattern", ["{1,3}", None], ids=["split", "digits"])
def test_split_and_digits_steps_leave_gaps_like_hf(llama_pair, tmp_path, individual, pattern):
    data = json.loads(llama_pair[0].to_str())
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    byte_level["use_regex"] = True
    first = {"type": "Digits", "individual_digits": individual}
    if pattern is not None:  # a Split whose matches leave the letters as gaps
        first = {"type": "Split", "pattern": {"Regex": r"\p{N}" + pattern}}
        first |= {"behavior": "Isolated", "invert": False}
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [first, byte_level]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    hf, ours = Tokenizer.from_file(str(tmp_path / "tokenizer.json")), load_hf_tokenizer(tmp_path)
    for text in ("ab 12345 x٣٤ ²³ 7", TEXTS["code"], TEXTS["multilingual"], "0" * 70):
        assert ours.encode(text) == hf.encode(text).ids


def test_a_text_encoded_in_chunks_gets_the_post_processor_ids_once(pair):
    """`lmjax prepare` encodes long documents in chunks: the ids of the chunks must be the ids
    of the whole document by the tokenizers library (Llama 3's BOS once, at the start)."""
    from lmjax.data import encoding

    hf, ours = pair
    text = "".join(f"The fox {i} jumps.\nIt sleeps {i}.\n" for i in range(40))
    assert len(list(encoding.chunks(text, 64))) > 10  # many cuts at this size
    ids = encoding.encode_text(ours, text, "int32", size=64)
    assert ids.tolist() == hf.encode(text).ids
