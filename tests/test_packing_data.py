"""Packed batches (data.packing): rows of whole documents with segment ids and a loss mask.

The split here is `tokens[i] = i + 1` (0 is left for padding), so every id says where it came
from; the witness for documents is the list of lengths, walked in Python."""

from __future__ import annotations

import numpy as np
import pytest

from lmjax.data import packing
from lmjax.data import prepared as D
from lmjax.errors import TokenError

T = 16
LENGTHS = [5, 3, 40, 1, 17, 16, 9, 2, 2, 60, 4, 11, 7, 18, 3, 6] * 3  # some longer than T + 1


def _split():
    offsets = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int64)
    tokens = np.arange(1, offsets[-1] + 1, dtype=np.uint16)
    return tokens, offsets


def _doc_of(position: int) -> tuple[int, int]:
    """(document, index inside it) of a split position, walking LENGTHS."""
    start = 0
    for d, n in enumerate(LENGTHS):
        if position < start + n:
            return d, position - start
        start += n
    raise AssertionError(position)


def _segments(ids_row, seg_row):
    """[(segment id, positions)] of one row's T + 1 slots, padding left out."""
    out = {}
    for i, s in zip(ids_row, seg_row, strict=True):
        if s:
            out.setdefault(int(s), []).append(int(i) - 1)
    return sorted(out.items())


def _full_rows(batch, pad=0):
    """The rows' T + 1 slots: ids and segments (the last slot's segment: its input's when the
    mask links them, a new one when it holds a real id, else padding)."""
    seq = batch["inputs"].shape[-1]
    ids = np.concatenate([batch["inputs"], batch["targets"][..., -1:]], -1).reshape(-1, seq + 1)
    seg = batch["segment_ids"].reshape(-1, seq)
    linked = batch["loss_mask"].reshape(-1, seq)[:, -1] > 0
    new = np.where(ids[:, -1] != pad, seg.max(-1) + 1, 0)
    last = np.where(linked, seg[:, -1], new)
    return ids, np.concatenate([seg, last[:, None]], -1)


def test_rows_hold_whole_documents_then_padding():
    tokens, offsets = _split()
    seen_piece = seen_pad = 0
    for step in range(6):
        batch = D.train_batch(tokens, 5, step, 16, T, 2, documents=offsets)
        assert set(batch) == {"inputs", "targets", "segment_ids", "loss_mask"}
        assert batch["inputs"].shape == (2, 8, T) and batch["segment_ids"].dtype == np.int32
        for ids, seg in zip(*_full_rows(batch), strict=True):
            segs = _segments(ids, seg)
            assert [s for s, _ in segs] == list(range(1, len(segs) + 1))  # 1, 2, ... in order
            docs = []
            for number, positions in segs:
                (d,), idx = {_doc_of(p)[0] for p in positions}, [_doc_of(p)[1] for p in positions]
                assert idx == list(range(idx[0], idx[0] + len(idx)))  # contiguous in one doc
                whole = idx[0] == 0 and len(idx) == LENGTHS[d]
                # Only a document longer than the row is cut, into pieces starting every T; a
                # piece opens the row and fills it, or is the document's last (then whole
                # documents may follow it).
                fills, last = len(idx) == T + 1, idx[-1] == LENGTHS[d] - 1
                piece = LENGTHS[d] > T + 1 and idx[0] % T == 0 and number == 1
                assert whole or piece and (fills or last)
                seen_piece += not whole
                docs.append(d)
            assert docs == list(range(docs[0], docs[0] + len(docs)))  # consecutive documents
            used = sum(len(p) for _, p in segs)
            assert (seg[used:] == 0).all() and (ids[used:] == 0).all()  # the tail is padding
            if used < T + 1 and docs[-1] + 1 < len(LENGTHS):
                nxt = docs[-1] + 1  # padding only where the next document does not fit
                assert LENGTHS[nxt] > T + 1 - used or len(segs) == 1 and used < LENGTHS[docs[0]]
                seen_pad += 1
    assert seen_piece and seen_pad  # both cases were exercised


