"""Smoke test of benchmarks/hf_tokenizer.py: `--quick` (0.2 MB, a 1,024-token vocabulary)."""

from __future__ import annotations

import json
from pathlib import Path

from _benchmarks import load_benchmark


def test_quick_run_writes_json_and_all_engines_agree(tmp_path):
    bench = load_benchmark("hf_tokenizer")
    result = bench.main(["--quick", "--output", str(tmp_path / "hf_tokenizer.json")])
    saved = json.loads(Path(result["path"]).read_text())
    assert saved["encode"]["vocab_size"] == 1024
    for corpus in ("natural", "unique_words"):
        part = saved["encode"][corpus]
        assert part["bytes"] > 150_000 and part["tokens"] > 10_000
        # lmjax now, tokenizers itself, and (with the git history at hand) lmjax's Python engine
        names = list(part["engines"])
        assert names[:2] == ["lmjax HFTokenizer.encode (tokenizers)", "tokenizers Tokenizer.encode"]
        for engine in part["engines"].values():
            assert engine["ids_equal_to_first"] and engine["mb_per_s"] > 0
