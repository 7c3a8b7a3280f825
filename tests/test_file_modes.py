"""What lmjax writes is readable as the user's umask says (issue 47 item 3): every file 0o666
and every directory 0o777 less the umask, as `open()` and `mkdir` make them (0644 / 0755 under
umask 022, 0600 / 0700 under 077), never tempfile's owner-only 0600 / 0700.

The commands run as a user runs them (`lmjax train`, `import-hf` of a tiny `transformers` Llama
saved offline, `export-hf`, `prepare --out`) under a umask the test sets (and restores),
writing into one output tree; the whole tree is walked, so a new writer anywhere in it is
covered without a new line here. A run's copy of cached files (its tokenizer/) follows the
umask too, even from a cache an older lmjax wrote owner-only. tests/test_finetune_ux.py walks a
fine-tune's tree (adapters, merged/, checkpoints, samples, SFT data) the same way
(tests/_file_modes.py).

Cost: one 2-step train of a 1-layer model (~6 s on the loaded 2 cores, its step compiled from
the suite's cache after the first run), the rest well under a second each.
"""

from __future__ import annotations

import pytest
from _file_modes import assert_modes, umask
from _llama_run import TEXT, hf_checkpoint

from lmjax import cli

TRAIN = """
model: {preset: gpt, vocab_size: null, context_length: 16, d_model: 32, n_heads: 4, n_layers: 1,
        d_ff: 64}
data: {corpus: corpus.txt, tokenizer: char}
train: {steps: 2, batch_size: 2, seq_len: 16, eval_every: 2, eval_batches: 1}
checkpoint: {every: 2}
logging: {every: 1, progress: false, sample_tokens: 4, sample_prompt: T}
"""


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """tmp_path as the working directory, with a tiny chat Llama saved by transformers in hf/ and
    a corpus (both written by the test, outside out/); the cache of prepared data in cache/."""
    hf_checkpoint(tmp_path / "hf", chat=True)
    (tmp_path / "corpus.txt").write_text(TEXT)
    (tmp_path / "train.yaml").write_text(TRAIN)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


# What the walk must see: the import's weights, tokenizer and stop ids, the export's files.
IMPORTED = (
    "llama/model.safetensors",
    "llama/config.yaml",
    "llama/tokenizer/tokenizer.json",
    "llama/tokenizer/tokenizer_config.json",
    "llama/tokenizer/generation_config.json",
    "exported/config.json",
    "exported/model.safetensors",
    "exported/tokenizer.json",
    "exported/tokenizer_config.json",
    "exported/generation_config.json",
)


def _import_and_export() -> None:
    assert cli.main(["import-hf", "hf", "--out", "out/llama"]) == 0
    assert cli.main(["export-hf", "out/llama", "--out", "out/exported"]) == 0


def test_train_import_and_export_write_0644_under_umask_022(workdir):
    """The data `lmjax train` prepares is cached outside out/ and made owner-only (as an lmjax
    before this fix wrote it): the run's copy of its tokenizer still follows the umask."""
    assert cli.main(["prepare", "--corpus", "corpus.txt"]) == 0  # into the cache train reads
    for path in (workdir / "cache").rglob("*"):
        path.chmod(0o700 if path.is_dir() else 0o600)
    with umask(0o022):
        assert cli.main(["train", "train.yaml", "run.dir=out/tiny"]) == 0
        _import_and_export()
    trained = ("config.yaml", "metrics.jsonl", "samples.txt", "loss.png", "checkpoints/2")
    trained += ("tokenizer/tokenizer.json",)
    assert_modes(workdir / "out", 0o022, (*IMPORTED, *(f"tiny/{n}" for n in trained)))


def test_prepare_import_and_export_write_0600_under_umask_077(workdir):
    with umask(0o077):
        _import_and_export()
        assert cli.main(["prepare", "--corpus", "corpus.txt", "--out", "out/data"]) == 0
    prepared = ("data/meta.json", "data/train.bin", "data/val.bin", "data/tokenizer")
    assert_modes(workdir / "out", 0o077, (*IMPORTED, *prepared))