def test_the_loss_mask_is_one_exactly_on_next_tokens_of_the_same_document():
    tokens, offsets = _split()
    batch = D.eval_batch(tokens, 2, 3, 32, T, documents=offsets)
    x, y, seg, mask = (batch[k] for k in ("inputs", "targets", "segment_ids", "loss_mask"))
    same_doc = np.vectorize(lambda a, b: a > 0 and b > 0 and _doc_of(a - 1)[0] == _doc_of(b - 1)[0])
    want = (y == x + 1) & same_doc(x, y)  # the target is the very next id of input's document
    np.testing.assert_array_equal(mask, want.astype(np.float32))
    assert mask.dtype == np.float32 and ((seg == 0) <= (mask == 0)).all()
    real = sum(
        len(p) - 1 for ids, s in zip(*_full_rows(batch), strict=True) for _, p in _segments(ids, s)
    )
    assert D.packing_efficiency(batch) == pytest.approx(real / (32 * T)) and 0 < real < 32 * T
    assert D.packing_efficiency(D.eval_batch(tokens, 2, 3, 4, T)) == 1.0  # unpacked: no mask


def test_every_token_of_a_long_document_is_predicted_once_over_its_pieces():
    tokens, offsets = _split()
    d = LENGTHS.index(60)
    start = int(offsets[d])
    pairs = []
    for p in range(start, start + 60, T):  # one draw inside each piece
        ids, seg, _ = packing.packed_row(tokens, offsets, p, T)
        pairs += [
            (a, b) for a, b, s, t in zip(ids, ids[1:], seg, seg[1:], strict=False) if s and s == t
        ]
    want = [(start + i + 1, start + i + 2) for i in range(59)]
    ours = [(a, b) for a, b in pairs if start < a <= start + 60]  # (the last piece's followers
    assert sorted(ours) == want  # are other documents, checked above)


def test_packed_batches_are_a_pure_function_of_seed_and_step_and_shard_by_rows():
    tokens, offsets = _split()
    a = D.train_batch(tokens, 3, 7, 8, T, 2, documents=offsets)
    b = D.train_batch(tokens, 3, 7, 8, T, 2, documents=offsets)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(
        a["inputs"], D.train_batch(tokens, 3, 8, 8, T, 2, documents=offsets)["inputs"]
    )
    assert not np.array_equal(
        a["inputs"], D.train_batch(tokens, 4, 7, 8, T, 2, documents=offsets)["inputs"]
    )
    part = D.train_batch(tokens, 3, 7, 8, T, 2, rows=[1, 3], documents=offsets)
    for key in a:
        np.testing.assert_array_equal(part[key], a[key][:, [1, 3]])
    # Evaluation draws from its own stream.
    ev = D.eval_batch(tokens, 3, 7, 8, T, documents=offsets)
    assert not np.array_equal(ev["inputs"], a["inputs"].reshape(8, T))
    # Unpacked batches stay random crops with no mask.
    assert set(D.train_batch(tokens, 3, 7, 8, T, 2)) == {"inputs", "targets"}


def test_a_bad_id_in_a_packed_row_names_its_position():
    tokens, offsets = _split()
    bad = tokens.copy()
    bad[:] = 999
    with pytest.raises(TokenError, match="token id at position .* \\(train step 1\\) = 999"):
        D.train_batch(bad, 0, 0, 4, T, 1, vocab_size=500, documents=offsets)
    D.train_batch(tokens, 0, 0, 4, T, 1, vocab_size=int(tokens.max()) + 1, documents=offsets)


def test_packing_a_prepared_corpus(tmp_path):
    import json

    path = tmp_path / "c.jsonl"
    texts = [f"document number {i} " + "la " * (i % 9) for i in range(30)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = D.prepare(str(path), tmp_path / "out", tokenizer="bpe", vocab_size=280, progress=False)
    p = D.open_prepared(out)
    eot = p.meta["eot_id"]
    batch = D.train_batch(p.train, 0, 0, 8, 24, 1, documents=p.train_documents)
    ids, seg = _full_rows(batch)
    for row, s in zip(ids, seg, strict=True):
        for number in set(s[s > 0].tolist()):
            piece = row[s == number]
            if piece[-1] == eot:  # a whole document: its text is one of the corpus's
                assert p.tokenizer.decode(piece[:-1]) in texts


def test_the_data_section_takes_packing_and_the_prepare_settings():
    from pathlib import Path

    from lmjax.config import load_run_config
    from lmjax.errors import ConfigError

    config = Path(__file__).parent.parent / "configs" / "tiny-shakespeare.yaml"
    extra = ["data.packing=true", "data.field=body", "data.workers=2", "data.eot=none"]
    d = load_run_config(config, extra).data
    assert (d.packing, d.field, d.workers, d.eot, d.skip_bad) == (True, "body", 2, "none", False)
    assert load_run_config(config).data.packing is False  # unpacked crops stay the default
    for bad, named in (("data.workers=0", "data.workers = 0"), ("data.field=", "data.field")):
        with pytest.raises(ConfigError, match=named):
            load_run_config(config, [bad])
