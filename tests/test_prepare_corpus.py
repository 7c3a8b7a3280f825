"""`lmjax prepare` over many files and formats: documents, the document-level validation split,
shards and their index, the content-keyed cache, bad records, workers and bounded memory.

The witness throughout is the byte tokenizer (ids = UTF-8 bytes, computed here with
`str.encode`) and, for the end-of-text id, a bpe vocabulary's `<|endoftext|>` read from its
own special tokens."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmjax.data import prepared as D
from lmjax.errors import ConfigError, FileFormatError

ROOT = Path(__file__).parent.parent


def _texts(prefix: str, n: int) -> list[str]:
    return [f"{prefix} {i}: " + "caf\u00e9 word " * (i % 5) + "end" for i in range(n)]


@pytest.fixture()
def corpus(tmp_path, monkeypatch):
    """A directory of every format; returns (path, the documents in reading order)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "corpus"
    (root / "b").mkdir(parents=True)
    docs = {}
    docs["a.txt"] = ["a whole text file\nis one document\n"]
    (root / "a.txt").write_text(docs["a.txt"][0], encoding="utf-8")
    docs["b/c.jsonl.gz"] = _texts("gz", 7)
    with gzip.open(root / "b/c.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.writelines(
            json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs["b/c.jsonl.gz"])
        )
    docs["b/d.parquet"] = _texts("pq", 11)
    table = pa.table({"id": list(range(11)), "text": docs["b/d.parquet"]})
    pq.write_table(table, root / "b/d.parquet", row_group_size=3)
    docs["e.jsonl"] = _texts("js", 9)
    lines = [json.dumps({"text": t}) for t in docs["e.jsonl"]]
    (root / "e.jsonl").write_text("\n".join(lines[:4] + [""] + lines[4:]) + "\n")  # a blank line
    (root / "notes.md").write_text("not a corpus file: skipped in a directory")
    ordered = [t for name in sorted(docs) for t in docs[name]]  # a.txt, b/c..., b/d..., e.jsonl
    return root, ordered


def _documents(tokens, offsets) -> list[bytes]:
    return [
        bytes(np.asarray(tokens[a:b], np.uint8))
        for a, b in zip(offsets[:-1], offsets[1:], strict=True)
    ]


def test_a_directory_of_every_format_is_split_into_whole_documents(corpus, tmp_path):
    root, texts = corpus
    out = D.prepare(
        str(root), tmp_path / "out", tokenizer="byte", val_fraction=0.25, progress=False
    )
    p = D.open_prepared(out)
    train = _documents(p.train, p.train_documents)
    val = _documents(p.val, p.val_documents)
    # Whole documents, none cut, each exactly once, in reading order within each split.
    want = [t.encode() for t in texts]
    assert len(val) == round(0.25 * len(want)) and sorted(train + val) == sorted(want)
    assert [d for d in want if d in train] == train and [d for d in want if d in val] == val
    # The byte tokenizer has no end-of-text id: documents are laid end to end (eot auto).
    assert p.meta["eot_id"] is None and len(p.train) == sum(map(len, train))
    assert sorted(x.name for x in out.iterdir()) == [
        "meta.json", "tokenizer", "train.bin", "train.idx", "val.bin", "val.idx"
    ]  # fmt: skip
    # The split is seeded: preparing again elsewhere picks the same validation documents.
    again = D.open_prepared(
        D.prepare(
            str(root), tmp_path / "again", tokenizer="byte", val_fraction=0.25, progress=False
        )
    )
    assert _documents(again.val, again.val_documents) == val


def test_each_document_ends_with_the_end_of_text_id(corpus, tmp_path):
    root, texts = corpus
    out = D.prepare(str(root), tmp_path / "bpe", tokenizer="bpe", vocab_size=300, progress=False)
    p = D.open_prepared(out)
    eot = p.tokenizer.special_tokens["<|endoftext|>"]
    assert p.meta["eot_id"] == eot
    decoded = []
    for tokens, offsets in ((p.train, p.train_documents), (p.val, p.val_documents)):
        for a, b in zip(offsets[:-1], offsets[1:], strict=True):
            ids = np.asarray(tokens[a:b])
            assert ids[-1] == eot and eot not in ids[:-1]
            decoded.append(p.tokenizer.decode(ids[:-1]))
    assert sorted(decoded) == sorted(texts)
    # eot none: no separator (and another cache key: another directory).
    plain = D.open_prepared(
        D.prepare(str(root), tokenizer="bpe", vocab_size=300, progress=False, eot="none")
    )
    assert eot not in np.asarray(plain.train) and plain.meta["eot_id"] is None
    with pytest.raises(ConfigError, match="data.eot = '<|pad|>'"):
        D.prepare(str(root), tmp_path / "x", tokenizer="bpe", vocab_size=300, eot="<|pad|>")


