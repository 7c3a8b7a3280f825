"""Smoke test of benchmarks/prepare.py: `--quick --in-process` (0.2 MB, one worker)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _benchmarks import load_benchmark

pytest.importorskip("datasets")


def test_quick_run_writes_json_and_both_sides_agree(tmp_path):
    bench = load_benchmark("prepare")
    out = tmp_path / "prepare.json"
    result = bench.main(["--quick", "--in-process", "--output", str(out)])
    data = json.loads(Path(result["path"]).read_text())
    assert data["corpus"]["documents"] > 10 and data["corpus"]["bytes"] > 150_000
    # The same vocabulary and end-of-text rule on both sides: the same number of tokens.
    assert data["same_token_count"] and data["runs"]["lmjax"]["tokens"] > 10_000
    for run in data["runs"].values():
        assert run["mb_per_s"] > 0 and run["seconds"] > 0
    assert len(data["machine"]["load_average_before"]) == 3
