"""benchmarks/attention_gpu.py's block-size search (issue 33 item 3), run on CPU with the flash
kernel interpreted (`--allow-cpu`, tiny sizes): a check of the script, not of speed."""

from __future__ import annotations

import json

import pytest
from _benchmarks import load_benchmark

from pallas_kernels.flash_attention import BlockSizes, defaults
from pallas_kernels.flash_attention.plan import check_blocks

TINY = [
    "--allow-cpu",
    "--seq-lens", "64",
    "--head-dims", "32",
    "--tokens", "128",
    "--hidden", "64",
    "--search-t", "64",
    "--calls", "1",
    "--samples", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("attention_gpu")


def test_the_candidates_are_wide_and_valid(bench):
    """Forward and backward candidates (tiles x warps x stages) each distinct and valid for
    the GPU kernel; the search starts from the table's entry, then the nearest changes (a
    change of tiles counting once)."""
    fwd, bwd = bench.candidates(backward=False), bench.candidates(backward=True)
    assert (len(fwd), len(set(fwd)), len(bwd), len(set(bwd))) == (24, 24, 36, 36)
    for bq, bk, warps, stages in fwd:
        check_blocks(BlockSizes(bq, bk, 64, 64, num_warps=warps, num_stages=stages), "gpu", False)
    for c in bwd:
        fields = dict(zip(bench.BWD_FIELDS, c, strict=True))
        check_blocks(BlockSizes(64, 64, **fields), "gpu", False)
    for entry in defaults.TABLE:
        start = tuple(getattr(entry.sizes, f) for f in bench.BWD_FIELDS)
        order = bench.ordered(bwd, start)
        assert order[0] == start and sorted(order) == sorted(bwd)
        knobs = [bench.knobs(c) for c in order]
        changed = [sum(a != b for a, b in zip(c, knobs[0], strict=True)) for c in knobs]
        assert changed == sorted(changed)


def test_the_backward_search_weighs_both_layouts(bench):
    """Issue 33 item 2: the backward candidates hold today's 64 x 64 tiles for both kernels and
    the FlashAttention-2 layout (dk/dv 32 queries x 128 keys, dq 128 x 32), at the Hopper
    head-128 entry's launch too; from that entry the 64 x 64 tiles are one step away."""
    tiles = {c[:4] for c in bench.candidates(backward=True)}
    assert {(64, 64, 64, 64), (32, 128, 128, 32)} <= tiles
    assert bench.BWD_FIELDS[:4] == ("block_q_bwd", "block_k_bwd", "block_q_dq", "block_k_dq")
    hopper = defaults.lookup("NVIDIA H200", 128).sizes
    start = tuple(getattr(hopper, f) for f in bench.BWD_FIELDS)
    assert start == (32, 128, 128, 32, 8, 5)
    order = bench.ordered(bench.candidates(backward=True), start)
    assert order[1] == (64, 64, 64, 64, 8, 5)


def test_the_search_writes_table_entries(bench, tmp_path):
    """Two candidates of each pass timed (forward alone, then forward+backward); the winner
    goes to "winners" in the table's entry form, measured, and the sweep runs it."""
    args = [*TINY, "--search-candidates", "2", "--results-dir", str(tmp_path)]
    assert bench.main(args) == 0
    result = json.loads((tmp_path / "attention_gpu.json").read_text())
    assert result["status"] == "done"
    search = result["block_size_search"]["32"]
    assert [len(search["forward"]), len(search["backward"])] == [2, 2]
    assert all("fwd_ms" in e for e in search["forward"])
    assert all("fwd_bwd_ms" in e for e in search["backward"])
    [winner] = result["winners"]
    entry = defaults.entry_from_dict(winner)
    assert (entry.generation, entry.head_dim) == (defaults.generation(result["device"]), 64)
    assert entry.measured.t == 64 and entry.measured.fwd_bwd_tflops > 0
    assert entry.measured.cudnn_ratio is None and "cudnn_error" in search  # no cuDNN on CPU
    assert "not a measurement" in entry.measured.note  # interpreted
    assert winner["sizes"] == search["chosen"] == result["rows"][0]["flash_block_sizes"]
    assert {"block_q_dq", "block_k_dq"} <= set(winner["sizes"])  # the dq tile travels too
    assert search["backward_best_ms"] == min(e["fwd_bwd_ms"] for e in search["backward"])


def test_the_search_keeps_to_its_budget(bench, tmp_path):
    """--budget-s 0: no candidate starts (each counted as skipped), no winner is written, and
    the sweep starts no point."""
    assert bench.main([*TINY, "--budget-s", "0", "--results-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "attention_gpu.json").read_text())
    search = result["block_size_search"]["32"]
    assert (search["forward"], search["backward"]) == ([], [])
    assert (search["forward_skipped"], search["backward_skipped"]) == (24, 36)
    assert result["winners"] == [] and list(result["winners_missing"]) == ["32"]
    assert result["status"] == "truncated_by_budget" and result["rows"] == []