def test_field_globs_and_parquet_columns(tmp_path):
    (tmp_path / "one.jsonl").write_text(
        "".join(json.dumps({"body": f"doc {i}"}) + "\n" for i in range(4))
    )
    (tmp_path / "two.jsonl").write_text(
        "".join(json.dumps({"body": f"more {i}"}) + "\n" for i in range(4))
    )
    out = D.prepare(
        str(tmp_path / "*.jsonl"), tmp_path / "g", tokenizer="byte", field="body", progress=False
    )
    p = D.open_prepared(out)
    got = _documents(p.train, p.train_documents) + _documents(p.val, p.val_documents)
    assert sorted(got) == sorted(
        [f"doc {i}".encode() for i in range(4)] + [f"more {i}".encode() for i in range(4)]
    )
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "t.parquet")
    with pytest.raises(FileFormatError, match=r"t.parquet column 'text' = 'no such column'"):
        D.prepare(str(tmp_path / "t.parquet"), tmp_path / "p", tokenizer="byte", progress=False)
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(FileFormatError, match=r"n.parquet column 'text' = 'a int64 column'"):
        D.prepare(str(tmp_path / "n.parquet"), tmp_path / "p", tokenizer="byte", progress=False)


def test_the_output_does_not_depend_on_the_worker_count(corpus, tmp_path, monkeypatch):
    """... and the workers are not forked from this process, which has JAX's threads (a fork
    server or spawned interpreters start them; os.fork here would raise)."""
    root, _ = corpus

    def no_fork():
        raise AssertionError("prepare forked a worker from a process with JAX loaded")

    monkeypatch.setattr(os, "fork", no_fork)
    one = D.prepare(str(root), tmp_path / "w1", tokenizer="char", progress=False, workers=1)
    two = D.prepare(str(root), tmp_path / "w2", tokenizer="char", progress=False, workers=2)
    files = lambda d: {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file()}  # noqa: E731
    assert files(one) == files(two)
    assert {"train.bin", "train.idx", "val.bin", "val.idx", "meta.json"} < set(files(one))


def test_shards_and_their_index(corpus, tmp_path):
    root, texts = corpus
    out = D.prepare(str(root), tmp_path / "s", tokenizer="byte", progress=False, shard_tokens=100)
    p = D.open_prepared(out)
    n = p.meta["train_tokens"]
    names = sorted(x.name for x in out.glob("train-*.bin"))
    assert len(names) == -(-n // 100) > 2 and not (out / "train.bin").exists()
    whole = np.concatenate([np.fromfile(out / name, np.uint16) for name in names])
    np.testing.assert_array_equal(np.asarray(p.train), whole)
    np.testing.assert_array_equal(p.train[95:305], whole[95:305])  # across three shards
    assert len(p.train) == n and int(p.train[-1]) == whole[-1]
    x, y = D.crops(p.train, 0, 0, 3, 8, 150)
    assert x.shape == (8, 150) and (x[:, 1:] == y[:, :-1]).all()
    with open(out / names[1], "r+b") as handle:
        handle.truncate(6)
    with pytest.raises(FileFormatError, match=f"{names[1]} = '6 bytes'"):
        D.open_prepared(out)


def test_the_cache_is_keyed_by_content(corpus):
    root, _ = corpus
    first = D.prepare(str(root), tokenizer="byte", progress=False)
    stamp = (first / "train.bin").stat().st_mtime_ns
    assert D.prepare(str(root), tokenizer="byte", progress=False) == first  # reused, untouched
    assert (first / "train.bin").stat().st_mtime_ns == stamp
    with open(root / "e.jsonl", "a") as handle:  # a changed file: another key, rebuilt
        handle.write(json.dumps({"text": "one more"}) + "\n")
    second = D.prepare(str(root), tokenizer="byte", progress=False)
    count = lambda d: (lambda m: m["train_documents"] + m["val_documents"])(D._read_meta(d))  # noqa: E731
    assert second != first and count(second) == count(first) + 1
    # Another reading setting is another key too (a new directory, not a refusal).
    third = D.prepare(str(root), tokenizer="byte", progress=False, skip_bad=True)
    assert third not in (first, second) and count(third) == count(second)


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b'{"text": "ok"', "invalid JSON"),
        (b'["text"]', "a JSON list, not an object"),
        (b'{"body": "x"}', "no field 'text'"),
        (b'{"text": 7}', "field 'text' is int, not a string"),
        (b'{"text": "caf\xe9"}', "not UTF-8"),
    ],
)
def test_a_bad_record_is_one_line_naming_its_file_and_line(tmp_path, line, reason):
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'{"text": "good one"}\n{"text": "good two"}\n' + line + b"\n")
    with pytest.raises(FileFormatError, match=f"record {path}:3 = .*{reason}") as err:
        D.prepare(str(path), tmp_path / "out", tokenizer="byte", progress=False)
    assert "\n" not in str(err.value) and "--skip-bad" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_skip_bad_counts_and_reports_the_skipped_records(tmp_path, capsys):
    path = tmp_path / "c.jsonl"
    good = [json.dumps({"text": f"doc {i}"}) for i in range(5)]
    path.write_text(
        "\n".join([good[0], "{oops", good[1], '{"text": null}', good[2], "[]"] + good[3:])
    )
    out = D.prepare(str(path), tmp_path / "out", tokenizer="byte", progress=False, skip_bad=True)
    assert "skipped 3 bad records (first: " + f"{path}:2: invalid JSON" in capsys.readouterr().err
    p = D.open_prepared(out)
    assert p.meta["skipped_records"] == 3 and p.meta["first_skipped"].startswith(f"{path}:2")
    assert p.meta["train_documents"] + p.meta["val_documents"] == 5


