"""Smoke tests of benchmarks/decode.py and benchmarks/qlora_llama.py with tiny Llama shapes.

decode: `--quick` (a 2-layer GQA Llama, V 256) in-process, batches 1 and 2, 8 prompt tokens,
8 new tokens, one round: ~15 s CPU (~40 s wall on the loaded 2 cores; two small compiles).
qlora_llama: `--quick`, two fresh worker processes (torch + bitsandbytes + peft, and jax): ~25 s
CPU but ~3 min wall under load (the imports), so it is marked slow.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _benchmarks import load_benchmark

pytest.importorskip("transformers")

QUICK_DECODE = ["--quick", "--batches", "1", "2", "--prompt-len", "8", "--new-tokens", "8"]


def test_quick_decode_writes_json_with_identical_tokens(tmp_path):
    bench = load_benchmark("decode")
    out = tmp_path / "decode.json"
    result = bench.main([*QUICK_DECODE, "--rounds", "1", "--output", str(out)])
    data = json.loads(Path(result["path"]).read_text())
    assert Path(result["path"]) == out
    assert [r["batch"] for r in data["results"]] == [1, 2]
    for row in data["results"]:
        assert row["tokens_identical"]
        for side in ("lmjax", "transformers"):
            assert row["tokens_per_second"][side] == pytest.approx(
                row["batch"] * 8 / row["median_seconds"][side]
            )
        assert row["first_call_s"]["lmjax"] > row["median_seconds"]["lmjax"]  # compile inside
    assert len(data["load_average"]["before"]) == 3
    # The imported model has the tiny config's parameters, as transformers counts them.
    hf, params, cfg = bench.build_models(bench.QUICK, 0, tmp_path / "ckpt")
    assert data["model"]["parameters"] == sum(p.numel() for p in hf.parameters())

    # The witness can fail: tokens that differ in one place are refused, naming the count.
    real_run_hf = bench.run_hf
    bench.run_hf = lambda *a: real_run_hf(*a) + np.eye(1, 8, 3, dtype=np.int64)
    args = bench.parse_args([*QUICK_DECODE, "--rounds", "0"])
    with pytest.raises(AssertionError, match="differ at 1 of 8"):
        bench.bench_batch(hf, params, cfg, 1, args)


@pytest.mark.slow
def test_quick_qlora_llama_writes_json_with_agreeing_first_loss(tmp_path):
    bench = load_benchmark("qlora_llama")
    out = tmp_path / "qlora.json"
    args = ["--quick", "--batch", "2", "--seq-len", "16", "--steps", "1"]
    result = bench.main([*args, "--output", str(out)])
    data = json.loads(out.read_text())
    assert Path(result["path"]) == out
    runs = data["runs"]
    # Same r and targets on the same model: the same number of adapter parameters.
    assert runs["lmjax"]["trainable_params"] == runs["peft"]["trainable_params"] > 0
    # Same NF4 codes and B = 0: the first losses agree (NF4 codes bit-equal to bitsandbytes').
    assert data["first_loss_rel_diff"] < 1e-3
    for run in runs.values():
        assert len(run["step_s"]) == 1 and run["median_step_s"] > 0
        assert run["peak_process"] >= run["peak_steps"] > run["rss_before_steps"] * 0.5