def test_empty_and_single_document_corpora(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="data.corpus = .*empty"):
        D.prepare(str(tmp_path / "empty"), tmp_path / "a", progress=False)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(FileFormatError, match="= '0 documents'"):
        D.prepare(str(blank), tmp_path / "b", progress=False)
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"text": "just one"}) + "\n")
    with pytest.raises(FileFormatError, match="1 documents.*at least 2 documents.*one .txt file"):
        D.prepare(str(one), tmp_path / "c", progress=False)


def test_the_progress_bar_counts_bytes_and_documents(corpus, tmp_path, capsys):
    root, _ = corpus
    D.prepare(str(root), tmp_path / "out", tokenizer="byte", progress=True, workers=1)
    err = capsys.readouterr().err
    assert "tokenizing: 100%" in err and "documents=28" in err and "B/s" in err


# Prepares a corpus in a fresh process and prints its peak RSS growth (KiB) over a warm-up
# prepare of a tiny corpus (the code paths loaded, the baseline measured after them). The
# buffers are made small (64 KiB) so that a corpus of a few MiB is many times them.
MEMORY = textwrap.dedent(
    """
    import json, resource, sys
    from pathlib import Path
    from lmjax.data import prepare_docs, text_stream
    from lmjax.data import prepared as data
    prepare_docs._BATCH_CHARS = data._CHUNK = text_stream.BLOCK = 1 << 16
    big, tiny, out = map(Path, sys.argv[1:4])
    data.prepare(str(tiny), out / "tiny", tokenizer="byte", progress=False, workers=1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    data.prepare(str(big), out / "big", tokenizer="byte", progress=False, workers=1)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth_kib": after - before}))
    """
)


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_memory_is_bounded_by_the_buffer_not_the_corpus(tmp_path, suffix):
    """A 16 MiB corpus (many documents, or one text) prepares within 4 MiB of RSS growth: the
    old reader held the whole text, its bytes and its ids, several times the corpus (about
    1 MiB measured for both now)."""
    big, tiny = tmp_path / f"big{suffix}", tmp_path / f"tiny{suffix}"
    line = ("to be, or not to be: that is the question. " * 90).rstrip()  # "\S\n\S": safe cuts
    record = json.dumps({"text": line}) + "\n" if suffix == ".jsonl" else line + "\n"
    with open(big, "w") as handle:
        handle.writelines(record for _ in range((16 << 20) // len(record)))
    tiny.write_text(record * 4)
    env = dict(os.environ, PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(tmp_path / "cache"))
    argv = [sys.executable, "-c", MEMORY, str(big), str(tiny), str(tmp_path)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    growth = json.loads(done.stdout.strip().splitlines()[-1])["growth_kib"]
    assert growth < 4 * 1024, f"RSS grew {growth} KiB preparing a 16 MiB corpus"
    written = sum(p.stat().st_size for p in (tmp_path / "big").glob("*.bin"))
    assert written > 15 << 20


def test_a_text_the_tokenizer_refuses_is_a_bad_record(tmp_path, capsys):
    path = tmp_path / "c.jsonl"
    texts = ["hello there", "a <|endoftext|> inside", "third", "fourth one"]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    with pytest.raises(FileFormatError, match=f"record {path}:2 = .*refused.*<\\|endoftext\\|>"):
        D.prepare(str(path), tmp_path / "a", tokenizer="bpe", vocab_size=260, progress=False)
    assert not (tmp_path / "a").exists()
    out = D.prepare(
        str(path), tmp_path / "b", tokenizer="bpe", vocab_size=260, progress=False, skip_bad=True
    )
    assert (
        f"skipped 1 bad record (first: {path}:2: the tokenizer refused" in capsys.readouterr().err
    )
    meta = D.open_prepared(out).meta
    assert meta["train_documents"] + meta["val_documents"] == 3 and meta["skipped_records"] == 1


def test_the_prepare_command_takes_the_new_flags(tmp_path, capsys, monkeypatch):
    from lmjax import cli

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"body": f"doc {i}"}) + "\n" for i in range(9)) + "{bad\n")
    argv = ["prepare", "--corpus", str(path), "--field", "body", "--skip-bad", "--workers", "1"]
    assert cli.main([*argv, "--tokenizer", "byte", "--out", str(tmp_path / "o"), "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert "8 + 1 documents" in out and f"skipped 1 bad record (first: {path}:10: invalid" in err
    meta = D.open_prepared(tmp_path / "o").meta
    assert meta["field"] == "body" and meta["skip_bad"] is True
